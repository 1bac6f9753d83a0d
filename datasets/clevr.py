"""Synthetic CLEVR-like image questions drawn with OpenCV, with exact ground truth.

A scene is 1..N flat shapes (circle, square, triangle) in named colours and two sizes, placed
without overlap (rejection sampling on bounding circles plus a pixel margin) on a mid-grey
background. Mid-grey matters: a from-scratch vision tower on black backgrounds stays blind.
Shapes are drawn without anti-aliasing, so every object pixel has exactly its colour and objects
are separate 8-connected components; ``meta["objects"]`` holds the exact geometry.

Question families (``sample["reward"]`` names the accuracy reward):

===========  ====================================================  =========  ==========
family       example question                                      answer     reward
===========  ====================================================  =========  ==========
count_all    How many objects are there?                           ``"3"``    numeric
count_color  How many red objects are there?                       ``"0"``    numeric
count_shape  How many circles are there?                           ``"2"``    numeric
count_sum    How many red and blue objects are there in total?     ``"3"``    numeric
count_size   How many objects, the small and the large ones?       ``"4"``    numeric
attr_mcq     What colour is the large square? + lettered options   ``"B"``    mcq
spatial      Where is the red circle relative to the blue square?  ``"A"``    mcq
grounding    What is the bounding box of the red circle? ...       ``"[x1, y1, x2, y2]"``  iou
===========  ====================================================  =========  ==========

Boxes are in original image pixels with exclusive upper edges (width = x2 - x1).

Splits and seeds: sample ``i`` of split ``s`` draws from its own stream
``SeedSequence((seed, crc32(s), i))``, so splits never share a random stream. The split named
``"ood"`` is the held-out split in the CLEVR-CoGenT manner: every other split excludes the
colour–shape pairs in ``ClevrConfig.held_out_combos`` and the object counts in
``ClevrConfig.held_out_counts``; every ``ood`` scene has a held-out count, a held-out pair, or both.

Use :func:`generate` to write ``<out>/<split>.jsonl`` and
``<out>/images/<split>/<id>.png``; :func:`reasoning_trace` gives a templated
``<think>…</think><answer>…</answer>`` target for the SFT warm start.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from .synthetic import format_box, generator_config, write_split

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 40),
    "blue": (40, 80, 230),
    "yellow": (240, 220, 40),
    "purple": (150, 50, 190),
    "cyan": (40, 210, 220),
}
"""Colour name -> RGB. All far from each other and from the background."""
BACKGROUND: tuple[int, int, int] = (128, 128, 128)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SIZES: tuple[str, ...] = ("small", "large")
FAMILIES: tuple[str, ...] = (
    "count_all",
    "count_color",
    "count_shape",
    "attr_mcq",
    "spatial",
    "grounding",
    "count_sum",
    "count_size",
)
RELATIONS: tuple[str, ...] = ("left", "right", "above", "below")
OOD_SPLIT = "ood"
_LETTERS = "ABCDEFGH"


@dataclass(frozen=True)
class ClevrConfig:
    image_size: int | tuple[int, int] = 112
    """image side in pixels, or (width, height)"""
    min_objects: int = 1
    """fewest objects in a scene"""
    max_objects: int = 6
    """most objects in a scene (counts in held_out_counts appear only in split "ood")"""
    held_out_counts: tuple[int, ...] = (6,)
    """object counts that only split "ood" uses; () holds out no count"""
    held_out_combos: tuple[tuple[str, str], ...] = (
        ("red", "triangle"),
        ("blue", "circle"),
        ("green", "square"),
    )
    """(colour, shape) pairs that only split "ood" uses; () holds out no pair"""
    colors: tuple[str, ...] = tuple(COLORS)
    """colour names to use (keys of COLORS)"""
    shapes: tuple[str, ...] = SHAPES
    """shape names to use (subset of SHAPES)"""
    small_radius: float = 0.065
    """radius of a small object as a fraction of the shorter image side"""
    large_radius: float = 0.11
    """radius of a large object as a fraction of the shorter image side"""
    gap: int = 3
    """minimum background pixels between two objects' bounding circles, and to the border"""
    min_separation: float = 0.08
    """spatial questions: least offset along the asked axis, as a fraction of the shorter side"""
    max_tries: int = 200
    """placement attempts per object and scene attempts per sample before giving up"""

    def __post_init__(self) -> None:  # normalise lists from YAML/JSON to tuples
        object.__setattr__(self, "held_out_combos", tuple(tuple(c) for c in self.held_out_combos))
        for name in ("held_out_counts", "colors", "shapes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        bad = [c for c in self.colors if c not in COLORS] + [
            s for s in self.shapes if s not in SHAPES
        ]
        if bad:
            raise ValueError(
                f"unknown colours/shapes {bad}; valid: {list(COLORS)} and {list(SHAPES)}"
            )
        if not 1 <= self.min_objects <= self.max_objects:
            raise ValueError(
                f"need 1 <= min_objects <= max_objects, got {self.min_objects}..{self.max_objects}"
            )
        if not self.in_dist_counts:
            raise ValueError(
                "held_out_counts removes every count in min_objects..max_objects; "
                "widen the range or hold out fewer counts"
            )

    @property
    def size_wh(self) -> tuple[int, int]:
        s = self.image_size
        return (int(s), int(s)) if isinstance(s, int) else (int(s[0]), int(s[1]))

    @property
    def in_dist_counts(self) -> list[int]:
        rng = range(self.min_objects, self.max_objects + 1)
        return [k for k in rng if k not in self.held_out_counts]


