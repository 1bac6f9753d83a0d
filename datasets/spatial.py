"""Synthetic 3D spatial questions in the VSI-Bench style, rendered by MuJoCo with exact geometry.

A scene is a walled room with a mid-grey floor and 3..5 objects (box, sphere, cylinder) in
distinct named colours and random metric sizes, standing on the floor without overlap. A camera
walks a small circle in the middle of the room, looking outward and down; its ``n_views`` views
(in order along the path, view 1 looking along +x) are the sample's images. Together they cover
the whole room. All geometry is in metres, in the frame where the path's centre is the origin,
+x is view 1's heading and +z is up.

Ground truth comes from the model, not from the pixels' guesswork: closest-point distances from
``mujoco.mj_geomDistance``, sizes from the geom sizes, visibility (which view first shows an
object) from segmentation renders (at least ``min_visible_px`` pixels of the object).

Question families (``sample["reward"]`` names the accuracy reward; numeric answers score with
mean relative accuracy ``mra``, choices with exact letter match ``mcq``):

================  ==============================================================  ========  ======
family            example question                                                answer    reward
================  ==============================================================  ========  ======
obj_count         How many spheres are in the room?                               ``2``     mra
abs_distance      Distance between the closest points of the red box and the      ``1.23``  mra
                  blue sphere, in metres?
obj_size          Longest dimension of the red box, in centimetres?               ``55``    mra
rel_direction     Standing by the red box facing the blue sphere, is the green    ``C``     mcq
                  cylinder to my front-left, front-right, back-left, back-right?
rel_distance      Which of these objects is closest to the red box? + options     ``B``     mcq
appearance_order  First-time appearance order of three objects along the path?    ``A``     mcq
================  ==============================================================  ========  ======

Splits and seeds: sample ``i`` of split ``s`` draws from ``SeedSequence((seed, crc32(s), i))``, so
splits never share a random stream; the same arguments give byte-identical files.

Use :func:`generate` to write ``<out>/<split>.jsonl`` and ``<out>/images/<split>/<id>_v<k>.png``
(plus 16-bit depth PNGs in millimetres under ``<out>/depth/`` with ``depth=True``, listed in
``meta["depth"]`` relative to ``<out>``); :func:`reasoning_trace` gives a templated
``<think>…</think><answer>…</answer>`` target for the SFT warm start.

Scenes, cameras and rendering live in datasets/spatial_scene.py (re-exported here).
"""

from __future__ import annotations

import itertools
import json
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import cv2
import numpy as np

from .spatial_scene import SHAPES, SpatialConfig, cameras, render, sample_scene, scene_xml
from .synthetic import generator_config

__all__ = [
    "FAMILIES", "MODALITY", "QUADRANTS", "SHAPES", "SpatialConfig", "cameras", "generate",
    "iter_samples", "make_sample", "name", "quadrant", "reasoning_trace", "render",
    "sample_scene", "scene_xml",
]  # fmt: skip

FAMILIES: tuple[str, ...] = (
    "obj_count",
    "abs_distance",
    "obj_size",
    "rel_direction",
    "rel_distance",
    "appearance_order",
)
QUADRANTS: tuple[str, ...] = ("front-left", "front-right", "back-left", "back-right")
MODALITY = "3d"
"""``meta["modality"]`` of every sample (the evaluation table groups rows by it)."""
_LETTERS = "ABCDEFGH"


# --------------------------------------------------------------------------- questions

QA = tuple[str, str, dict]  # (question, answer, extra meta)


def name(o: dict) -> str:
    """An object's unique name in its scene (colours are unique): ``"red box"``."""
    return f"{o['color']} {o['shape']}"


def _mcq(rng: np.random.Generator, correct: str, wrong: Sequence[str]) -> tuple[list[str], str]:
    options = [correct, *wrong]
    options = [options[j] for j in rng.permutation(len(options))]
    return options, _LETTERS[options.index(correct)]


def _with_options(question: str, options: list[str]) -> str:
    lines = "\n".join(f"{_LETTERS[j]}. {o}" for j, o in enumerate(options))
    return f"{question}\n{lines}\nAnswer with the option's letter."


def _plural(shape: str) -> str:
    return "boxes" if shape == "box" else f"{shape}s"


