"""Shared fixtures: tiny models of both architectures (built once per session) and images."""

from __future__ import annotations

import contextlib
import dataclasses
import types

import pytest
import torch
from PIL import Image, ImageDraw

from perceptrl.vlm.policy import VLMPolicy
from perceptrl.vlm.tiny import ARCHS, build_tiny

COLOURS = {"red": (230, 40, 40), "blue": (40, 80, 230), "green": (40, 200, 60)}


def draw_scene(objects: list[tuple[str, int, int]], size=(112, 112)) -> Image.Image:
    """Black background with filled circles ``(colour, x, y)`` of radius 12."""
    im = Image.new("RGB", size, (0, 0, 0))
    d = ImageDraw.Draw(im)
    for colour, x, y in objects:
        d.ellipse([x - 12, y - 12, x + 12, y + 12], fill=COLOURS[colour])
    return im


@pytest.fixture(scope="session")
def scene():
    """``scene(objects, size)`` draws a test image (see ``draw_scene``)."""
    return draw_scene


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny_vlms")
    return {arch: build_tiny(arch, root / arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="session")
def images(tmp_path_factory) -> list[str]:
    """Six PNGs on disk, two of them non-square (so prompts differ in length)."""
    root = tmp_path_factory.mktemp("images")
    scenes = [
        [("red", 30, 30)],
        [("blue", 60, 60), ("red", 90, 30)],
        [("green", 20, 80), ("green", 80, 80), ("red", 50, 20)],
        [],
        [("red", 40, 40), ("blue", 100, 50)],
        [("blue", 20, 20)],
    ]
    paths = []
    for i, objs in enumerate(scenes):
        size = (168, 112) if i in (1, 4) else (112, 112)
        p = root / f"scene{i}.png"
        draw_scene(objs, size).save(p)
        paths.append(str(p))
    return paths


@pytest.fixture(scope="session")
def samples(images) -> list[dict]:
    qs = ["How many red circles are there?", "What colour is the circle? A. red B. blue"]
    return [
        {
            "id": f"s{i}",
            "images": [p],
            "question": qs[i % 2] + " Answer briefly." * (i % 3),
            "answer": str(i % 3),
            "reward": "numeric",
            "family": ["count", "mcq"][i % 2],
            "meta": {},
        }
        for i, p in enumerate(images)
    ]


@contextlib.contextmanager
def settings(policy: VLMPolicy, *, video=None, **sampling):
    """The policy's sampling settings (and video frame sampling) changed for a block: the tests
    share session-scoped policies, and a rollout source samples with the policy's settings."""
    saved = policy.sampling, policy.prompt
    policy.sampling = dataclasses.replace(policy.sampling, **sampling)
    if video is not None:
        policy.prompt = dataclasses.replace(policy.prompt, video=video)
    try:
        yield policy
    finally:
        policy.sampling, policy.prompt = saved


@pytest.fixture(scope="session")
def with_settings():
    """``with_settings(policy, video=..., **sampling)``: see `settings`."""
    return settings


@pytest.fixture(scope="session", params=ARCHS)
def policy(request, tiny_dirs) -> VLMPolicy:
    torch.manual_seed(0)
    return VLMPolicy.from_pretrained(tiny_dirs[request.param])


@pytest.fixture(scope="session")
def toy_reward():
    """Local stand-in for the composite reward: answer found (1) + format (0.5); it records the
    samples it was called with."""

    def reward(completions: list[str], samples: list[dict], ctx=None):
        reward.calls.append(samples)
        fmt = [1.0 if "<answer>" in c else 0.0 for c in completions]
        acc = [1.0 if s["answer"] in c else 0.0 for c, s in zip(completions, samples)]
        totals = [a + 0.5 * f for a, f in zip(acc, fmt)]
        return totals, {"accuracy": acc, "format": fmt}, {"failed": 0}

    reward.calls = []
    return reward


@pytest.fixture(scope="session")
def first_stop():
    """``(decode, ids) -> (j, s)``: a stop string ``s`` a sampled turn ``ids`` reaches at its
    token ``j`` (2 or later) and not before (the clean text that token adds), to rerun the same
    sampling with ``rollout.episode.stop`` and see the turn end there."""

    def pick(decode, ids: list[int]) -> tuple[int, str]:
        for j in range(2, len(ids)):
            before, text = decode(ids[: j - 1]), decode(ids[:j])
            piece = text[len(before) :]
            if (
                text.startswith(before)
                and piece.strip()
                and "\ufffd" not in piece
                and piece not in before
            ):
                return j, piece
        raise AssertionError(f"no usable stop string in the turn {decode(ids)!r}")

    return pick


# ---- the vLLM lanes' helpers (tests/vlm/test_vllm_*.py) -------------------------------------------


def _vllm_sample(policy, engine, prompts, n, sp, sync=True):
    """``n`` rollouts per prompt on ``engine`` (the policy's weights pushed first unless
    ``sync`` is off: then the engine keeps what it has)."""
    from perceptrl.vlm.sampler import Rollouts

    if sync:
        return Rollouts(policy, engine).sample(prompts, n, sp)
    push, engine.sync_weights = engine.sync_weights, lambda model: {}
    try:
        return Rollouts(policy, engine).sample(prompts, n, sp)
    finally:
        engine.sync_weights = push


def _rollout_gap(policy, batch, temperature=1.0) -> float:
    """Largest gap between the engine's log-probs and the training forward's at ``temperature``."""
    from perceptrl.trainer import algos

    policy.sampling = dataclasses.replace(policy.sampling, temperature=temperature)
    with torch.no_grad():
        logp = policy.evaluate(batch).logp
    return algos.rollout_gap_metrics(logp, batch.logp_rollout, batch.mask)["rollout_gap/abs_max"]


@contextlib.contextmanager
def _short_turns(policy, engine, bias: float = 6.0):
    """Add ``bias`` to the stop tokens' logits in both engines (a hook on the trainer's LM head,
    a logit bias on vLLM's requests, which its processed log-probs include): > 0 so a random
    tiny model closes its turns after a few tokens, -100 so that it never stops."""
    stops = torch.tensor(policy.stop_ids)

    def hook(module, args, out):
        return out.index_add(-1, stops, torch.full((*out.shape[:-1], len(stops)), bias))

    handle = policy.model.lm_head.register_forward_hook(hook)
    make = engine.sampling_params

    def biased(sp, n, seed):
        p = make(sp, n, seed)
        p.logit_bias = {**(p.logit_bias or {}), **dict.fromkeys(policy.stop_ids, bias)}
        return p

    engine.sampling_params = biased
    try:
        yield
    finally:
        handle.remove()
        del engine.sampling_params


@contextlib.contextmanager
def _shaped(policy, engine, *, episode=None, tree=None, bias: float = 6.0):
    """The policy's rollouts as ``episode`` and ``tree`` (None: single-turn, flat) with the stop
    tokens' logits moved by ``bias`` in both engines (`_short_turns`); both undone after."""
    policy.episode, policy.tree = episode, tree
    try:
        with _short_turns(policy, engine, bias):
            yield
    finally:
        policy.episode = policy.tree = None


def _tree_rollout(policy, engine, prompts, bias: float):
    """(batch, gap): [2, 2] trees of 6-token segments, 16 new tokens, seed 2, the stop tokens'
    logits moved by ``bias``, on ``engine``; the gap to the training forward."""
    from perceptrl.vlm.rollout import SamplingParams
    from perceptrl.vlm.schedule import TreeShape

    with _shaped(policy, engine, tree=TreeShape((2, 2), 6), bias=bias):
        torch.manual_seed(2)
        b = _vllm_sample(policy, engine, prompts, 4, SamplingParams(max_new_tokens=16))
        return b, _rollout_gap(policy, b)


def _check_tree(b, policy, groups: int, bias: float) -> None:
    """A [2, 2] tree of 6-token segments and 16 new tokens per leaf, ``groups`` prompts: a
    prompt's rows adjacent, a leaf ends with a stop token unless truncated; with no stop
    (``bias`` < 0) siblings share their first segment token for token and differ after it;
    with early stops, leaves of depth one and two, never more than 4 per prompt."""
    from perceptrl.vlm.sampler import sampled_tokens

    assert b.group_id.tolist() == sorted(b.group_id.tolist())
    for i, m in enumerate(b.meta):
        n = int(b.mask[i].sum())
        assert (int(b.tokens[i, n - 1]) in policy.stop_ids) != m["truncated"]
    if bias >= 0:
        short = b.mask.sum(1) <= 6
        assert short.any() and (~short).any()
        assert all(c <= 4 for c in torch.bincount(b.group_id).tolist())
        return
    assert len(b) == 4 * groups and b.mask.sum() == 4 * groups * 16
    assert sampled_tokens(b) == (groups * (2 * 6 + 4 * 10), 4 * groups * 16)
    for g in range(groups):
        rows = (b.group_id == g).nonzero().squeeze(1)
        seg = b.segments.node[rows]
        assert seg[:, :6].unique().numel() == 2 and seg[:, 6:].unique().numel() == 4
        for node in seg[:, 0].unique():
            pair = rows[seg[:, 0] == node]
            assert torch.equal(b.tokens[pair[0], :6], b.tokens[pair[1], :6])
            assert not torch.equal(b.tokens[pair[0], 6:], b.tokens[pair[1], 6:])


@pytest.fixture(scope="session")
def kit():
    """The vLLM tests' helpers: ``sample`` (rollouts on an engine), ``gap`` (engine vs
    training log-probs), ``short_turns`` (stop-token bias in both engines), ``shaped`` (that bias with episode and
    tree settings), ``tree_rollout`` and ``check_tree``."""
    return types.SimpleNamespace(
        sample=_vllm_sample, gap=_rollout_gap, short_turns=_short_turns, shaped=_shaped,
        tree_rollout=_tree_rollout, check_tree=_check_tree,
    )  # fmt: skip
