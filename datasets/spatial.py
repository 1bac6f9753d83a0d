"""Synthetic 3D spatial questions in the VSI-Bench style, rendered by MuJoCo with exact geometry.

A scene is a walled room with a mid-grey floor and 2..N objects (box, sphere, cylinder) in
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

================  ============================================================  ======  ======
family            example question                                              answer  reward
================  ============================================================  ======  ======
obj_count         How many spheres are in the room?                             ``2``   mra
abs_distance      ... direct distance between the red box and the blue sphere   ``1.23`` mra
                  (in metres, between closest points)?
obj_size          Longest dimension of the red box, in centimetres?             ``55``  mra
rel_direction     Standing by the red box facing the blue sphere, is the green  ``C``   mcq
                  cylinder to my front-left, front-right, back-left, back-right?
rel_distance      Which of these objects is closest to the red box? + options   ``B``   mcq
appearance_order  First-time appearance order of A, B, C along the path?        ``A``   mcq
================  ============================================================  ======  ======

Splits and seeds: sample ``i`` of split ``s`` draws from ``SeedSequence((seed, crc32(s), i))``, so
splits never share a random stream; the same arguments give byte-identical files.

Use :func:`generate` to write ``<out>/<split>.jsonl`` and ``<out>/images/<split>/<id>_v<k>.png``
(plus 16-bit depth PNGs in millimetres under ``<out>/depth/`` with ``depth=True``, listed in
``meta["depth"]`` relative to ``<out>``); :func:`reasoning_trace` gives a templated
``<think>…</think><answer>…</answer>`` target for the SFT warm start.

Render in a process that imported torch first when both are used (measured EGL/triton crash).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import cv2
import numpy as np

from .clevr import COLORS

os.environ.setdefault("MUJOCO_GL", "egl")
import mujoco  # noqa: E402  (after MUJOCO_GL is set)

SHAPES: tuple[str, ...] = ("box", "sphere", "cylinder")
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
_WALL_RGBA = ("0.62 0.60 0.57 1", "0.56 0.58 0.62 1", "0.60 0.62 0.56 1", "0.58 0.56 0.60 1")


@dataclass(frozen=True)
class SpatialConfig:
    image_size: int = 112
    """side of each square view in pixels"""
    n_views: int = 4
    """views along the camera path (they cover 360 degrees together)"""
    min_objects: int = 3
    """fewest objects in a scene"""
    max_objects: int = 5
    """most objects in a scene (at most the number of colours: colours are unique per scene)"""
    colors: tuple[str, ...] = tuple(COLORS)
    """colour names (keys of datasets.clevr.COLORS)"""
    shapes: tuple[str, ...] = SHAPES
    """shape names (subset of SHAPES)"""
    room_half: tuple[float, float] = (2.6, 3.2)
    """range of the square room's half-side in metres"""
    path_radius: float = 0.4
    """radius of the camera's circular path in metres"""
    camera_height: float = 1.1
    """camera height in metres"""
    camera_pitch: float = 30.0
    """downward tilt of the camera in degrees"""
    overlap: float = 10.0
    """extra field of view in degrees beyond 360 / n_views, so neighbouring views overlap"""
    inner_radius: float = 1.3
    """objects stand at least this far (metres) from the room's centre"""
    gap: float = 0.15
    """least free space in metres between two objects' footprints, and to the walls"""
    min_size: float = 0.15
    """smallest object extent (diameter, side, height) in metres"""
    max_size: float = 0.8
    """largest object extent in metres"""
    min_visible_px: int = 8
    """pixels of an object that make it visible in a view; every object must be visible once"""
    direction_margin: float = 15.0
    """rel_direction: least angle in degrees between the asked object and the quadrant borders"""
    distance_margin: float = 0.15
    """rel_distance: least gap in metres between the closest and the second-closest option"""
    depth: bool = False
    """also write each view's depth (16-bit PNG, millimetres)"""
    max_tries: int = 100
    """scene attempts per sample and placement attempts per object before giving up"""

    def __post_init__(self) -> None:  # normalise lists from YAML/JSON to tuples
        for name in ("colors", "shapes", "room_half"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        bad = [c for c in self.colors if c not in COLORS] + [
            s for s in self.shapes if s not in SHAPES
        ]
        if bad:
            raise ValueError(f"unknown colours/shapes {bad}; valid: {list(COLORS)} and {SHAPES}")
        if not 2 <= self.min_objects <= self.max_objects <= len(self.colors):
            raise ValueError(
                f"need 2 <= min_objects <= max_objects <= {len(self.colors)} (colours are unique "
                f"per scene), got {self.min_objects}..{self.max_objects}"
            )
        if self.n_views < 2:
            raise ValueError(f"n_views must be >= 2 (a path of views), got {self.n_views}")

    @property
    def fovy(self) -> float:
        return 360.0 / self.n_views + self.overlap


# --------------------------------------------------------------------------- scenes


def _extent(shape: str, size: Sequence[float]) -> list[float]:
    """Full extents [dx, dy, dz] in metres of a shape with MuJoCo size parameters."""
    if shape == "box":
        return [2 * size[0], 2 * size[1], 2 * size[2]]
    if shape == "sphere":
        return [2 * size[0]] * 3
    return [2 * size[0], 2 * size[0], 2 * size[1]]  # cylinder: radius, half-height


def _footprint(shape: str, size: Sequence[float]) -> float:
    """Radius of a circle around the object's footprint on the floor."""
    return math.hypot(size[0], size[1]) if shape == "box" else size[0]


def sample_scene(rng: np.random.Generator, n: int, cfg: SpatialConfig) -> dict | None:
    """A room and n non-overlapping objects; None when placement fails (caller resamples).

    Returns {"room_half": float, "objects": [{"color", "shape", "size" (MuJoCo size params),
    "pos" [x, y, z], "yaw" (degrees), "extent" [dx, dy, dz]}]}.
    """
    half = float(rng.uniform(*cfg.room_half))
    colors = rng.choice(cfg.colors, size=n, replace=False).tolist()
    lo, hi = cfg.min_size / 2, cfg.max_size / 2
    objs: list[dict] = []
    for color in colors:
        shape = str(rng.choice(cfg.shapes))
        if shape == "box":
            size = rng.uniform(lo, hi, size=3).tolist()
        elif shape == "sphere":
            size = [float(rng.uniform(lo, hi * 0.8))]
        else:
            size = [float(rng.uniform(lo, hi * 0.7)), float(rng.uniform(lo, hi))]
        size = [round(s, 3) for s in size]
        foot = _footprint(shape, size)
        r_max = half - foot - cfg.gap
        r_min = cfg.inner_radius + foot
        if r_max <= r_min:
            return None
        for _ in range(cfg.max_tries):
            x, y = rng.uniform(-r_max, r_max, size=2)
            r = math.hypot(x, y)
            if r < r_min or max(abs(x), abs(y)) > r_max:
                continue
            if all(
                math.hypot(x - o["pos"][0], y - o["pos"][1])
                >= foot + _footprint(o["shape"], o["size"]) + cfg.gap
                for o in objs
            ):
                break
        else:
            return None
        ext = _extent(shape, size)
        objs.append(
            {
                "color": color,
                "shape": shape,
                "size": size,
                "pos": [round(float(x), 3), round(float(y), 3), round(ext[2] / 2, 3)],
                "yaw": round(float(rng.uniform(0, 180)), 1) if shape == "box" else 0.0,
                "extent": [round(e, 3) for e in ext],
            }
        )
    return {"room_half": round(half, 3), "objects": objs}


def cameras(cfg: SpatialConfig) -> list[dict]:
    """The views along the path: [{"pos" [x, y, z], "heading" (deg), "forward", "xyaxes"}]."""
    out = []
    pitch = math.radians(cfg.camera_pitch)
    for k in range(cfg.n_views):
        h = 2 * math.pi * k / cfg.n_views
        c, s = math.cos(h), math.sin(h)
        fwd = np.array([math.cos(pitch) * c, math.cos(pitch) * s, -math.sin(pitch)])
        right = np.array([s, -c, 0.0])
        up = np.cross(-fwd, right)
        pos = [cfg.path_radius * c, cfg.path_radius * s, cfg.camera_height]
        out.append(
            {
                "pos": [round(v, 4) for v in pos],
                "heading": round(math.degrees(h), 2),
                "forward": [round(float(v), 4) for v in fwd],
                "xyaxes": [float(v) for v in (*right, *up)],
            }
        )
    return out


def _wall_boxes(half: float) -> list[tuple[float, float, float, float]]:
    """(x, y, half-size x, half-size y) of the four walls (+x, +y, -x, -y)."""
    return [
        (half, 0, 0.05, half),
        (0, half, half, 0.05),
        (-half, 0, 0.05, half),
        (0, -half, half, 0.05),
    ]


def scene_xml(scene: dict, cfg: SpatialConfig) -> str:
    """MJCF of the room: floor, four walls, the objects (geoms ``obj0``..) and cameras ``view0``..

    Visual settings suit software rendering: no shadows, no multisampling, no specular light.
    """
    half, size = scene["room_half"], cfg.image_size
    wall_h = 1.25
    walls = []
    for i, (x, y, sx, sy) in enumerate(_wall_boxes(half)):
        walls.append(
            f'<geom name="wall{i}" type="box" size="{sx} {sy} {wall_h}" pos="{x} {y} {wall_h}" '
            f'rgba="{_WALL_RGBA[i]}"/>'
        )
    geoms = []
    for i, o in enumerate(scene["objects"]):
        rgb = " ".join(f"{c / 255:.3f}" for c in COLORS[o["color"]])
        geoms.append(
            f'<geom name="obj{i}" type="{o["shape"]}" size="{" ".join(map(str, o["size"]))}" '
            f'pos="{" ".join(map(str, o["pos"]))}" euler="0 0 {o["yaw"]}" rgba="{rgb} 1"/>'
        )
    cams = [
        f'<camera name="view{k}" pos="{" ".join(map(str, c["pos"]))}" '
        f'xyaxes="{" ".join(f"{v:.6f}" for v in c["xyaxes"])}" fovy="{cfg.fovy}"/>'
        for k, c in enumerate(cameras(cfg))
    ]
    return f"""<mujoco model="spatial_room">
  <visual>
    <quality shadowsize="0" offsamples="0"/>
    <global offwidth="{size}" offheight="{size}"/>
    <headlight ambient="0.45 0.45 0.45" diffuse="0.45 0.45 0.45" specular="0 0 0"/>
    <map znear="0.01"/>
  </visual>
  <asset>
    <texture name="sky" type="skybox" builtin="flat" rgb1="0.5 0.5 0.5" rgb2="0.5 0.5 0.5"
      width="16" height="16"/>
    <material name="matte" specular="0" shininess="0"/>
  </asset>
  <default><geom material="matte"/></default>
  <worldbody>
    <light directional="true" dir="0.3 0.2 -1" diffuse="0.35 0.35 0.35" specular="0 0 0"
      castshadow="false"/>
    <geom name="floor" type="plane" size="{half} {half} 0.1" rgba="0.45 0.45 0.45 1"/>
    {"".join(walls)}
    {"".join(geoms)}
    {"".join(cams)}
  </worldbody>
</mujoco>"""


_HIDDEN = 3
"""geom group of unused object slots (not rendered)"""


class _Rig:
    """A compiled room with ``max_objects`` slots per shape and one renderer, reused across
    scenes: creating a renderer costs ~0.13 s, a view ~5 ms. A scene moves, sizes and colours the
    slots it uses and hides the others (geom group 3); :func:`scene_xml` is the same room as
    standalone MJCF."""

    def __init__(self, cfg: SpatialConfig):
        slots = [
            {"color": cfg.colors[0], "shape": sh, "size": [0.1, 0.1, 0.1][: len(_SIZE_IDX[sh])],
             "pos": [0.0, 0.0, -5.0], "yaw": 0.0}
            for _ in range(cfg.max_objects) for sh in SHAPES
        ]  # fmt: skip
        self.model = mujoco.MjModel.from_xml_string(
            scene_xml({"room_half": max(cfg.room_half), "objects": slots}, cfg)
        )
        self.data = mujoco.MjData(self.model)
        gid = lambda n: mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_GEOM, n)  # noqa: E731
        self.slot = {
            (i, sh): gid(f"obj{i * len(SHAPES) + k}")
            for i in range(cfg.max_objects)
            for k, sh in enumerate(SHAPES)
        }
        for g in self.slot.values():  # pose each slot from its own pos/quat, never the body's
            self.model.geom_sameframe[g] = 0
        self.walls = [gid(f"wall{i}") for i in range(4)]
        self.floor = gid("floor")
        self.option = mujoco.MjvOption()
        self.option.geomgroup[_HIDDEN] = 0
        self.renderer = mujoco.Renderer(self.model, cfg.image_size, cfg.image_size)

    def load(self, scene: dict) -> list[int]:
        """Pose the scene's objects in their slots; returns their geom ids."""
        m, half = self.model, scene["room_half"]
        for g in self.slot.values():
            m.geom_group[g] = _HIDDEN
        for g, (x, y, sx, sy) in zip(self.walls, _wall_boxes(half)):
            m.geom_pos[g, :2] = (x, y)
            m.geom_size[g, :2] = (sx, sy)
        m.geom_size[self.floor, :2] = half
        gids = []
        for i, o in enumerate(scene["objects"]):
            g = self.slot[(i, o["shape"])]
            m.geom_group[g] = 0
            m.geom_size[g] = 0.0
            m.geom_size[g, _SIZE_IDX[o["shape"]]] = o["size"]
            m.geom_rbound[g] = math.hypot(*o["extent"]) / 2
            m.geom_pos[g] = o["pos"]
            yaw = math.radians(o["yaw"])
            m.geom_quat[g] = (math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2))
            m.geom_rgba[g, :3] = np.array(COLORS[o["color"]]) / 255
            gids.append(g)
        mujoco.mj_forward(m, self.data)
        return gids