def _q_count(rng, scene, dist, cfg) -> QA | None:
    objs = scene["objects"]
    if rng.random() < 1 / 3:
        return "How many objects are in the room?", str(len(objs)), {"filter": {}}
    shape = str(rng.choice(sorted({o["shape"] for o in objs})))
    n = sum(o["shape"] == shape for o in objs)
    return f"How many {_plural(shape)} are in the room?", str(n), {"filter": {"shape": shape}}


def _q_abs_distance(rng, scene, dist, cfg) -> QA | None:
    objs = scene["objects"]
    pairs = [(i, j) for i, j in itertools.combinations(range(len(objs)), 2) if dist[i, j] >= 0.2]
    if not pairs:
        return None
    i, j = pairs[int(rng.integers(len(pairs)))]
    q = (
        f"Measuring from the closest point of each object, what is the direct distance between "
        f"the {name(objs[i])} and the {name(objs[j])} in metres?"
    )
    return q, f"{dist[i, j]:.2f}", {"target": i, "reference": j, "value": float(dist[i, j])}


def _q_size(rng, scene, dist, cfg) -> QA | None:
    objs = scene["objects"]
    i = int(rng.integers(len(objs)))
    cm = 100 * max(objs[i]["extent"])
    q = (
        f"What is the length of the longest dimension (length, width or height) of the "
        f"{name(objs[i])} in centimetres?"
    )
    return q, str(round(cm)), {"target": i, "value": cm}


def quadrant(a: Sequence[float], b: Sequence[float], c: Sequence[float]) -> tuple[str, float]:
    """Quadrant of c for an observer at a facing b on the floor, and c's angle (degrees, 0 ahead,
    positive to the left) from the facing direction."""
    fx, fy = b[0] - a[0], b[1] - a[1]
    vx, vy = c[0] - a[0], c[1] - a[1]
    ahead = fx * vx + fy * vy
    left = fx * vy - fy * vx  # cross product: positive when c is to the left
    angle = math.degrees(math.atan2(left, ahead))
    return f"{'front' if ahead > 0 else 'back'}-{'left' if left > 0 else 'right'}", angle


def _q_rel_direction(rng, scene, dist, cfg) -> QA | None:
    objs = scene["objects"]
    m = cfg.direction_margin
    triples = []
    for i, j, k in itertools.permutations(range(len(objs)), 3):
        quad, ang = quadrant(objs[i]["pos"], objs[j]["pos"], objs[k]["pos"])
        if min(abs(ang), abs(abs(ang) - 90), abs(abs(ang) - 180)) >= m:
            triples.append((i, j, k, quad))
    if not triples:
        return None
    i, j, k, quad = triples[int(rng.integers(len(triples)))]
    options, letter = _mcq(rng, quad, [q for q in QUADRANTS if q != quad])
    q = _with_options(
        f"If I am standing by the {name(objs[i])} and facing the {name(objs[j])}, is the "
        f"{name(objs[k])} to my front-left, front-right, back-left or back-right?",
        options,
    )
    return (
        q,
        letter,
        {"standing": i, "facing": j, "target": k, "relation": quad, "options": options},
    )


def _q_rel_distance(rng, scene, dist, cfg) -> QA | None:
    objs = scene["objects"]
    if len(objs) < 3:
        return None
    i = int(rng.integers(len(objs)))
    others = [j for j in range(len(objs)) if j != i]
    k = int(rng.integers(2, min(4, len(others)) + 1))
    cands = sorted(rng.choice(others, size=k, replace=False).tolist(), key=lambda j: dist[i, j])
    if dist[i, cands[1]] - dist[i, cands[0]] < cfg.distance_margin:
        return None
    options, letter = _mcq(rng, name(objs[cands[0]]), [name(objs[j]) for j in cands[1:]])
    q = _with_options(
        f"Measuring from the closest point of each object, which of these objects is the closest "
        f"to the {name(objs[i])}?",
        options,
    )
    extra = {"target": i, "candidates": cands, "options": options}
    return q, letter, {**extra, "distances": [float(dist[i, j]) for j in cands]}


def _q_appearance(rng, scene, dist, cfg) -> QA | None:
    objs = scene["objects"]
    by_view: dict[int, list[int]] = {}
    for i, o in enumerate(objs):
        by_view.setdefault(o["first_view"], []).append(i)
    if len(by_view) < 3:
        return None
    views = sorted(rng.choice(sorted(by_view), size=3, replace=False).tolist())
    asked = [int(rng.choice(by_view[v])) for v in views]  # in order of first appearance
    perms = [p for p in itertools.permutations(asked) if list(p) != asked]
    wrong = [perms[j] for j in rng.choice(len(perms), size=3, replace=False)]
    fmt = lambda order: ", ".join(name(objs[i]) for i in order)  # noqa: E731
    shown = [asked[j] for j in rng.permutation(3)]
    options, letter = _mcq(rng, fmt(asked), [fmt(p) for p in wrong])
    q = _with_options(
        f"What is the first-time appearance order of the following objects along the camera "
        f"path: {fmt(shown)}?",
        options,
    )
    return q, letter, {"order": asked, "options": options}


