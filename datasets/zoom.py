"""Synthetic small-object questions where looking again is needed (the ``zoom`` tool's task).

A large image (448 px by default), cut into a ``grid`` x ``grid`` of cells, holds framed
checkered tiles; the question names a cell ("row 2, column 3", with its pixel box) and asks
which two colours make up its tile: red/cyan, green/magenta, blue/yellow or black/white. Every
pair averages to the same grey, and a small tile's pattern repeats every ``2 * small_cell``
pixels (3-px squares), so the model's view (the image downscaled 4x to 112 px) shows each small
tile as a grey square in its dark frame: measured with a bicubic 4x downscale, under 2% of the
colour contrast survives on average (4-px squares keep 20%). Zoomed into the named cell (the
cell at 4x, 448 px), the squares are 12 px, about a vision patch, and the colours are plain.
Small tiles have distractor tiles of random pairs in other cells, so a zoom into the wrong cell
reads the wrong tile.

Families (``sample["reward"]`` is ``mcq``, options in ``meta["options"]``):

==========  ==============================================================================
small_tile  the named cell holds a small tile (60 px of 3-px squares), 1-3 other cells hold
            distractors: unreadable in the downscaled view, read after zooming into the cell
            (``meta["zoom_box"]``, original-image pixels)
large_tile  the control: one large tile of four 48-px squares that the view resolves;
            zooming does not help
==========  ==============================================================================

:func:`reasoning_trace` writes the SFT targets: with the ``zoom`` tool, a small tile gets two
turns (zoom into the named cell, then answer) and a large tile one; without tools every sample
is answered in one turn (the colours of a small tile are then a guess).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .synthetic import generator_config, write_split

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
FAMILIES = ("small_tile", "large_tile")
OPTIONS = " ".join(f"{letter}. {name}" for letter, name in zip(LETTERS, PAIRS))


@dataclass(frozen=True)
class ZoomConfig:
    image_size: int = 448
    """image side in pixels"""
    grid: int = 4
    """the image is cut into grid x grid cells; a question names one"""
    small_tile: int = 60
    """side of a small tile in pixels (a multiple of 2 * small_cell)"""
    small_cell: int = 3
    """checker square of a small tile in pixels (3 or less vanishes in a 4x downscale)"""
    large_tile: int = 96
    """side of a large tile in pixels"""
    large_cell: int = 48
    """checker square of a large tile in pixels"""
    frame: int = 3
    """width of the dark frame around a tile"""
    distractors: tuple[int, int] = (1, 3)
    """fewest and most distractor tiles beside a small tile"""


def question(row: int, col: int, grid: int, box: Sequence[int]) -> str:
    """The question names the cell by grid position and by its pixel box (the zoom call's
    argument, so the call copies it rather than computing it)."""
    where = ", ".join(str(int(v)) for v in box)
    return (
        f"The checkered tile in row {row}, column {col} of the {grid} x {grid} grid (box "
        f"[{where}]): which two colours make it up? {OPTIONS}"
    )


def _tile(side: int, cell: int, pair: str) -> np.ndarray:
    """[side, side, 3] checkerboard of ``cell``-pixel squares in the pair's two colours."""
    a, b = (np.array(c, dtype=np.uint8) for c in PAIRS[pair])
    yy, xx = np.mgrid[0:side, 0:side]
    odd = ((yy // cell + xx // cell) % 2).astype(bool)
    return np.where(odd[..., None], b, a)


def _draw(rng, img: np.ndarray, cfg: ZoomConfig, cell_xy: tuple[int, int], side: int,
          square: int, pair: str) -> list[int]:  # fmt: skip
    """Draw a framed tile at a random place inside grid cell ``cell_xy``; returns its box."""
    step = cfg.image_size // cfg.grid
    outer = side + 2 * cfg.frame
    if outer > step:
        raise ValueError(f"a {side} px tile does not fit a {step} px grid cell; lower grid")
    gx, gy = cell_xy
    x = gx * step + cfg.frame + int(rng.integers(0, step - outer + 1))
    y = gy * step + cfg.frame + int(rng.integers(0, step - outer + 1))
    f = cfg.frame
    img[y - f : y + side + f, x - f : x + side + f] = FRAME
    img[y : y + side, x : x + side] = _tile(side, square, pair)
    return [x, y, x + side, y + side]


def make_sample(split: str, index: int, family: str, seed: int = 0,
                cfg: ZoomConfig | None = None) -> tuple[dict, np.ndarray]:  # fmt: skip
    """One sample (``images`` left empty) and its RGB image [H, W, 3]; deterministic."""
    cfg = cfg or ZoomConfig()
    if family not in FAMILIES:
        raise ValueError(f"unknown question family {family!r}; valid: {list(FAMILIES)}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(split.encode()), index]))
    names = list(PAIRS)
    pair = names[int(rng.integers(len(names)))]
    cells = [(int(c) % cfg.grid, int(c) // cfg.grid) for c in rng.permutation(cfg.grid**2)]
    img = np.empty((cfg.image_size, cfg.image_size, 3), dtype=np.uint8)
    img[:] = BACKGROUND
    small = family == "small_tile"
    side, square = (cfg.small_tile, cfg.small_cell) if small else (cfg.large_tile, cfg.large_cell)
    tile_box = _draw(rng, img, cfg, cells[0], side, square, pair)
    others = []
    if small:
        for c in cells[1 : 1 + int(rng.integers(cfg.distractors[0], cfg.distractors[1] + 1))]:
            other = names[int(rng.integers(len(names)))]
            others.append({"pair": other, "box": _draw(rng, img, cfg, c, side, square, other)})
    step = cfg.image_size // cfg.grid
    gx, gy = cells[0]
    zoom_box = [gx * step, gy * step, (gx + 1) * step, (gy + 1) * step]
    sample = {
        "id": f"zoom-{split}-{index:06d}", "images": [],
        "question": question(gy + 1, gx + 1, cfg.grid, zoom_box),
        "answer": LETTERS[names.index(pair)],
        "reward": "mcq", "family": family,
        "meta": {
            "split": split, "image_size": [cfg.image_size, cfg.image_size], "pair": pair,
            "options": names, "cell": [gy + 1, gx + 1], "tile_box": tile_box,
            "zoom_box": zoom_box,
            "distractors": others, "square": square,
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
    return {
        split: write_split(
            out,
            split,
            (make_sample(split, i, families[i % len(families)], seed, cfg) for i in range(n)),
        )
        for split, n in splits.items()
    }


def reasoning_trace(sample: dict, tools: Sequence[str] = ()) -> str | list[str]:
    """SFT target: with ``zoom`` among ``tools`` a small tile is two turns (zoom into the named
    cell, ``meta["zoom_box"]``, then answer), otherwise one turn that names the colours and
    answers."""
    m = sample["meta"]
    answer = f"<think>The tile is {m['pair']}.</think><answer>{sample['answer']}</answer>"
    if "zoom" not in tools or sample["family"] != "small_tile":
        return answer
    box = ", ".join(str(int(v)) for v in m["zoom_box"])
    look = f"<think>Too small to see; zoom in.</think><tool_call>zoom(box=[{box}])</tool_call>"
    return [look, answer]
