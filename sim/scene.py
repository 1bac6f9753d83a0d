"""Tabletop scene: the arm7 robot, a table, coloured entities and two cameras, as one MJCF model.

The robot comes from ``assets/robots/arm7.xml``; everything else is added here from primitive geoms,
so a task asks only for how many blocks, bowls, zones and reach targets it needs (``SceneSpec``).
Visual settings suit software rendering (Mesa llvmpipe through EGL): no shadows, no reflections,
no multisampling, no textures.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

ROBOT_XML = Path(__file__).resolve().parent.parent / "assets" / "robots" / "arm7.xml"

TABLE_TOP = 0.0
"""z of the table surface (the robot base stands on it at the origin)"""
BLOCK_HALF = 0.02
"""half edge of a block (a 4 cm cube)"""
BOWL_RADIUS = 0.07
"""outer radius of a bowl; the inner free radius is about 0.062"""
BOWL_WALL = 0.036
"""height of a bowl's wall above the table"""
ZONE_RADIUS = 0.06
"""radius of a flat target zone"""
TARGET_RADIUS = 0.02
"""radius of a floating reach target (visual only)"""

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.85, 0.12, 0.12),
    "green": (0.15, 0.7, 0.2),
    "blue": (0.15, 0.3, 0.9),
    "yellow": (0.95, 0.85, 0.1),
    "purple": (0.6, 0.2, 0.75),
    "orange": (1.0, 0.5, 0.05),
    "cyan": (0.1, 0.8, 0.85),
    "pink": (1.0, 0.45, 0.7),
}
"""colour name -> RGB, the vocabulary of the instructions"""


@dataclass(frozen=True)
class SceneSpec:
    """How many entities of each kind the scene holds (a task's needs plus its distractors)."""

    n_blocks: int = 0
    """free-floating cubes"""
    n_bowls: int = 0
    """open bowls (kinematic, collide with blocks)"""
    n_zones: int = 0
    """flat coloured discs on the table (visual only)"""
    n_targets: int = 0
    """floating spheres for reaching (visual only)"""
    width: int = 128
    """camera image width in pixels"""
    height: int = 128
    """camera image height in pixels"""


def _lookat_xyaxes(pos: np.ndarray, target: np.ndarray) -> str:
    """Camera ``xyaxes`` attribute for a camera at ``pos`` looking at ``target`` (world z up)."""
    fwd = (target - pos) / np.linalg.norm(target - pos)
    right = np.cross(fwd, [0.0, 0.0, 1.0])
    right /= np.linalg.norm(right)
    up = np.cross(right, fwd)
    return " ".join(f"{v:.5f}" for v in (*right, *up))


def _sub(parent: ET.Element, tag: str, **attrs) -> ET.Element:
    return ET.SubElement(parent, tag, {k: str(v) for k, v in attrs.items()})


def _add_bowl(world: ET.Element, i: int) -> None:
    body = _sub(world, "body", name=f"bowl{i}", mocap="true", pos=f"0.5 {0.3 + 0.2 * i} 0")
    _sub(
        body,
        "geom",
        name=f"bowl{i}_base",
        type="cylinder",
        size=f"{BOWL_RADIUS} 0.003",
        pos="0 0 0.003",
        rgba="0.5 0.5 0.5 1",
        **{"class": "entity"},
    )
    n_walls = 14
    half_len = BOWL_RADIUS * math.sin(math.pi / n_walls) + 0.002
    for k in range(n_walls):
        a = 2 * math.pi * k / n_walls
        x, y = (BOWL_RADIUS - 0.004) * math.cos(a), (BOWL_RADIUS - 0.004) * math.sin(a)
        _sub(
            body,
            "geom",
            name=f"bowl{i}_wall{k}",
            type="box",
            size=f"0.004 {half_len:.5f} {BOWL_WALL / 2:.4f}",
            pos=f"{x:.5f} {y:.5f} {BOWL_WALL / 2:.4f}",
            euler=f"0 0 {a:.5f}",
            rgba="0.5 0.5 0.5 1",
            **{"class": "entity"},
        )