_BUILDERS: dict[str, tuple[Callable, str]] = {
    # family -> (builder(rng, scene, distances, cfg) -> QA | None, reward name)
    "obj_count": (_q_count, "mra"),
    "abs_distance": (_q_abs_distance, "mra"),
    "obj_size": (_q_size, "mra"),
    "rel_direction": (_q_rel_direction, "mcq"),
    "rel_distance": (_q_rel_distance, "mcq"),
    "appearance_order": (_q_appearance, "mcq"),
}


# --------------------------------------------------------------------------- samples


def _seed_rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(split.encode()), index]))


def make_sample(
    split: str, index: int, family: str, seed: int = 0, cfg: SpatialConfig | None = None
) -> tuple[dict, dict]:
    """One sample (``images`` left empty) and its renders {"rgb", "depth"}; deterministic."""
    cfg = cfg or SpatialConfig()
    if family not in _BUILDERS:
        raise ValueError(f"unknown question family {family!r}; valid: {list(_BUILDERS)}")
    builder, reward = _BUILDERS[family]
    rng = _seed_rng(seed, split, index)
    for _ in range(cfg.max_tries):
        n = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
        scene = sample_scene(rng, n, cfg)
        if scene is None:
            continue
        views = render(scene, cfg)
        if any(o["first_view"] is None for o in scene["objects"]):
            continue  # an object hidden in every view cannot be asked about
        qa = builder(rng, scene, views["distances"], cfg)
        if qa is None:
            continue
        question, answer, extra = qa
        preface = f"The {cfg.n_views} images are views in order along a camera path in a room."
        meta = {
            "split": split,
            "modality": MODALITY,
            "image_size": [cfg.image_size, cfg.image_size],
            "room_half": scene["room_half"],
            "objects": scene["objects"],
            "cameras": [{k: c[k] for k in ("pos", "heading", "forward")} for c in cameras(cfg)],
            "fovy": cfg.fovy,
            **extra,
        }
        sample = {
            "id": f"spatial-{split}-{index:06d}",
            "images": [],
            "question": f"{preface}\n{question}",
            "answer": answer,
            "reward": reward,
            "family": family,
            "meta": meta,
        }
        return sample, views
    raise RuntimeError(
        f"could not build a {family!r} scene for {split}[{index}] in {cfg.max_tries} tries: "
        "room too small for max_objects, or margins too strict? Lower max_objects or "
        "direction_margin/distance_margin, or widen room_half."
    )


def iter_samples(
    split: str,
    n: int,
    families: Sequence[str] = FAMILIES,
    seed: int = 0,
    cfg: SpatialConfig | None = None,
) -> Iterator[tuple[dict, dict]]:
    """Samples 0..n-1 of a split; family of sample i is families[i % len(families)]."""
    for i in range(n):
        yield make_sample(split, i, families[i % len(families)], seed, cfg)


def _write_png(path: Path, img: np.ndarray) -> None:
    if not cv2.imwrite(str(path), img):
        raise OSError(f"could not write image {path}")


