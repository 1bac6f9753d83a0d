"""The vLLM rollout engine on image prompts: the CPU build runs a tiny Qwen2.5-VL
(``vlm/tiny.py``) on prompts that `VLMPolicy.encode` made from small PNGs, and its sampled
log-probs must be the trainer's (``VLMPolicy.evaluate``); a perturbed vision tower must reach the
engine only through the weight push; the same images sampled again after a push must work.
Run with ``make test-vllm`` (the lane's venv has torchvision, which transformers' Qwen2-VL
processors and vLLM's Qwen2-VL model code import)."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from PIL import Image, ImageDraw  # noqa: E402

from perceptrl.trainer.segments import OBSERVATION  # noqa: E402
from perceptrl.vlm.config import VLLMConfig  # noqa: E402
from perceptrl.vlm.episode import EpisodeSettings  # noqa: E402
from perceptrl.vlm.policy import VLMPolicy  # noqa: E402
from perceptrl.vlm.rollout import SamplingParams  # noqa: E402
from perceptrl.vlm.sampler import sampled_tokens  # noqa: E402
from perceptrl.vlm.schedule import TreeShape  # noqa: E402
from perceptrl.vlm.tiny import build_tiny  # noqa: E402
from perceptrl.vlm.tools import Observation  # noqa: E402
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


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_image_rollouts_score_like_the_trainer(setup, tmp_path, temperature, kit):
    policy, engine = setup
    prompts = image_prompts(policy, tmp_path)
    grids = [p.vision["image_grid_thw"].tolist() for p in prompts]
    assert [len(g) for g in grids] == [1, 1, 1, 2] and grids[1] != grids[2]  # aspect kept
    torch.manual_seed(0)
    sp = SamplingParams(temperature=temperature, max_new_tokens=12)
    batch = kit.sample(policy, engine, prompts, 2, sp)
    assert batch.tokens.shape[0] == 8 and batch.group_id.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [m["sample"]["id"] for m in batch.meta[::2]] == [0, 1, 2, 3]
    lp = batch.logp_rollout
    assert (lp[batch.mask > 0] < 0).all() and (lp[batch.mask == 0] == 0).all()
    vision = torch.tensor(engine.vision_ids)
    assert not torch.isin(batch.tokens[batch.mask > 0], vision).any()
    assert kit.gap(policy, batch, temperature) < 1e-4  # the engine saw the trainer's pixels


def test_the_vision_tower_reaches_the_engine_by_the_weight_push(setup, tmp_path, kit):
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
            stale = kit.gap(policy, kit.sample(policy, engine, prompts, 1, sp, sync=False))
            engine.sync_weights(policy.model)
            prompts = image_prompts(policy, tmp_path)
            synced = kit.gap(policy, kit.sample(policy, engine, prompts, 1, sp, sync=False))
            assert stale > 1e-3, group  # the engine really had the old tower
            assert synced < 1e-4, group  # and now has the trainer's
    finally:
        policy.model.load_state_dict(saved)
        engine.sync_weights(policy.model)


def test_the_same_images_after_a_weight_push(setup, tmp_path, kit):
    """Every rollout pushes the weights, which empties the worker's encoder cache; a second
    rollout on the same images must encode them again, not look up what the scheduler still
    lists as cached ("Encoder cache miss" otherwise). Seeded, the two rollouts are equal."""
    policy, engine = setup
    prompts = image_prompts(policy, tmp_path)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    torch.manual_seed(5)
    a = kit.sample(policy, engine, prompts, 2, sp)
    torch.manual_seed(5)
    b = kit.sample(policy, engine, prompts, 2, sp)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logp_rollout, b.logp_rollout)
    assert kit.gap(policy, b) < 1e-4


# ---- trees, episodes with image observations, trees of those episodes ----------------------------


class ImageEnv:
    """Answers the first ``turns - 1`` policy turns of every episode with a line of text and a
    small image of fresh random pixels (its size varies with the row and turn, so rows differ in
    vision tokens), then ends the episode. Episodes fork (trees): the copy continues its count."""

    def __init__(self, turns: int):
        self.k = turns
        self.rng = np.random.default_rng(next(_SALT))

    def reset(self, samples):
        self.turns = [0] * len(samples)

    def respond(self, row, text):
        self.turns[row] += 1
        k = self.turns[row]
        if k >= self.k:
            return None
        w, h = 56 + 28 * ((row + k) % 2), 56 + 28 * (k % 2)
        pixels = self.rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        return Observation(f"Look {k}.", [Image.fromarray(pixels)])

    def fork(self, src, dst):
        self.turns.extend([0] * (dst + 1 - len(self.turns)))
        self.turns[dst] = self.turns[src]


def _obs_spans(batch, row: int) -> list[torch.Tensor]:
    """Row ``row``'s observation segments in order, each as a [T] bool mask of its columns."""
    node = batch.segments.node[row]
    on = batch.segments.mask(OBSERVATION)[row] > 0
    return [node == s for s in node[on].unique_consecutive()]


