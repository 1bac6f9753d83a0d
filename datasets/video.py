"""Synthetic video questions: moving shapes with timed events, written as mp4 with OpenCV.

Every clip is ``seconds`` long at ``fps`` frames per second on the CLEVR generator's mid-grey
background, with its shapes and colours (:mod:`perceptrl.datasets.clevr`). Objects drift along
straight lines; events (an object appearing, disappearing, or crossing the frame) happen at
times that are multiples of ``1 / fps``, so the ground truth is exact in seconds. Every visible
span and every gap lasts at least ``min_event_s`` (1 s by default), so sampling at 2 fps (the
model-side default) sees each event.

===============  ====================================================  ==============  =======
family           example question                                      answer          reward
===============  ====================================================  ==============  =======
temporal_order   Which object appears first? + lettered options        ``"B"``         mcq
direction        In which direction does the red circle move? ...      ``"A"``         mcq
event_count      How many times does the blue square appear?           ``"2"``         count
grounding        When is the green triangle visible? [start, end] s    ``"[1.0, 3.0]"`` tiou
===============  ====================================================  ==============  =======

``meta["objects"]`` lists each object with its ``spans`` (visible ``[start, end)`` seconds),
``start``/``velocity`` (pixels, pixels per second) and drawing attributes; ``meta["events"]``
holds the family's answer facts. Sample ``i`` of split ``s`` draws from
``SeedSequence((seed, crc32(s), i))``; the same arguments write byte-identical JSONL (the mp4
bytes depend on the OpenCV build's encoder).

:func:`generate` writes ``<out>/<split>.jsonl`` and ``<out>/videos/<split>/<id>.mp4``;
:func:`reasoning_trace` gives a templated ``<think>…</think><answer>…</answer>`` target for SFT.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from .clevr import BACKGROUND, COLORS, SHAPES, ClevrConfig, render

FAMILIES: tuple[str, ...] = ("temporal_order", "direction", "event_count", "grounding")
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
_LETTERS = "ABCDEFGH"
_STEP = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


@dataclass(frozen=True)
class VideoTaskConfig:
    size: int = 112
    """frame side in pixels"""
    seconds: float = 4.0
    """clip length in seconds"""
    fps: int = 4
    """frames per second written to the file"""
    min_event_s: float = 1.0
    """shortest visible span and shortest gap between spans, in seconds"""
    radius: float = 0.1
    """object radius as a fraction of the frame side"""
    drift: float = 3.0
    """largest drift speed of non-moving-task objects, in pixels per second"""

    @property
    def frames(self) -> int:
        return int(round(self.seconds * self.fps))

    def __post_init__(self) -> None:
        if self.fps < 1 or self.frames < 2 * self.fps * self.min_event_s:
            raise ValueError(
                f"a {self.seconds} s clip at {self.fps} fps is too short for events of "
                f"{self.min_event_s} s; lengthen seconds or shorten min_event_s"
            )


def _r(cfg: VideoTaskConfig) -> int:
    return max(4, round(cfg.radius * cfg.size))


def _name(o: dict) -> str:
    return f"{o['color']} {o['shape']}"


def _objects(rng: np.random.Generator, n: int) -> list[dict]:
    """n objects with distinct colours (so "the red circle" is unique)."""
    colours = rng.choice(list(COLORS), size=n, replace=False)
    return [{"color": str(c), "shape": str(rng.choice(SHAPES))} for c in colours]


def _cells(rng: np.random.Generator, n: int, cfg: VideoTaskConfig) -> list[tuple[int, int]]:
    """Centres of n distinct cells of a 2x2 grid (objects that drift stay in their cell)."""
    q = cfg.size // 4
    cells = [(q, q), (3 * q, q), (q, 3 * q), (3 * q, 3 * q)]
    return [cells[i] for i in rng.permutation(4)[:n]]


def _drift(rng: np.random.Generator, cfg: VideoTaskConfig) -> list[float]:
    return [float(v) for v in rng.uniform(-cfg.drift, cfg.drift, size=2)]


def _unit(cfg: VideoTaskConfig) -> int:
    """Frames per step of the event time grid: 0.5 s where the frame rate allows."""
    return max(1, cfg.fps // 2)


def _spans(rng: np.random.Generator, k: int, cfg: VideoTaskConfig) -> list[list[float]] | None:
    """k visible spans [start, end) in seconds on a 0.5 s grid, each and each gap >= min_event_s."""
    u = _unit(cfg)
    n = cfg.frames // u  # grid steps in the clip
    m = max(1, int(round(cfg.min_event_s * cfg.fps / u)))  # steps per minimal span / gap
    if k == 0:
        return []
    if 2 * k * m - m > n:
        return None
    # split the n steps into 2k+1 parts: gap0, span1, gap1, ..., spank, gapk (gap0/gapk >= 0)
    free = n - (2 * k - 1) * m
    cuts = np.sort(rng.integers(0, free + 1, size=2 * k))
    parts = np.diff(np.concatenate([[0], cuts, [free]]))  # 2k+1 extra lengths
    t, out = 0, []
    for i in range(2 * k + 1):
        length = int(parts[i]) + (0 if i in (0, 2 * k) else m)
        if i % 2 == 1:
            out.append([t * u / cfg.fps, (t + length) * u / cfg.fps])
        t += length
    return out


def _q_temporal_order(rng, cfg):
    n = int(rng.integers(2, 4))
    objs = _objects(rng, n)
    m = int(round(cfg.min_event_s * cfg.fps))
    # distinct appearance frames at least m apart, the last early enough to stay m frames
    slots = list(range(0, cfg.frames - m + 1, m))
    if len(slots) < n:
        return None
    starts = sorted(rng.choice(slots, size=n, replace=False).tolist())
    order = rng.permutation(n)  # order[i]: which object appears i-th
    for pos, (c, o) in enumerate(zip(_cells(rng, n, cfg), (objs[j] for j in order))):
        o.update(
            start=list(c), velocity=_drift(rng, cfg), spans=[[starts[pos] / cfg.fps, cfg.seconds]]
        )
    first = objs[int(order[0])]
    options = [_name(o) for o in objs]
    q = "Which object appears first in the video?\n" + _options(options)
    events = {"order": [_name(objs[int(j)]) for j in order]}
    return objs, q, _LETTERS[options.index(_name(first))], {"options": options, "events": events}


def _q_direction(rng, cfg):
    n = int(rng.integers(1, 3))
    objs = _objects(rng, n)
    d = str(rng.choice(DIRECTIONS))
    dx, dy = _STEP[d]
    r, S = _r(cfg), cfg.size
    margin = r + 3
    travel = (S - 2 * margin) * float(rng.uniform(0.6, 1.0))
    lane = float(rng.uniform(margin, S - margin))
    along0 = margin if (dx + dy) > 0 else S - margin  # start at the side it moves away from
    start = [along0, lane] if dx else [lane, along0]
    mover = objs[0]
    speed = travel / cfg.seconds
    mover.update(start=start, velocity=[dx * speed, dy * speed], spans=[[0.0, cfg.seconds]])
    if n == 2:  # a still distractor away from the mover's lane
        off = lane + (S / 2 if lane < S / 2 else -S / 2)
        off = min(max(off, margin), S - margin)
        pos = [S / 2, off] if dx else [off, S / 2]
        objs[1].update(start=pos, velocity=[0.0, 0.0], spans=[[0.0, cfg.seconds]])
    options = list(rng.permutation(DIRECTIONS))
    q = f"In which direction does the {_name(mover)} move?\n" + _options(options)
    return objs, q, _LETTERS[options.index(d)], {"options": options, "events": {"direction": d}}


def _q_event_count(rng, cfg):
    m = int(round(cfg.min_event_s * cfg.fps))
    k = int(rng.integers(0, (cfg.frames + m) // (2 * m) + 1))
    spans = _spans(rng, k, cfg)
    if spans is None:
        return None
    n = int(rng.integers(1, 3))
    objs = _objects(rng, n + 1)
    cells = _cells(rng, n + 1, cfg)
    target = objs[0]
    target.update(start=list(cells[0]), velocity=_drift(rng, cfg), spans=spans)
    for o, c in zip(objs[1:], cells[1:]):  # distractors stay visible throughout
        o.update(start=list(c), velocity=_drift(rng, cfg), spans=[[0.0, cfg.seconds]])
    q = f"How many times does the {_name(target)} appear in the video?"
    return objs, q, str(k), {"events": {"appearances": spans}}


def _q_grounding(rng, cfg):
    spans = _spans(rng, 1, cfg)
    if spans is None:
        return None
    n = int(rng.integers(1, 3))
    objs = _objects(rng, n + 1)
    cells = _cells(rng, n + 1, cfg)
    target = objs[0]
    target.update(start=list(cells[0]), velocity=_drift(rng, cfg), spans=spans)
    for o, c in zip(objs[1:], cells[1:]):
        o.update(start=list(c), velocity=_drift(rng, cfg), spans=[[0.0, cfg.seconds]])
    s, e = spans[0]
    q = (
        f"When is the {_name(target)} visible? Answer with the start and end time in seconds "
        "as [start, end]."
    )
    return objs, q, format_span(s, e), {"events": {"span": [s, e]}}


_BUILDERS: dict[str, tuple[Callable, str]] = {
    "temporal_order": (_q_temporal_order, "mcq"),
    "direction": (_q_direction, "mcq"),
    "event_count": (_q_event_count, "count"),
    "grounding": (_q_grounding, "tiou"),
}


def format_span(start: float, end: float) -> str:
    return f"[{start:g}, {end:g}]"


def _options(options: Sequence[str]) -> str:
    return "\n".join(f"{_LETTERS[j]}. {o}" for j, o in enumerate(options))


def render_clip(objs: list[dict], cfg: VideoTaskConfig) -> np.ndarray:
    """Frames of a clip, [T, H, W, 3] uint8 RGB: frame j shows time j / fps."""
    scene_cfg = ClevrConfig(image_size=cfg.size)
    r = _r(cfg)
    out = np.empty((cfg.frames, cfg.size, cfg.size, 3), dtype=np.uint8)
    for j in range(cfg.frames):
        t = j / cfg.fps
        visible = []
        for o in objs:
            if any(a <= t < b for a, b in o["spans"]):
                x = o["start"][0] + o["velocity"][0] * t
                y = o["start"][1] + o["velocity"][1] * t
                visible.append(
                    {
                        "color": o["color"],
                        "shape": o["shape"],
                        "center": [round(x), round(y)],
                        "radius": r,
                    }
                )
        out[j] = render(visible, scene_cfg) if visible else np.array(BACKGROUND, dtype=np.uint8)
    return out


def write_mp4(frames: np.ndarray, path: str | Path, fps: int) -> Path:
    """Write RGB frames [T, H, W, 3] as an mp4 (MPEG-4 part 2, which decord reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    T, H, W, _ = frames.shape
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (W, H))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot open an mp4 writer for {path} (no mp4v encoder?)")
    try:
        for f in frames:
            writer.write(cv2.cvtColor(f, cv2.COLOR_RGB2BGR))
    finally:
        writer.release()
    return path