# --------------------------------------------------------------------------- scenes


def _radius(cfg: ClevrConfig, size: str) -> int:
    frac = cfg.small_radius if size == "small" else cfg.large_radius
    return max(3, round(frac * min(cfg.size_wh)))


def _outer_radius(shape: str, r: int) -> float:
    """Radius of a circle around the drawn shape (for overlap tests)."""
    return {"circle": r, "square": 0.9 * r * math.sqrt(2), "triangle": 1.15 * r}[shape]


def _draw(mask: np.ndarray, shape: str, cx: int, cy: int, r: int) -> None:
    """Fill one shape of half-extent r centred at (cx, cy) into a uint8 mask [H, W]."""
    if shape == "circle":
        cv2.circle(mask, (cx, cy), r, 255, -1, lineType=cv2.LINE_8)
        return
    if shape == "square":
        h = round(0.9 * r)
        pts = [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    else:  # equilateral triangle pointing up, circumradius 1.15 r
        R = 1.15 * r
        pts = [
            (cx, cy - R),
            (cx + R * math.sqrt(3) / 2, cy + R / 2),
            (cx - R * math.sqrt(3) / 2, cy + R / 2),
        ]
    poly = np.round(np.array(pts, dtype=np.float64)).astype(np.int32)  # (V, 2)
    cv2.fillPoly(mask, [poly], 255, lineType=cv2.LINE_8)


def _pick_combo(
    rng: np.random.Generator, cfg: ClevrConfig, allow_held_out: bool
) -> tuple[str, str]:
    held = set(cfg.held_out_combos)
    for _ in range(cfg.max_tries):
        combo = (str(rng.choice(cfg.colors)), str(rng.choice(cfg.shapes)))
        if allow_held_out or combo not in held:
            return combo
    raise ValueError("held_out_combos covers every colour–shape pair; hold out fewer pairs")


def sample_scene(
    rng: np.random.Generator,
    n: int,
    cfg: ClevrConfig,
    first_combo: tuple[str, str] | None = None,
    allow_held_out: bool = False,
) -> list[dict] | None:
    """Place n non-overlapping objects; None when placement fails (caller resamples).

    Returns a list of {"color", "shape", "size", "center": [x, y], "radius"} in placement order.
    """
    W, H = cfg.size_wh
    objs: list[dict] = []
    for k in range(n):
        color, shape = (
            first_combo if (k == 0 and first_combo) else _pick_combo(rng, cfg, allow_held_out)
        )
        size = str(rng.choice(SIZES))
        r = _radius(cfg, size)
        outer = _outer_radius(shape, r)
        lo = math.ceil(outer) + cfg.gap
        if W - lo <= lo or H - lo <= lo:
            return None
        for _ in range(cfg.max_tries):
            cx, cy = int(rng.integers(lo, W - lo)), int(rng.integers(lo, H - lo))
            if all(
                math.hypot(cx - o["center"][0], cy - o["center"][1])
                >= outer + _outer_radius(o["shape"], o["radius"]) + cfg.gap
                for o in objs
            ):
                break
        else:
            return None
        objs.append({"color": color, "shape": shape, "size": size, "center": [cx, cy], "radius": r})
    return objs


def render(objs: list[dict], cfg: ClevrConfig) -> np.ndarray:
    """Draw a scene; fills each object's exact "box" [x1, y1, x2, y2] (exclusive) in place.

    Returns an RGB uint8 image [H, W, 3].
    """
    W, H = cfg.size_wh
    img = np.empty((H, W, 3), dtype=np.uint8)
    img[:] = BACKGROUND
    for o in objs:
        mask = np.zeros((H, W), dtype=np.uint8)
        _draw(mask, o["shape"], o["center"][0], o["center"][1], o["radius"])
        ys, xs = np.nonzero(mask)
        o["box"] = [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]
        img[mask > 0] = COLORS[o["color"]]
    return img


# --------------------------------------------------------------------------- questions

QA = tuple[str, str, dict]  # (question, answer, extra meta)


def _describe(objs: list[dict], i: int, attrs: Sequence[str]) -> str | None:
    """Shortest unique description of objs[i] using attrs (+ size if needed), or None."""
    o = objs[i]
    for use in (tuple(attrs), ("size", *attrs)):
        if sum(all(p[a] == o[a] for a in use) for p in objs) == 1:
            noun = o["shape"] if "shape" in use else "object"
            return " ".join([*(o[a] for a in use if a != "shape"), noun])
    return None


def _mcq(
    rng: np.random.Generator, correct: str, pool: Sequence[str], k: int = 4
) -> tuple[list[str], str]:
    others = [p for p in pool if p != correct]
    chosen = [correct, *rng.choice(others, size=min(k - 1, len(others)), replace=False).tolist()]
    order = rng.permutation(len(chosen))
    options = [str(chosen[j]) for j in order]
    return options, _LETTERS[options.index(correct)]


def _options_text(options: list[str]) -> str:
    return "\n".join(f"{_LETTERS[j]}. {o}" for j, o in enumerate(options))


def _q_count_all(rng, objs, cfg, ood) -> QA | None:
    return "How many objects are there?", str(len(objs)), {"filter": {}}


def _q_count_attr(attr: str, plural: Callable[[str], str]):
    def q(rng, objs, cfg, ood) -> QA | None:
        pool = cfg.colors if attr == "color" else cfg.shapes
        present = sorted({o[attr] for o in objs})
        novel = sorted({o[attr] for o in objs if (o["color"], o["shape"]) in cfg.held_out_combos})
        if ood and novel:  # in OOD scenes, ask about the held-out pair's attribute
            value = str(rng.choice(novel))
        else:  # mostly a value present in the scene, sometimes any value (answer may be 0)
            value = str(rng.choice(present if rng.random() < 0.8 else pool))
        n = sum(o[attr] == value for o in objs)
        return f"How many {plural(value)} are there?", str(n), {"filter": {attr: value}}

    return q


def _q_count_sum(rng, objs, cfg, ood) -> QA | None:
    """Two colours' objects in total: a question of several steps (a sub-count per colour, then
    their sum); ``meta["steps"]`` holds the sub-counts a process reward checks."""
    present = sorted({o["color"] for o in objs})
    if len(present) < 2:
        return None
    pair = sorted(str(c) for c in rng.choice(present, size=2, replace=False))
    counts = {c: sum(o["color"] == c for o in objs) for c in pair}
    q = (
        f"How many {pair[0]} and {pair[1]} objects are there in total? "
        f"Count each colour first (as '{pair[0]}: N'), then add."
    )
    return q, str(sum(counts.values())), {"filter": {"color": pair}, "steps": counts}


def _q_count_size(rng, objs, cfg, ood) -> QA | None:
    """All objects counted in two steps, the small ones and the large ones, then the sum: the
    steps every object takes part in, so a sub-count is any number from 0 to the scene's
    (``count_sum``'s colours mostly hold one object each)."""
    counts = {z: sum(o["size"] == z for o in objs) for z in SIZES}
    q = (
        "How many objects are there? "
        f"Count the {SIZES[0]} and the {SIZES[1]} ones first (as '{SIZES[0]}: N'), then add."
    )
    return q, str(len(objs)), {"filter": {"size": list(SIZES)}, "steps": counts}


def _q_attr_mcq(rng, objs, cfg, ood) -> QA | None:
    ask = "color" if rng.random() < 0.5 else "shape"
    ref = ["shape"] if ask == "color" else ["color"]
    cands = [(i, d) for i in range(len(objs)) if (d := _describe(objs, i, ref))]
    if not cands:
        return None
    i, desc = cands[int(rng.integers(len(cands)))]
    pool = cfg.colors if ask == "color" else cfg.shapes
    options, letter = _mcq(rng, objs[i][ask], pool)
    word = "colour" if ask == "color" else "shape"
    q = f"What {word} is the {desc}?\n{_options_text(options)}\nAnswer with the option's letter."
    return q, letter, {"target": i, "attribute": ask, "description": desc, "options": options}


def _relation(a: dict, b: dict, min_sep: float) -> str | None:
    """Relation of a to b when one axis clearly dominates, else None."""
    dx, dy = a["center"][0] - b["center"][0], a["center"][1] - b["center"][1]
    if abs(dx) >= 2 * abs(dy) and abs(dx) >= min_sep:
        return "left" if dx < 0 else "right"
    if abs(dy) >= 2 * abs(dx) and abs(dy) >= min_sep:
        return "above" if dy < 0 else "below"
    return None


def _q_spatial(rng, objs, cfg, ood) -> QA | None:
    min_sep = cfg.min_separation * min(cfg.size_wh)
    desc = [_describe(objs, i, ["color", "shape"]) for i in range(len(objs))]
    pairs = [
        (i, j, rel)
        for i in range(len(objs))
        for j in range(len(objs))
        if i != j and desc[i] and desc[j] and (rel := _relation(objs[i], objs[j], min_sep))
    ]
    if not pairs:
        return None
    i, j, rel = pairs[int(rng.integers(len(pairs)))]
    options, letter = _mcq(rng, rel, RELATIONS)
    q = (
        f"Where is the {desc[i]} relative to the {desc[j]}?\n{_options_text(options)}\n"
        "Answer with the option's letter."
    )
    return (
        q,
        letter,
        {
            "target": i,
            "reference": j,
            "relation": rel,
            "options": options,
            "description": desc[i],
            "reference_description": desc[j],
        },
    )


def _q_grounding(rng, objs, cfg, ood) -> QA | None:
    cands = [(i, d) for i in range(len(objs)) if (d := _describe(objs, i, ["color", "shape"]))]
    if not cands:
        return None
    i, desc = cands[int(rng.integers(len(cands)))]
    q = f"What is the bounding box of the {desc}? Answer as [x1, y1, x2, y2] in pixels."
    return q, format_box(objs[i]["box"]), {"target": i, "description": desc}


_BUILDERS: dict[str, tuple[Callable, str, int]] = {
    # family -> (builder(rng, objs, cfg, ood) -> QA | None, reward name, min objects)
    "count_all": (_q_count_all, "numeric", 1),
    "count_color": (_q_count_attr("color", lambda c: f"{c} objects"), "numeric", 1),
    "count_shape": (_q_count_attr("shape", lambda s: f"{s}s"), "numeric", 1),
    "count_sum": (_q_count_sum, "numeric", 2),
    "count_size": (_q_count_size, "numeric", 1),
    "attr_mcq": (_q_attr_mcq, "mcq", 1),
    "spatial": (_q_spatial, "mcq", 2),
    "grounding": (_q_grounding, "iou", 1),
}


# --------------------------------------------------------------------------- samples


def _seed_rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(split.encode()), index]))


