"""CLEVR-like generator: determinism, exact ground truth checked against the pixels, OOD split."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from perceptrl.datasets import clevr
from perceptrl.rewards import build_reward

SPLITS = {"train": 36, "val": 12, "test": 12, "ood": 24}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    out = tmp_path_factory.mktemp("clevr")
    paths = clevr.generate(out, SPLITS, seed=7)
    rows = {s: [json.loads(line) for line in open(p)] for s, p in paths.items()}
    return out, rows


def _rgb(out: Path, sample: dict) -> np.ndarray:
    img = cv2.imread(str(out / sample["images"][0]), cv2.IMREAD_COLOR)
    assert img is not None
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """Boolean masks of the 8-connected components of a boolean mask."""
    n, labels = cv2.connectedComponents(mask.astype(np.uint8), connectivity=8)
    return [labels == k for k in range(1, n)]


def _all(rows: dict[str, list[dict]]) -> list[dict]:
    return [s for split in rows.values() for s in split]


def test_files_layout_and_schema(data):
    out, rows = data
    assert {s: len(r) for s, r in rows.items()} == SPLITS
    for s in _all(rows):
        assert set(s) == {"id", "images", "question", "answer", "reward", "family", "meta"}
        assert s["images"] == [f"images/{s['meta']['split']}/{s['id']}.png"]
        assert s["reward"] == {"attr_mcq": "mcq", "spatial": "mcq", "grounding": "iou"}.get(
            s["family"], "numeric"
        )
        img = _rgb(out, s)
        assert img.shape == (112, 112, 3)
        assert tuple(img[0, 0]) == clevr.BACKGROUND  # mid-grey, not black
    assert {s["family"] for s in rows["train"]} == set(clevr.FAMILIES)


def test_deterministic_byte_identical(tmp_path):
    a = clevr.generate(tmp_path / "a", {"train": 8, "ood": 4}, seed=3)
    b = clevr.generate(tmp_path / "b", {"train": 8, "ood": 4}, seed=3)
    c = clevr.generate(tmp_path / "c", {"train": 8}, seed=4)
    for split in a:
        assert a[split].read_bytes() == b[split].read_bytes()
    assert a["train"].read_bytes() != c["train"].read_bytes()
    for png in sorted((tmp_path / "a" / "images").rglob("*.png")):
        assert png.read_bytes() == (tmp_path / "b" / png.relative_to(tmp_path / "a")).read_bytes()


def test_counts_match_connected_components(data):
    out, rows = data
    checked = 0
    for s in _all(rows):
        img = _rgb(out, s)
        objects = _components(np.any(img != clevr.BACKGROUND, axis=-1))
        assert len(objects) == len(s["meta"]["objects"]), s["id"]
        if s["family"] == "count_all":
            assert len(objects) == int(s["answer"])
            checked += 1
        elif s["family"] == "count_color":
            colour = s["meta"]["filter"]["color"]
            mask = np.all(img == clevr.COLORS[colour], axis=-1)
            assert len(_components(mask)) == int(s["answer"]), s["id"]
            checked += 1
    assert checked >= 10


def _shape_from_pixels(comp: np.ndarray) -> str:
    ys, xs = np.nonzero(comp)
    fill = comp.sum() / ((xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1))
    return "square" if fill > 0.95 else "circle" if fill > 0.65 else "triangle"


def test_objects_match_pixels_and_count_shape(data):
    """Each object's box is the exact extent of one component of its colour and shape."""
    out, rows = data
    for s in _all(rows):
        img = _rgb(out, s)
        for o in s["meta"]["objects"]:
            x1, y1, x2, y2 = o["box"]
            comps = [
                c
                for c in _components(np.all(img == clevr.COLORS[o["color"]], axis=-1))
                if c[o["center"][1], o["center"][0]]
            ]
            assert len(comps) == 1, (s["id"], o)
            ys, xs = np.nonzero(comps[0])
            assert [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1] == [x1, y1, x2, y2]
            assert _shape_from_pixels(comps[0]) == o["shape"], (s["id"], o)
        if s["family"] == "count_shape":
            shape = s["meta"]["filter"]["shape"]
            assert sum(o["shape"] == shape for o in s["meta"]["objects"]) == int(s["answer"])


def test_grounding_box_holds_the_named_object(data):
    out, rows = data
    grounding = [s for s in _all(rows) if s["family"] == "grounding"]
    assert grounding
    for s in grounding:
        img = _rgb(out, s)
        t = s["meta"]["objects"][s["meta"]["target"]]
        assert s["answer"] == clevr.format_box(t["box"])
        assert f"{t['color']} {t['shape']}" in s["question"]
        x1, y1, x2, y2 = t["box"]
        mask = np.all(img == clevr.COLORS[t["color"]], axis=-1)
        inside = [c for c in _components(mask) if c[y1:y2, x1:x2].sum() == c.sum()]
        assert len(inside) == 1 and inside[0].sum() > 20


def test_mcq_answers_are_consistent(data):
    _, rows = data
    for s in _all(rows):
        m = s["meta"]
        if s["family"] not in ("attr_mcq", "spatial"):
            continue
        chosen = m["options"]["ABCD".index(s["answer"])]
        t = m["objects"][m["target"]]
        if s["family"] == "attr_mcq":
            assert chosen == t[m["attribute"]]
        else:
            r = m["objects"][m["reference"]]
            dx, dy = t["center"][0] - r["center"][0], t["center"][1] - r["center"][1]
            expect = (
                ("left" if dx < 0 else "right")
                if abs(dx) > abs(dy)
                else ("above" if dy < 0 else "below")
            )
            assert chosen == expect == m["relation"]
        assert len(set(m["options"])) == len(m["options"])


