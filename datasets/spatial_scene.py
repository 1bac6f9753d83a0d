"""MuJoCo rooms for the 3D spatial questions (datasets/spatial.py): scene sampling, the MJCF,
the camera path and rendering with exact geometry.

A scene is a walled room with a mid-grey floor and objects (box, sphere, cylinder) in distinct
named colours and random metric sizes, standing on the floor without overlap. A camera walks a
small circle in the middle of the room, looking outward and down; its ``n_views`` views (view 1
looking along +x) cover the whole room together. Metres, in the frame where the path's centre is
the origin and +z is up. Closest-point distances come from ``mujoco.mj_geomDistance``, visibility
from segmentation renders. Visual settings suit software rendering (EGL/Mesa): no shadows, no
multisampling, no specular light.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .clevr import COLORS

os.environ.setdefault("MUJOCO_GL", "egl")
import mujoco  # noqa: E402  (after MUJOCO_GL is set)

from ..sim.render import make_renderer  # noqa: E402  (the EGL/triton import-order guard)

SHAPES: tuple[str, ...] = ("box", "sphere", "cylinder")
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
        self.renderer = make_renderer(self.model, cfg.image_size, cfg.image_size)

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


def _rig(cfg: SpatialConfig) -> _Rig:
    """The process's rig for cfg, created lazily (EGL contexts must not cross a fork)."""
    if cfg not in _RIGS:
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