def _scene_plan(
    rng: np.random.Generator, cfg: ClevrConfig, min_n: int, ood: bool
) -> tuple[int, tuple[str, str] | None]:
    """Number of objects and an optional forced first (colour, shape) pair."""
    if not ood:
        counts = [k for k in cfg.in_dist_counts if k >= min_n]
        if not counts:
            raise ValueError(f"no in-distribution object count >= {min_n}; raise max_objects")
        return int(rng.choice(counts)), None
    counts = [k for k in range(max(cfg.min_objects, min_n), cfg.max_objects + 1)]
    held_n = [k for k in cfg.held_out_counts if k >= min_n]
    combos = list(cfg.held_out_combos)
    if not held_n and not combos:
        raise ValueError('split "ood" needs held_out_counts or held_out_combos')
    if held_n and (not combos or rng.random() < 0.5):
        return int(rng.choice(held_n)), None
    return int(rng.choice(counts)), combos[int(rng.integers(len(combos)))]


def make_sample(
    split: str, index: int, family: str, seed: int = 0, cfg: ClevrConfig | None = None
) -> tuple[dict, np.ndarray]:
    """One sample (with ``images`` left empty) and its RGB image [H, W, 3]; deterministic."""
    cfg = cfg or ClevrConfig()
    if family not in _BUILDERS:
        raise ValueError(f"unknown question family {family!r}; valid: {list(_BUILDERS)}")
    builder, reward, min_n = _BUILDERS[family]
    ood = split == OOD_SPLIT
    rng = _seed_rng(seed, split, index)
    for _ in range(cfg.max_tries):
        n, first = _scene_plan(rng, cfg, min_n, ood)
        objs = sample_scene(rng, n, cfg, first_combo=first, allow_held_out=ood)
        if objs is None:
            continue
        img = render(objs, cfg)
        qa = builder(rng, objs, cfg, ood)
        if qa is None:
            continue
        question, answer, extra = qa
        sid = f"clevr-{split}-{index:06d}"
        meta = {
            "split": split,
            "ood": ood,
            "image_size": list(cfg.size_wh),
            "objects": [
                {k: o[k] for k in ("color", "shape", "size", "center", "box")} for o in objs
            ],
            **extra,
        }
        sample = {
            "id": sid,
            "images": [],
            "question": question,
            "answer": answer,
            "reward": reward,
            "family": family,
            "meta": meta,
        }
        return sample, img
    raise RuntimeError(
        f"could not build a {family!r} scene for {split}[{index}] in {cfg.max_tries} "
        f"tries: image {cfg.size_wh} too small for {cfg.max_objects} objects? "
        "Lower max_objects or the radii, or raise image_size."
    )