def _blind_gap(kit, policy, batch) -> float:
    """`_gap` with every observation image replaced by noise: how much the tokens after an
    observation depend on its image (the gap test would miss an engine that saw other pixels
    otherwise)."""
    saved = batch.segments.vision
    g = torch.Generator().manual_seed(0)
    batch.segments.vision = [
        v and {**v, "pixel_values": torch.randn(v["pixel_values"].shape, generator=g)}
        for v in saved
    ]
    try:
        return kit.gap(policy, batch)
    finally:
        batch.segments.vision = saved


@pytest.mark.parametrize("bias", [-100.0, 3.0], ids=["full", "early_stops"])
def test_trees_on_image_prompts_share_segments_and_score_like_the_trainer(
    setup, tmp_path, bias, kit
):
    """[2, 2] trees of 6-token segments on image prompts (one and two images): siblings share
    their parent's segment token for token, a full tree decodes fewer tokens than its leaves
    hold, branches that stop hand their leaves to live ones, no completion holds a vision
    placeholder, and the engine's log-probs equal the training forward's."""
    policy, engine = setup
    prompts = image_prompts(policy, tmp_path)
    b, gap = kit.tree_rollout(policy, engine, prompts, bias)
    assert gap < 1e-4
    assert [m["sample"]["id"] for m in b.meta] == b.group_id.tolist()  # a prompt's rows adjacent
    assert not torch.isin(b.tokens[b.mask > 0], torch.tensor(engine.vision_ids)).any()
    kit.check_tree(b, policy, 4, bias)


