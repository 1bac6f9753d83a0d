"""Synthetic small-object questions where looking again is needed (the ``zoom`` tool's task).

A large image (448 px by default) on the mid-grey background holds a few large distractor shapes
and one framed checkered tile: a checkerboard of two complementary colours (red/cyan,
green/magenta, blue/yellow or black/white). Every pair averages to the same grey, and the
pattern repeats every ``2 * cell`` pixels, so any window of that size holds as much of one
colour as of the other: downscaled by ``2 * cell`` or more (448 px to the 112 px the model sees)
the tile is a uniform grey square inside its dark frame. Where the tile is stays visible; what
it is made of does not. Zoomed in, the colours are plain.

Families (``sample["reward"]`` is ``mcq``, options in ``meta["options"]``):

==========  ==============================================================================
small_tile  the tile is small (24 px, 2 px cells): unreadable in the downscaled view, read
            after zooming into the grid cell that holds it (``meta["zoom_box"]``)
large_tile  the control: the same question about a large tile (96 px, 12 px cells) that the
            downscaled view resolves; zooming does not help
==========  ==============================================================================

The tile lies inside one cell of a ``grid`` x ``grid`` partition of the image; that cell, in
original-image pixels, is ``meta["zoom_box"]``, the region an SFT trace zooms into.
:func:`reasoning_trace` writes the SFT targets: with the ``zoom`` tool, a small tile gets two
turns (look closer, then answer) and a large tile one; without tools every sample is answered
in one turn (the colours of a small tile are then a guess).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from .clevr import generator_config

PAIRS: dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    "red and cyan": ((255, 0, 0), (0, 255, 255)),
    "green and magenta": ((0, 255, 0), (255, 0, 255)),
    "blue and yellow": ((0, 0, 255), (255, 255, 0)),
    "black and white": ((0, 0, 0), (255, 255, 255)),
}
"""Colour pairs of the tiles; each pair averages to the same grey (127.5 per channel)."""
LETTERS = "ABCD"
BACKGROUND = (128, 128, 128)
FRAME = (20, 20, 20)
DISTRACTORS = ((220, 40, 40), (40, 170, 40), (40, 80, 230), (240, 220, 40), (150, 50, 190))
FAMILIES = ("small_tile", "large_tile")
QUESTION = "Which two colours make up the checkered tile? " + " ".join(
    f"{letter}. {name}" for letter, name in zip(LETTERS, PAIRS)
)


@dataclass(frozen=True)
class ZoomConfig:
    image_size: int = 448
    """image side in pixels"""
    grid: int = 4
    """the image is cut into grid x grid cells; the tile lies inside one"""
    small_tile: int = 24
    """side of a small tile in pixels (a multiple of 2 * small_cell)"""
    small_cell: int = 2
    """checker cell of a small tile in pixels"""
    large_tile: int = 96
    """side of a large tile in pixels"""
    large_cell: int = 12
    """checker cell of a large tile in pixels"""
    frame: int = 3
    """width of the dark frame around a tile"""
    distractors: tuple[int, int] = (2, 4)
    """fewest and most large distractor shapes"""


def _tile(side: int, cell: int, pair: str) -> np.ndarray:
    """[side, side, 3] checkerboard of ``cell``-pixel squares in the pair's two colours."""
    a, b = (np.array(c, dtype=np.uint8) for c in PAIRS[pair])
    yy, xx = np.mgrid[0:side, 0:side]
    odd = ((yy // cell + xx // cell) % 2).astype(bool)
    return np.where(odd[..., None], b, a)


def _place(rng: np.random.Generator, cfg: ZoomConfig, side: int) -> tuple[int, int, list[int]]:
    """Top-left corner of a framed tile of ``side`` inside a random grid cell, and the cell's box."""
    step = cfg.image_size // cfg.grid
    outer = side + 2 * cfg.frame
    if outer > step:
        raise ValueError(f"a {side} px tile does not fit a {step} px grid cell; lower grid")
    gx, gy = (int(v) for v in rng.integers(0, cfg.grid, size=2))
    x = gx * step + cfg.frame + int(rng.integers(0, step - outer + 1))
    y = gy * step + cfg.frame + int(rng.integers(0, step - outer + 1))
    return x, y, [gx * step, gy * step, (gx + 1) * step, (gy + 1) * step]


def _distractors(rng, img: np.ndarray, cfg: ZoomConfig, keep_out: list[int]) -> None:
    """Large circles and squares away from the tile's cell (drawn in place)."""
    n = int(rng.integers(cfg.distractors[0], cfg.distractors[1] + 1))
    s = cfg.image_size
    for _ in range(n):
        for _try in range(50):
            r = int(rng.integers(s // 16, s // 9))
            cx, cy = (int(v) for v in rng.integers(r, s - r, size=2))
            x1, y1, x2, y2 = keep_out
            if x1 - r <= cx <= x2 + r and y1 - r <= cy <= y2 + r:
                continue
            colour = DISTRACTORS[int(rng.integers(len(DISTRACTORS)))]
            if rng.random() < 0.5:
                cv2.circle(img, (cx, cy), r, colour, -1, lineType=cv2.LINE_8)
            else:
                cv2.rectangle(img, (cx - r, cy - r), (cx + r, cy + r), colour, -1)
            break


def make_sample(split: str, index: int, family: str, seed: int = 0,
                cfg: ZoomConfig | None = None) -> tuple[dict, np.ndarray]:  # fmt: skip
    """One sample (``images`` left empty) and its RGB image [H, W, 3]; deterministic."""
    cfg = cfg or ZoomConfig()
    if family not in FAMILIES:
        raise ValueError(f"unknown question family {family!r}; valid: {list(FAMILIES)}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(split.encode()), index]))
    side, cell = (
        (cfg.small_tile, cfg.small_cell)
        if family == "small_tile"
        else (cfg.large_tile, cfg.large_cell)
    )
    pair = list(PAIRS)[int(rng.integers(len(PAIRS)))]
    x, y, box = _place(rng, cfg, side)
    img = np.empty((cfg.image_size, cfg.image_size, 3), dtype=np.uint8)
    img[:] = BACKGROUND
    _distractors(rng, img, cfg, box)
    f = cfg.frame
    img[y - f : y + side + f, x - f : x + side + f] = FRAME
    img[y : y + side, x : x + side] = _tile(side, cell, pair)
    letter = LETTERS[list(PAIRS).index(pair)]
    sample = {
        "id": f"zoom-{split}-{index:06d}", "images": [], "question": QUESTION, "answer": letter,
        "reward": "mcq", "family": family,
        "meta": {
            "split": split, "image_size": [cfg.image_size, cfg.image_size], "pair": pair,
            "options": list(PAIRS), "tile_box": [x, y, x + side, y + side], "zoom_box": box,
            "cell": cell,
        },
    }  # fmt: skip
    return sample, img


def generate(
    out_dir: str | Path,
    splits: dict[str, int] | None = None,
    families: Sequence[str] = FAMILIES,
    seed: int = 0,
    image_size: int = 448,
    **config,
) -> dict[str, Path]:
    """Write ``<out_dir>/<split>.jsonl`` and ``<out_dir>/images/<split>/<id>.png``; family of
    sample i is ``families[i % len(families)]``. ``config``: other `ZoomConfig` fields.
    Returns split -> JSONL path."""
    splits = {"train": 1000, "val": 200, "test": 200} if splits is None else splits
    builders = {f: None for f in FAMILIES}
    cfg = generator_config(ZoomConfig, families, builders, image_size=image_size, **config)
    out = Path(out_dir)
    paths = {}
    for split, n in splits.items():
        (out / "images" / split).mkdir(parents=True, exist_ok=True)
        path = out / f"{split}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for i in range(n):
                sample, img = make_sample(split, i, families[i % len(families)], seed, cfg)
                rel = f"images/{split}/{sample['id']}.png"
                if not cv2.imwrite(str(out / rel), cv2.cvtColor(img, cv2.COLOR_RGB2BGR)):
                    raise OSError(f"could not write image {out / rel}")
                sample["images"] = [rel]
                f.write(json.dumps(sample) + "\n")
        paths[split] = path
    return paths


def reasoning_trace(sample: dict, tools: Sequence[str] = ()) -> str | list[str]:
    """SFT target: with ``zoom`` among ``tools`` a small tile is two turns (zoom into
    ``meta["zoom_box"]``, then answer), otherwise one turn that names the colours and answers."""
    m = sample["meta"]
    answer = f"<think>The tile is {m['pair']}.</think><answer>{sample['answer']}</answer>"
    if "zoom" not in tools or sample["family"] != "small_tile":
        return answer
    box = ", ".join(str(int(v)) for v in m["zoom_box"])
    look = f"<think>Too small to read: zoom in.</think><tool_call>zoom(box=[{box}])</tool_call>"
    return [look, answer]