def _add_entities(world: ET.Element, spec: SceneSpec) -> None:
    for i in range(spec.n_blocks):
        body = _sub(world, "body", name=f"block{i}", pos=f"0.5 {-0.3 - 0.1 * i} {BLOCK_HALF}")
        _sub(body, "freejoint", name=f"block{i}")
        _sub(
            body,
            "geom",
            name=f"block{i}",
            type="box",
            size=f"{BLOCK_HALF} " * 3,
            mass="0.05",
            rgba="0.5 0.5 0.5 1",
            **{"class": "entity"},
        )
    for i in range(spec.n_bowls):
        _add_bowl(world, i)
    for i in range(spec.n_zones):
        body = _sub(world, "body", name=f"zone{i}", mocap="true", pos=f"0.3 {0.3 + 0.15 * i} 0")
        _sub(
            body,
            "geom",
            name=f"zone{i}",
            type="cylinder",
            size=f"{ZONE_RADIUS} 0.0008",
            pos="0 0 0.0008",
            contype="0",
            conaffinity="0",
            rgba="0.5 0.5 0.5 1",
        )
    for i in range(spec.n_targets):
        body = _sub(world, "body", name=f"target{i}", mocap="true", pos=f"0.4 {0.1 * i} 0.2")
        _sub(
            body,
            "geom",
            name=f"target{i}",
            type="sphere",
            size=f"{TARGET_RADIUS}",
            contype="0",
            conaffinity="0",
            rgba="0.5 0.5 0.5 1",
        )


_WORLD = [
    ("light", {"name": "sun", "pos": "0.4 0 1.5", "dir": "0 0 -1", "directional": "true",
               "castshadow": "false", "diffuse": "0.45 0.45 0.45", "specular": "0 0 0"}),
    ("geom", {"name": "floor", "type": "plane", "size": "2 2 0.05", "pos": "0 0 -0.75",
              "contype": "0", "conaffinity": "0", "rgba": "0.35 0.37 0.4 1"}),
    ("geom", {"name": "table", "type": "box", "size": "0.55 0.6 0.02", "pos": "0.35 0 -0.02",
              "rgba": "0.62 0.5 0.38 1", "friction": "1 0.005 0.0001", "solref": "0.005 1"}),
] + [
    ("geom", {"type": "box", "size": "0.03 0.03 0.365", "pos": f"{x} {y} -0.405", "contype": "0",
              "conaffinity": "0", "rgba": "0.45 0.35 0.25 1"})
    for x in (-0.15, 0.85) for y in (-0.55, 0.55)
]  # fmt: skip
"""static world elements: light, floor, table top and legs (legs and floor visual only)"""
AGENTVIEW_POS = np.array([0.98, 0.0, 0.5])
"""agent-view camera position (in front of the table, facing the robot)"""
AGENTVIEW_TARGET = np.array([0.4, 0.0, 0.06])
"""point the agent-view camera looks at"""


def _add_visual(root: ET.Element, spec: SceneSpec) -> None:
    size = max(spec.width, spec.height, 64)
    visual = _sub(root, "visual")
    _sub(visual, "quality", shadowsize="0", offsamples="0")  # no shadows, no multisampling
    _sub(visual, "global", offwidth=size, offheight=size)
    _sub(visual, "headlight", ambient="0.45 0.45 0.45", diffuse="0.5 0.5 0.5", specular="0 0 0")
    _sub(visual, "map", znear="0.01")


def _add_world(root: ET.Element, spec: SceneSpec) -> None:
    _add_visual(root, spec)
    entity = _sub(root.find("default"), "default", **{"class": "entity"})
    _sub(entity, "geom", friction="1 0.005 0.0001", condim="3", solref="0.005 1")
    world = root.find("worldbody")
    for tag, attrs in _WORLD:
        _sub(world, tag, **attrs)
    _sub(world, "camera", name="agentview", pos=" ".join(map(str, AGENTVIEW_POS)), fovy="52",
         xyaxes=_lookat_xyaxes(AGENTVIEW_POS, AGENTVIEW_TARGET))  # fmt: skip
    _add_entities(world, spec)


@lru_cache(maxsize=32)
def scene_xml(spec: SceneSpec) -> str:
    """MJCF text of the full scene for ``spec`` (cached: the same spec gives the same string)."""
    if not ROBOT_XML.is_file():
        raise FileNotFoundError(
            f"robot model {ROBOT_XML} is missing; reinstall perceptrl with its package data "
            "(assets/robots/*.xml)"
        )
    root = ET.parse(ROBOT_XML).getroot()
    root.set("model", "arm7_tabletop")
    _add_world(root, spec)
    keyframe = root.find("keyframe")
    if keyframe is not None:  # entity joints change nq; the scene sets its own initial state
        root.remove(keyframe)
    return ET.tostring(root, encoding="unicode")


def build_model(spec: SceneSpec):
    """Compile the scene for ``spec`` into a fresh ``mujoco.MjModel`` (one per env: colours are
    written into ``model.geom_rgba`` at reset)."""
    import mujoco

    return mujoco.MjModel.from_xml_string(scene_xml(spec))