def test_ood_split_holds_out_combos_and_counts():
    cfg = clevr.ClevrConfig()
    held = set(cfg.held_out_combos)
    novel = 0
    for split in ("train", "val", "test", "ood"):
        for s, _ in clevr.iter_samples(split, 60, seed=1, cfg=cfg):
            combos = {(o["color"], o["shape"]) for o in s["meta"]["objects"]}
            n = len(s["meta"]["objects"])
            if split == "ood":
                assert combos & held or n in cfg.held_out_counts, s["id"]
                novel += bool(combos & held) + (n in cfg.held_out_counts)
            else:
                assert not combos & held and n not in cfg.held_out_counts, s["id"]
    assert novel >= 60


def test_configurable_hold_out_and_size():
    cfg = clevr.ClevrConfig(
        image_size=(160, 96),
        max_objects=4,
        held_out_counts=(),
        held_out_combos=[["cyan", "circle"]],
    )
    s, img = clevr.make_sample("ood", 0, "count_all", cfg=cfg)
    assert img.shape == (96, 160, 3) and s["meta"]["image_size"] == [160, 96]
    assert ("cyan", "circle") in {(o["color"], o["shape"]) for o in s["meta"]["objects"]}
    with pytest.raises(ValueError, match="held_out_counts removes every count"):
        clevr.ClevrConfig(min_objects=2, max_objects=2, held_out_counts=(2,))


def test_splits_are_disjoint(data):
    out, rows = data
    ids = [s["id"] for s in _all(rows)]
    assert len(ids) == len(set(ids))
    digest = {
        s: {hashlib.sha1((out / x["images"][0]).read_bytes()).hexdigest() for x in r}
        for s, r in rows.items()
    }
    splits = list(digest)
    for i, a in enumerate(splits):
        for b in splits[i + 1 :]:
            assert not digest[a] & digest[b], (a, b)


def test_reasoning_traces_score_full_reward(data):
    _, rows = data
    samples = _all(rows)
    traces = [clevr.reasoning_trace(s) for s in samples]
    totals, comps, _ = build_reward({"format": 1.0, "accuracy": 1.0})(traces, samples)
    assert comps["format"] == [1.0] * len(samples)
    assert min(comps["accuracy"]) > 0.999
    count = next(s for s in samples if s["family"] == "count_all")
    names = clevr.reasoning_trace(count).split("Count:")[0]
    xs = [o["center"][0] for o in count["meta"]["objects"]]
    assert names.count(",") == len(xs) - 1  # every object listed once


def test_grounding_trace_uses_model_coordinates(data):
    _, rows = data
    s = next(x for x in _all(rows) if x["family"] == "grounding")
    s = {**s, "meta": {**s["meta"], "model_image_size": [224, 224]}}
    trace = clevr.reasoning_trace(s)
    x1, y1, x2, y2 = s["meta"]["objects"][s["meta"]["target"]]["box"]
    assert f"<answer>[{2 * x1}, {2 * y1}, {2 * x2}, {2 * y2}]</answer>" in trace
    _, comps, _ = build_reward(["iou"])([trace], [s])
    assert comps["iou"] == [1.0]


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown question families.*count_all"):
        clevr.generate(tmp_path, {"train": 1}, families=["counting"])
    with pytest.raises(TypeError, match="unknown ClevrConfig fields.*max_object"):
        clevr.generate(tmp_path, {"train": 1}, max_object=3)
    with pytest.raises(RuntimeError, match="too small"):
        clevr.make_sample(
            "train",
            0,
            "count_all",
            cfg=clevr.ClevrConfig(
                image_size=40, min_objects=6, max_objects=6, held_out_counts=(), max_tries=5
            ),
        )


def test_registry_generates_the_splits_it_can(tmp_path):
    from perceptrl.datasets.registry import modalities
    from perceptrl.registry import GENERATORS, UnknownName

    gen = GENERATORS.get("clevr")
    paths = gen.generate(
        tmp_path, {"train": 3, "val": 2, "test": 0, "ood": 2}, ["count_all", "grounding"],
        seed=1, image_size=64, seconds=9.0,  # an option clevr does not take is not passed
    )  # fmt: skip
    assert set(paths) == {"train", "val", "ood"}
    rows = [json.loads(line) for line in open(paths["train"])]
    assert [r["family"] for r in rows] == ["count_all", "grounding", "count_all"]
    assert gen.check_families([]) == ["count_all", "count_color", "count_shape"]
    with pytest.raises(ValueError, match="valid: count_all"):
        gen.check_families(["count_all", "temporal_order"])
    assert GENERATORS.get("video").check_families([]) == list(GENERATORS.get("video").families)
    assert modalities() == ("image", "video", "3d", "robot") and set(GENERATORS) == {
        "clevr",
        "video",
        "spatial",
        "zoom",
        "plan",
    }
    with pytest.raises(UnknownName, match="valid: clevr, plan, spatial, video, zoom"):
        GENERATORS.get("kitti")
