"""The vLLM rollout engine on image prompts: the CPU build runs a tiny Qwen2.5-VL
(``vlm/tiny.py``) on prompts that `VLMPolicy.encode` made from small PNGs, and its sampled
log-probs must be the trainer's (``VLMPolicy.evaluate``); a perturbed vision tower must reach the
engine only through the weight push; the same images sampled again after a push must work.
Run with ``make test-vllm`` (the lane's venv has torchvision, which transformers' Qwen2-VL
processors and vLLM's Qwen2-VL model code import)."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from PIL import Image, ImageDraw  # noqa: E402

from perceptrl.trainer import algos  # noqa: E402
from perceptrl.vlm.config import VLLMConfig  # noqa: E402
from perceptrl.vlm.policy import VLMPolicy  # noqa: E402
from perceptrl.vlm.rollout import SamplingParams  # noqa: E402
from perceptrl.vlm.sampler import Rollouts  # noqa: E402
from perceptrl.vlm.tiny import build_tiny  # noqa: E402
from perceptrl.vlm.vllm_rollout import VLLMEngine  # noqa: E402

QUESTIONS = ["How many red circles are there?", "What colour is the square?", "Count the objects."]
SIZES = [(112, 112), (140, 84), (84, 168)]  # (w, h): square, wide, tall
_SALT = itertools.count()
"""every image set differs in its pixels (vLLM keys its encoder cache on the pixels)"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("vllm_vl") / "m", seed=0)
    policy = VLMPolicy.from_pretrained(path)  # float32 on the CPU
    opts = VLLMConfig(kv_cache_bytes=64 << 20, enforce_eager=True, bucket_mb=1)
    engine = VLLMEngine(
        path, policy.processor, opts, max_model_len=1024, dtype="float32", stop_ids=policy.stop_ids
    )
    return policy, engine


def image_prompts(policy, tmp_path):
    """Encoded prompts of three one-image samples (square, wide, tall) and one with two images,
    drawn as the synthetic tasks are: shapes on a mid-grey background, new pixels each call."""
    salt = next(_SALT)
    rng = np.random.default_rng(salt)
    paths = []
    for i, (w, h) in enumerate(SIZES):
        img = Image.new("RGB", (w, h), (128, 128, 128))
        draw = ImageDraw.Draw(img)
        for colour in [(220, 40, 40), (40, 60, 220)]:
            x, y = int(rng.integers(0, w - 30)), int(rng.integers(0, h - 30))
            draw.ellipse([x, y, x + 24, y + 24], fill=colour)
        draw.rectangle([2, 2, 14 + salt % 7, 14], fill=(40, 200, 60))
        paths.append(tmp_path / f"img{salt}_{i}.png")
        img.save(paths[-1])
    samples = [
        {"id": i, "question": q, "images": [str(p)]}
        for i, (q, p) in enumerate(zip(QUESTIONS, paths))
    ]
    samples.append({"id": 3, "question": "Which is wider?", "images": [str(p) for p in paths[:2]]})
    prompts, _ = policy.encode(samples)
    return prompts


def vllm_sample(policy, engine, prompts, n, sp, sync=True):
    """``n`` rollouts per prompt on ``engine`` (the policy's weights pushed first unless
    ``sync`` is off: then the engine keeps what it has)."""
    if sync:
        return Rollouts(policy, engine).sample(prompts, n, sp)
    push, engine.sync_weights = engine.sync_weights, lambda model: {}
    try:
        return Rollouts(policy, engine).sample(prompts, n, sp)
    finally:
        engine.sync_weights = push


def _gap(policy, batch, temperature=1.0):
    policy.sampling = dataclasses.replace(policy.sampling, temperature=temperature)
    with torch.no_grad():
        logp = policy.evaluate(batch).logp
    return algos.rollout_gap_metrics(logp, batch.logp_rollout, batch.mask)["rollout_gap/abs_max"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_image_rollouts_score_like_the_trainer(setup, tmp_path, temperature):
    policy, engine = setup
    prompts = image_prompts(policy, tmp_path)
    grids = [p.vision["image_grid_thw"].tolist() for p in prompts]
    assert [len(g) for g in grids] == [1, 1, 1, 2] and grids[1] != grids[2]  # aspect kept
    torch.manual_seed(0)
    sp = SamplingParams(temperature=temperature, max_new_tokens=12)
    batch = vllm_sample(policy, engine, prompts, 2, sp)
    assert batch.tokens.shape[0] == 8 and batch.group_id.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [m["sample"]["id"] for m in batch.meta[::2]] == [0, 1, 2, 3]
    lp = batch.logp_rollout
    assert (lp[batch.mask > 0] < 0).all() and (lp[batch.mask == 0] == 0).all()
    vision = torch.tensor(engine.vision_ids)
    assert not torch.isin(batch.tokens[batch.mask > 0], vision).any()
    assert _gap(policy, batch, temperature) < 1e-4  # the engine saw the trainer's pixels


def test_the_vision_tower_reaches_the_engine_by_the_weight_push(setup, tmp_path):
    """Perturbing only the vision tower moves the trainer's log-probs (so both sides really read
    the images), the engine keeps its old tower until the push, and the push reaches it."""
    policy, engine = setup
    saved = copy.deepcopy(policy.model.state_dict())
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    g = torch.Generator().manual_seed(0)
    try:
        for group in ("visual.patch_embed", "visual.blocks", "visual.merger"):
            with torch.no_grad():
                for name, p in policy.model.named_parameters():
                    if group in name:
                        p.add_(torch.randn(p.shape, generator=g) * 0.2)
            prompts = image_prompts(policy, tmp_path)
            stale = _gap(policy, vllm_sample(policy, engine, prompts, 1, sp, sync=False))
            engine.sync_weights(policy.model)
            prompts = image_prompts(policy, tmp_path)
            synced = _gap(policy, vllm_sample(policy, engine, prompts, 1, sp, sync=False))
            assert stale > 1e-3, group  # the engine really had the old tower
            assert synced < 1e-4, group  # and now has the trainer's
    finally:
        policy.model.load_state_dict(saved)
        engine.sync_weights(policy.model)


def test_the_same_images_after_a_weight_push(setup, tmp_path):
    """Every rollout pushes the weights, which empties the worker's encoder cache; a second
    rollout on the same images must encode them again, not look up what the scheduler still
    lists as cached ("Encoder cache miss" otherwise). Seeded, the two rollouts are equal."""
    policy, engine = setup
    prompts = image_prompts(policy, tmp_path)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    torch.manual_seed(5)
    a = vllm_sample(policy, engine, prompts, 2, sp)
    torch.manual_seed(5)
    b = vllm_sample(policy, engine, prompts, 2, sp)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logp_rollout, b.logp_rollout)
    assert _gap(policy, b) < 1e-4