def iter_samples(
    split: str,
    n: int,
    families: Sequence[str] = FAMILIES,
    seed: int = 0,
    cfg: ClevrConfig | None = None,
) -> Iterator[tuple[dict, np.ndarray]]:
    """Samples 0..n-1 of a split; family of sample i is families[i % len(families)]."""
    for i in range(n):
        yield make_sample(split, i, families[i % len(families)], seed, cfg)


def generate(
    out_dir: str | Path,
    splits: dict[str, int] | None = None,
    families: Sequence[str] = FAMILIES,
    seed: int = 0,
    image_size: int = 112,
    **config,
) -> dict[str, Path]:
    """Write ``<out_dir>/<split>.jsonl`` and ``<out_dir>/images/<split>/<id>.png``.

    Args:
        out_dir: output folder (created).
        splits: split name -> number of samples; default {"train": 1000, "val": 200,
            "test": 200, "ood": 200}. The split "ood" holds the held-out pairs and counts.
        families: question families, assigned round robin (see FAMILIES).
        seed: base seed; same arguments give byte-identical files.
        image_size: image side in pixels (or (width, height)).
        **config: any other ClevrConfig field, e.g. max_objects=8, held_out_counts=().
    Returns:
        split name -> path of its JSONL file (image paths in it are relative to out_dir).
    """
    splits = {"train": 1000, "val": 200, "test": 200, "ood": 200} if splits is None else splits
    cfg = generator_config(ClevrConfig, families, _BUILDERS, image_size=image_size, **config)
    out = Path(out_dir)
    return {
        split: write_split(out, split, iter_samples(split, n, families, seed, cfg))
        for split, n in splits.items()
    }


