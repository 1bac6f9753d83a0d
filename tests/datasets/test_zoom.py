"""The small-object task: exact ground truth, a tile unreadable in the downscaled view and
readable after zooming into the named cell, distractors elsewhere, the control family, SFT
traces with tool calls."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from perceptrl.datasets import zoom
from perceptrl.registry import GENERATORS


def view(img: np.ndarray, side: int = 112) -> np.ndarray:
    """The image as the model sees it: downscaled with antialiasing (the processor's resize)."""
    return np.asarray(Image.fromarray(img).resize((side, side), Image.BICUBIC)).astype(float)


def inside(box, cell) -> bool:
    return (
        cell[0] <= box[0] - 3
        and box[2] + 3 <= cell[2]
        and cell[1] <= box[1] - 3
        and box[3] + 3 <= cell[3]
    )


@pytest.mark.parametrize("family", zoom.FAMILIES)
def test_ground_truth_and_layout(family):
    for i in range(12):
        s, img = zoom.make_sample("train", i, family, seed=3)
        m = s["meta"]
        x1, y1, x2, y2 = m["tile_box"]
        assert inside(m["tile_box"], m["zoom_box"])  # the tile, framed, lies in the named cell
        row, col = m["cell"]
        assert f"row {row}, column {col}" in s["question"]
        assert "(box [" + ", ".join(map(str, m["zoom_box"])) + "])" in s["question"]
        assert m["zoom_box"][:2] == [112 * (col - 1), 112 * (row - 1)]
        colours = {tuple(c) for c in img[y1:y2, x1:x2].reshape(-1, 3)}
        assert colours == set(zoom.PAIRS[m["pair"]])  # exactly the two colours of the answer
        assert s["answer"] == zoom.LETTERS[m["options"].index(m["pair"])]
        assert (1 <= len(m["distractors"]) <= 3) == (family == "small_tile")
        for d in m["distractors"]:  # in other cells
            assert not inside(d["box"], m["zoom_box"])
        again, img2 = zoom.make_sample("train", i, family, seed=3)
        assert again == s and np.array_equal(img, img2)


def test_small_tiles_are_grey_in_the_model_view_and_large_ones_are_not():
    spread = {}
    for family in zoom.FAMILIES:
        means = []
        for i in range(16):
            s, img = zoom.make_sample("val", i, family)
            x1, y1, x2, y2 = (v // 4 for v in s["meta"]["tile_box"])
            inner = view(img)[y1 + 1 : y2 - 1, x1 + 1 : x2 - 1].reshape(-1, 3)
            means.append(np.abs(inner - inner.mean(1, keepdims=True)).max())  # colourfulness
        spread[family] = max(means)
    assert spread["small_tile"] < 12  # under 5% of the contrast survives the 4x downscale
    assert spread["large_tile"] > 100


def test_generate_and_traces(tmp_path):
    paths = GENERATORS.get("zoom").generate(
        tmp_path, {"train": 4, "val": 2}, seed=0, image_size=448
    )
    rows = [json.loads(line) for line in open(paths["train"])]
    assert [r["family"] for r in rows] == ["small_tile", "large_tile"] * 2
    assert Image.open(tmp_path / rows[0]["images"][0]).size == (448, 448)
    gen = GENERATORS.get("zoom")
    turns = gen.reasoning_trace(rows[0], ["zoom"])
    box = ", ".join(str(v) for v in rows[0]["meta"]["zoom_box"])
    assert turns[0] == (
        f"<think>Too small to see; zoom in.</think><tool_call>zoom(box=[{box}])</tool_call>"
    )
    assert turns[1].endswith(f"<answer>{rows[0]['answer']}</answer>")
    assert isinstance(gen.reasoning_trace(rows[1], ["zoom"]), str)  # large tile: answer directly
    assert isinstance(gen.reasoning_trace(rows[0]), str)  # no tools: one turn