_SIZE_IDX = {"box": [0, 1, 2], "sphere": [0], "cylinder": [0, 1]}
_RIGS: dict[SpatialConfig, _Rig] = {}


def _import_triton_first() -> None:
    """Import triton (when installed) before the first EGL context: importing it afterwards, as
    torch's optimizer, torchvision and torch._dynamo do, segfaulted under Mesa (measured)."""
    if importlib.util.find_spec("triton") is not None:
        importlib.import_module("triton")


def _rig(cfg: SpatialConfig) -> _Rig:
    """The process's rig for cfg, created lazily (EGL contexts must not cross a fork)."""
    if cfg not in _RIGS:
        _import_triton_first()
        _RIGS.clear()  # one renderer at a time
        _RIGS[cfg] = _Rig(cfg)
    return _RIGS[cfg]


def render(scene: dict, cfg: SpatialConfig) -> dict:
    """Render every view; fills each object's "visible_px" (pixels per view) and "first_view".

    Returns {"rgb": [n_views × uint8 [H, W, 3]], "depth": [n_views × float32 [H, W] metres] or
    [], "distances": float [n, n] closest-point distances in metres (0 on the diagonal)}.
    """
    rig = _rig(cfg)
    gids = rig.load(scene)
    model, data, renderer = rig.model, rig.data, rig.renderer
    objs = scene["objects"]
    dist = np.zeros((len(objs), len(objs)))
    for i, j in itertools.combinations(range(len(objs)), 2):
        dist[i, j] = dist[j, i] = mujoco.mj_geomDistance(model, data, gids[i], gids[j], 100.0, None)
    rgb, depth, seen = [], [], np.zeros((len(objs), cfg.n_views), dtype=np.int64)
    for k in range(cfg.n_views):
        renderer.update_scene(data, camera=f"view{k}", scene_option=rig.option)
        rgb.append(renderer.render().copy())
        renderer.enable_segmentation_rendering()
        seg = renderer.render()[..., 0]  # [H, W] geom id (-1: background)
        renderer.disable_segmentation_rendering()
        seen[:, k] = [(seg == g).sum() for g in gids]
        if cfg.depth:
            renderer.enable_depth_rendering()
            depth.append(renderer.render().astype(np.float32))
            renderer.disable_depth_rendering()
    for i, o in enumerate(objs):
        o["visible_px"] = seen[i].tolist()
        vis = np.nonzero(seen[i] >= cfg.min_visible_px)[0]
        o["first_view"] = int(vis[0]) + 1 if len(vis) else None
    return {"rgb": rgb, "depth": depth, "distances": dist}


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
    known = {f.name for f in fields(SpatialConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise TypeError(f"unknown SpatialConfig fields {unknown}; valid: {sorted(known)}")
    cfg = replace(SpatialConfig(), image_size=image_size, **config)
    bad = [f for f in families if f not in _BUILDERS]
    if bad or not families:
        raise ValueError(f"unknown question families {bad or families}; valid: {list(_BUILDERS)}")
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


def reasoning_trace(sample: dict) -> str:
    """Templated chain of thought and answer for a generated sample (SFT warm start).

    Counting lists the matching objects with the view that first shows each; distances, sizes and
    directions state the exact positions (metres, path frame) or extents they follow from;
    choices end with the option's letter. Returns ``<think>…</think><answer>…</answer>``.
    """
    fam = sample["family"]
    if fam not in _TRACES:
        raise ValueError(f"no reasoning trace for family {fam!r}; valid: {list(_TRACES)}")
    think = _TRACES[fam](sample, sample["meta"]["objects"])
    return f"<think>{think}</think><answer>{sample['answer']}</answer>"