@pytest.mark.parametrize("turns", [2, 3])
def test_episodes_with_image_observations_score_like_the_trainer(setup, tmp_path, turns, kit):
    """Episodes whose observations carry images, on a one-image and a two-image prompt: every
    observation segment holds its image's placeholder tokens (out of the loss), each row's
    observation images are the environment's in order, and the engine's log-probs equal the
    training forward's, which reads those images (noise in their place moves it)."""
    policy, engine = setup
    prompts = [image_prompts(policy, tmp_path)[i] for i in (0, 3)]
    with kit.shaped(
        policy, engine, episode=EpisodeSettings(env=lambda: ImageEnv(turns), max_tokens=160)
    ):
        torch.manual_seed(turns)
        sp = SamplingParams(temperature=1.0, max_new_tokens=16)
        b = kit.sample(policy, engine, prompts, 2, sp)
        gap, blind = kit.gap(policy, b), _blind_gap(kit, policy, b)
    logs = [m["episode"] for m in b.meta]
    assert len(b) == 4 and b.group_id.tolist() == [0, 0, 1, 1]
    assert sum(e["stop"] == "answer" and e["turns"] == turns for e in logs) >= 3
    obs = b.segments.mask(OBSERVATION)
    vision = torch.isin(b.tokens, torch.tensor(engine.vision_ids))
    assert (b.mask[obs > 0] == 0).all() and (obs[vision] == 1).all()
    merge = policy.processor.image_processor.merge_size
    seen = set()
    row_vision = b.segments.row_vision()
    for i, e in enumerate(logs):
        grid, pixels = row_vision["image_grid_thw"][i], row_vision["pixel_values"][i]
        spans = _obs_spans(b, i)
        assert len(spans) == e["calls"] == e["images"]  # one image per observation
        if not spans:
            assert grid is None and pixels is None and not vision[i].any()
            continue
        images = [im for ims in e["observation_images"] for im in ims]
        seen |= {im.tobytes() for im in images}
        want = policy.processor.image_processor(images=images, return_tensors="pt")
        assert torch.equal(grid, want["image_grid_thw"])
        assert torch.equal(pixels, want["pixel_values"])
        for span, thw in zip(spans, grid):  # each observation holds its own image's placeholders
            assert int(vision[i][span].sum()) == int(thw.prod()) // merge**2
    assert len(seen) == sum(e["images"] for e in logs) >= 3  # fresh pixels every observation
    lp = b.logp_rollout
    assert (lp[b.mask > 0] < 0).all() and (lp[b.mask == 0] == 0).all()
    assert gap < 1e-4 and blind > 1e-3


def test_episode_trees_share_the_first_turn_and_its_image(setup, tmp_path, kit):
    """Trees of 3-turn episodes with image observations forking after the first turn: the rows
    below the fork share the first turn and its observation, image included, token for token
    (the engine sends both rows the same image), see images of their own afterwards, and the
    engine's log-probs equal the training forward's."""
    policy, engine = setup
    prompts = image_prompts(policy, tmp_path)[:2]
    with kit.shaped(
        policy,
        engine,
        episode=EpisodeSettings(env=lambda: ImageEnv(3), max_tokens=200),
        tree=TreeShape((1, 2), 1),
    ):
        torch.manual_seed(4)
        sp = SamplingParams(temperature=1.0, max_new_tokens=12)
        b = kit.sample(policy, engine, prompts, 2, sp)
        gap = kit.gap(policy, b)
    assert gap < 1e-4
    assert b.segments.branches and b.group_id.tolist() == [0, 0, 1, 1]
    assert [m["episode"]["turns"] for m in b.meta] == [3] * 4
    for g in range(2):
        a, c = (b.group_id == g).nonzero().squeeze(1).tolist()
        first = b.segments.node[a, 0]
        assert b.segments.node[c, 0] == first  # one first turn per prompt
        end = _obs_spans(b, a)[0].nonzero().max() + 1  # the first turn and its observation
        assert torch.equal(b.tokens[a, :end], b.tokens[c, :end])
        assert torch.equal(b.segments.node[a, :end], b.segments.node[c, :end])
        assert torch.isin(b.tokens[a, :end], torch.tensor(engine.vision_ids)).any()
        row_vision = b.segments.row_vision()
        grids = [row_vision["image_grid_thw"][r] for r in (a, c)]
        pixels = [row_vision["pixel_values"][r] for r in (a, c)]
        n = int(grids[0][0].prod())  # the first image's patches
        assert torch.equal(grids[0][0], grids[1][0]) and torch.equal(pixels[0][:n], pixels[1][:n])
        assert not torch.equal(pixels[0][n:], pixels[1][n:])  # second images: fresh, apart
        ims = [b.meta[r]["episode"]["observation_images"] for r in (a, c)]
        assert ims[0][0][0].tobytes() == ims[1][0][0].tobytes()
        assert ims[0][1][0].tobytes() != ims[1][1][0].tobytes()
    assert sampled_tokens(b)[0] < sampled_tokens(b)[1]  # the shared first turn decoded once