# --------------------------------------------------------------------------- SFT traces


def _name(o: dict) -> str:
    return f"{o['size']} {o['color']} {o['shape']}"


def _trace_sum(sample: dict, objs: list[dict]) -> tuple[str, str]:
    """Each group's objects (a colour of ``count_sum``, a size of ``count_size``) listed as the
    count traces list them, its sub-count (the step a process reward checks), then the sum."""
    steps = sample["meta"]["steps"]
    (attr,) = sample["meta"]["filter"]
    parts = []
    for c, n in steps.items():
        hits = sorted((o for o in objs if o[attr] == c), key=lambda o: tuple(o["center"]))
        listed = ", ".join(_name(o) for o in hits) or "none"
        parts.append(f"{c.capitalize()} objects from left to right: {listed}. {c}: {n}.")
    total = " + ".join(str(n) for n in steps.values())
    return f"{' '.join(parts)} Total: {total} = {sample['answer']}.", sample["answer"]


def _trace_count(sample: dict, objs: list[dict]) -> tuple[str, str]:
    flt = sample["meta"].get("filter", {})
    hits = sorted(
        (o for o in objs if all(o[k] == v for k, v in flt.items())),
        key=lambda o: (o["center"][0], o["center"][1]),
    )
    if not flt:
        what = "Objects"
    elif "color" in flt:
        what = f"{flt['color'].capitalize()} objects"
    else:
        what = f"{flt['shape'].capitalize()}s"
    listed = ", ".join(_name(o) for o in hits) or "none"
    return f"{what} from left to right: {listed}. Count: {len(hits)}.", str(len(hits))