def _seed_rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(split.encode()), index]))


def make_sample(
    split: str, index: int, family: str, seed: int = 0, cfg: VideoTaskConfig | None = None
) -> tuple[dict, np.ndarray]:
    """One sample (``videos`` left empty) and its frames [T, H, W, 3]; deterministic."""
    cfg = cfg or VideoTaskConfig()
    if family not in _BUILDERS:
        raise ValueError(f"unknown video question family {family!r}; valid: {list(_BUILDERS)}")
    builder, reward = _BUILDERS[family]
    rng = _seed_rng(seed, split, index)
    for _ in range(100):
        built = builder(rng, cfg)
        if built is None:
            continue
        objs, question, answer, extra = built
        meta = {
            "split": split,
            "video_size": [cfg.size, cfg.size],
            "seconds": cfg.seconds,
            "fps": cfg.fps,
            "objects": objs,
            **extra,
        }
        sample = {
            "id": f"video-{split}-{index:06d}",
            "videos": [],
            "question": question,
            "answer": answer,
            "reward": reward,
            "family": family,
            "meta": meta,
        }
        return sample, render_clip(objs, cfg)
    raise RuntimeError(f"could not build a {family!r} clip for {split}[{index}]: {cfg}")


def generate(
    out_dir: str | Path,
    splits: dict[str, int] | None = None,
    families: Sequence[str] = FAMILIES,
    seed: int = 0,
    size: int = 112,
    seconds: float = 4.0,
    fps: int = 4,
) -> dict[str, Path]:
    """Write ``<out_dir>/<split>.jsonl`` and ``<out_dir>/videos/<split>/<id>.mp4``.

    Args:
        splits: split name -> number of samples (default train 1000, val 200, test 200).
        families: question families, assigned round robin (see FAMILIES).
        seed: base seed.
        size, seconds, fps: frame side, clip length and frame rate of the files.

    Returns:
        split name -> path of its JSONL file (video paths in it are relative to out_dir).
    """
    splits = {"train": 1000, "val": 200, "test": 200} if splits is None else splits
    bad = [f for f in families if f not in _BUILDERS]
    if bad or not families:
        raise ValueError(f"unknown video families {bad or families}; valid: {list(_BUILDERS)}")
    cfg = VideoTaskConfig(size=size, seconds=seconds, fps=fps)
    out = Path(out_dir)
    paths = {}
    for split, n in splits.items():
        lines = []
        for i in range(n):
            sample, frames = make_sample(split, i, families[i % len(families)], seed, cfg)
            rel = f"videos/{split}/{sample['id']}.mp4"
            write_mp4(frames, out / rel, cfg.fps)
            lines.append(json.dumps({**sample, "videos": [rel]}))
        paths[split] = out / f"{split}.jsonl"
        paths[split].parent.mkdir(parents=True, exist_ok=True)
        paths[split].write_text("\n".join(lines) + ("\n" if lines else ""))
    return paths