def generate(
    out_dir: str | Path,
    splits: dict[str, int] | None = None,
    families: Sequence[str] = FAMILIES,
    seed: int = 0,
    image_size: int = 112,
    **config,
) -> dict[str, Path]:
    """Write ``<out_dir>/<split>.jsonl`` and ``<out_dir>/images/<split>/<id>_v<k>.png``.

    Args:
        out_dir: output folder (created).
        splits: split name -> number of samples; default {"train": 1000, "val": 200, "test": 200}.
        families: question families, assigned round robin (see FAMILIES).
        seed: base seed; same arguments give byte-identical files.
        image_size: side of each view in pixels.
        **config: any other SpatialConfig field, e.g. n_views=6, depth=True.
    Returns:
        split name -> path of its JSONL file (image paths in it are relative to out_dir).
    """
    splits = {"train": 1000, "val": 200, "test": 200} if splits is None else splits
    cfg = generator_config(SpatialConfig, families, _BUILDERS, image_size=image_size, **config)
    out = Path(out_dir)
    paths: dict[str, Path] = {}
    for split, n in splits.items():
        (out / "images" / split).mkdir(parents=True, exist_ok=True)
        if cfg.depth:
            (out / "depth" / split).mkdir(parents=True, exist_ok=True)
        path = out / f"{split}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for sample, views in iter_samples(split, n, families, seed, cfg):
                sid = sample["id"]
                for k, img in enumerate(views["rgb"]):
                    rel = f"images/{split}/{sid}_v{k + 1}.png"
                    _write_png(out / rel, cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
                    sample["images"].append(rel)
                if cfg.depth:
                    sample["meta"]["depth"] = []
                    for k, d in enumerate(views["depth"]):
                        rel = f"depth/{split}/{sid}_v{k + 1}.png"
                        _write_png(out / rel, np.clip(d * 1000, 0, 65535).astype(np.uint16))
                        sample["meta"]["depth"].append(rel)
                f.write(json.dumps(sample) + "\n")
        paths[split] = path
    return paths


# --------------------------------------------------------------------------- SFT traces


def _xy(o: dict) -> str:
    return f"({o['pos'][0]:.1f}, {o['pos'][1]:.1f})"


def _trace_count(sample: dict, objs: list[dict]) -> str:
    shape = sample["meta"]["filter"].get("shape")
    hits = sorted((o for o in objs if shape in (None, o["shape"])), key=lambda o: o["first_view"])
    what = _plural(shape).capitalize() if shape else "Objects"
    listed = ", ".join(f"{name(o)} (view {o['first_view']})" for o in hits)
    return f"{what} seen: {listed}. Count: {len(hits)}."


def _trace_distance(sample: dict, objs: list[dict]) -> str:
    m = sample["meta"]
    a, b = objs[m["target"]], objs[m["reference"]]
    return (
        f"The {name(a)} is at {_xy(a)}, the {name(b)} at {_xy(b)}. "
        f"Their closest points are {sample['answer']} m apart."
    )


def _trace_size(sample: dict, objs: list[dict]) -> str:
    o = objs[sample["meta"]["target"]]
    dims = " x ".join(f"{100 * e:.0f}" for e in o["extent"])
    return f"The {name(o)} measures {dims} cm. Longest: {sample['answer']} cm."


def _trace_direction(sample: dict, objs: list[dict]) -> str:
    m = sample["meta"]
    a, b, c = objs[m["standing"]], objs[m["facing"]], objs[m["target"]]
    return (
        f"I stand at {_xy(a)} facing {_xy(b)}. The {name(c)} at {_xy(c)} is "
        f"{m['relation']}: option {sample['answer']}."
    )


def _trace_rel_distance(sample: dict, objs: list[dict]) -> str:
    m = sample["meta"]
    listed = ", ".join(
        f"{name(objs[j])} {d:.2f} m" for j, d in zip(m["candidates"], m["distances"])
    )
    return (
        f"Distances to the {name(objs[m['target']])}: {listed}. "
        f"Closest: {name(objs[m['candidates'][0]])}, option {sample['answer']}."
    )


def _trace_appearance(sample: dict, objs: list[dict]) -> str:
    listed = ", ".join(
        f"{name(objs[i])} in view {objs[i]['first_view']}" for i in sample["meta"]["order"]
    )
    return f"First seen: {listed}. Option {sample['answer']}."


_TRACES: dict[str, Callable[[dict, list[dict]], str]] = {
    "obj_count": _trace_count,
    "abs_distance": _trace_distance,
    "obj_size": _trace_size,
    "rel_direction": _trace_direction,
    "rel_distance": _trace_rel_distance,
    "appearance_order": _trace_appearance,
}


def reasoning_trace(sample: dict, tools: Sequence[str] = ()) -> str:
    """Templated chain of thought and answer for a generated sample (SFT warm start).

    Counting lists the matching objects with the view that first shows each; distances, sizes and
    directions state the exact positions (metres, path frame) or extents they follow from;
    choices end with the option's letter. Returns ``<think>…</think><answer>…</answer>``: one
    turn whatever the ``tools``.
    """
    fam = sample["family"]
    if fam not in _TRACES:
        raise ValueError(f"no reasoning trace for family {fam!r}; valid: {list(_TRACES)}")
    think = _TRACES[fam](sample, sample["meta"]["objects"])
    return f"<think>{think}</think><answer>{sample['answer']}</answer>"