_PHRASE = {"left": "left of", "right": "right of", "above": "above", "below": "below"}


def _trace_mcq(sample: dict, objs: list[dict]) -> tuple[str, str]:
    m = sample["meta"]
    letter = sample["answer"]
    t = objs[m["target"]]
    if sample["family"] == "attr_mcq":
        value = t[m["attribute"]]
        think = f"The {m['description']} is a {_name(t)}. {value.capitalize()} is option {letter}."
    else:
        r = objs[m["reference"]]
        think = (
            f"The {m['description']} is at x={t['center'][0]}, y={t['center'][1]}. "
            f"The {m['reference_description']} is at x={r['center'][0]}, y={r['center'][1]}. "
            f"So the {m['description']} is {_PHRASE[m['relation']]} the "
            f"{m['reference_description']}: option {letter}."
        )
    return think, letter


def _trace_box(sample: dict, objs: list[dict]) -> tuple[str, str]:
    m = sample["meta"]
    t = objs[m["target"]]
    box = [float(v) for v in t["box"]]
    cx, cy = (float(v) for v in t["center"])
    if m.get("model_image_size"):  # answer in the coordinates the model sees
        (w, h), (mw, mh) = m["image_size"], m["model_image_size"]
        sx, sy = mw / w, mh / h
        box = [box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy]
        cx, cy = cx * sx, cy * sy
    ans = format_box(box)
    return (
        f"The {m['description']} is centred at ({round(cx)}, {round(cy)}). Its box is {ans}.",
        ans,
    )


def reasoning_trace(sample: dict, tools: Sequence[str] = ()) -> str:
    """Templated chain of thought and answer for a generated sample (SFT warm start).

    Counting lists the matching objects left to right then counts; multiple choice names the
    attribute or both positions then the option; grounding gives the centre then the box (scaled to
    ``meta["model_image_size"]`` when present). Returns ``<think>…</think><answer>…</answer>``:
    one turn whatever the ``tools`` (no family here needs one).
    """
    objs = sample["meta"]["objects"]
    fam = sample["family"]
    if fam in ("count_sum", "count_size"):
        think, ans = _trace_sum(sample, objs)
    elif fam.startswith("count_"):
        think, ans = _trace_count(sample, objs)
    elif fam in ("attr_mcq", "spatial"):
        think, ans = _trace_mcq(sample, objs)
    elif fam == "grounding":
        think, ans = _trace_box(sample, objs)
    else:
        raise ValueError(f"no reasoning trace for family {fam!r}; valid: {list(_BUILDERS)}")
    return f"<think>{think}</think><answer>{ans}</answer>"