def check_video(path: str | Path, min_frames: int = 2) -> tuple[int, int, int, float]:
    """(width, height, frames, fps) of a video whose first and last frames decode.

    Raises:
        ValueError: missing, empty, undecodable, or fewer than ``min_frames`` frames.
    """
    p = str(path)
    if not Path(p).is_file():
        raise ValueError("file not found")
    if Path(p).stat().st_size == 0:
        raise ValueError("the file is empty (0 bytes)")
    try:
        import decord

        vr = decord.VideoReader(p, ctx=decord.cpu(0), num_threads=1)
        total, fps = len(vr), float(vr.get_avg_fps())
        if total < min_frames:
            raise ValueError(f"too short: {total} frame(s), at least {min_frames} are needed")
        frames = vr.get_batch([0, total - 1]).asnumpy()
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(
            f"not a decodable video ({type(e).__name__}: {str(e).strip()[:200]})"
        ) from e
    if not fps > 0:
        raise ValueError(f"invalid frame rate {fps!r}")
    return int(frames.shape[2]), int(frames.shape[1]), total, fps


# --------------------------------------------------------------------------- SFT traces


def _secs(t: float) -> str:
    return f"{t:g} s"


def reasoning_trace(sample: dict, tools: Sequence[str] = ()) -> str:
    """Templated chain of thought and answer for a generated video sample (SFT warm start): one
    turn whatever the ``tools``."""
    meta, fam, ans = sample["meta"], sample["family"], sample["answer"]
    ev = meta["events"]
    if fam == "temporal_order":
        think = "Order of appearance: " + ", then ".join(ev["order"]) + "."
        think += f" The {ev['order'][0]} appears first."
    elif fam == "direction":
        o = meta["objects"][0]
        think = f"The {_name(o)} moves {ev['direction']}."
    elif fam == "event_count":
        spans = ev["appearances"]
        o = meta["objects"][0]
        if spans:
            at = ", ".join(_secs(s) for s, _ in spans)
            times = "time" if len(spans) == 1 else "times"
            think = f"The {_name(o)} appears at {at}. That is {len(spans)} {times}."
        else:
            think = f"The {_name(o)} never appears. That is 0 times."
    elif fam == "grounding":
        s, e = ev["span"]
        o = meta["objects"][0]
        think = f"The {_name(o)} is visible from {_secs(s)} to {_secs(e)}."
    else:
        raise ValueError(f"no reasoning trace for video family {fam!r}; valid: {list(_BUILDERS)}")
    return f"<think>{think}</think><answer>{ans}</answer>"
