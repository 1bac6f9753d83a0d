"""Shared fixtures: tiny models of both architectures (built once per session) and images."""

from __future__ import annotations

import contextlib
import dataclasses

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
