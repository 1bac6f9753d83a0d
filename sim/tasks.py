"""Task families as registry entries: layout sampling, instructions, success and shaping.

A task is a ``Task`` record of pure functions, an entry of ``perceptrl.registry.TASKS`` under its
name (``TASKS.register(task.name, task)``), built by a family's factory or from one with
``functools.partial`` (e.g. more distractors). Convention for entity indices: the
entity the instruction is about is index 0 of its kind (``block0``, ``bowl0``, ``zone0``,
``target0``); for ``stack`` the base block is ``block1``; the rest are distractors.

Randomness: ``layout(colour_rng, pos_rng, task)`` draws colours and the instruction from
``colour_rng`` and positions from ``pos_rng``; the env passes its ``np_random`` for both, or, for
indexed initial states, generators seeded from ``(task_id)`` and ``(task_id, trial_id)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..registry import TASKS
from .scene import BLOCK_HALF, BOWL_RADIUS, COLOURS, ZONE_RADIUS
from .wording import PARAPHRASES, reword

WORKSPACE_X = (0.36, 0.64)
"""x range (metres) where entities are placed on the table"""
WORKSPACE_Y = (-0.22, 0.22)
"""y range (metres) where entities are placed on the table"""
LIFT_HEIGHT = 0.08
"""a picked block counts as lifted when its centre is this far above its resting height"""


@dataclass
class World:
    """Snapshot of the task-relevant state after a step (all positions world frame, metres).

    Every field may carry leading batch dimensions (``[N, ...]``: N worlds of a batched
    simulator); the success and shaping functions index entities from the end (``[..., i, :]``)
    and reduce over the last axis, so they score one world or N at once.
    """

    tcp: np.ndarray
    """(3,) tool centre point"""
    gripper: float
    """finger pad distance, metres"""
    blocks: np.ndarray
    """(n_blocks, 3) block centres"""
    bowls: np.ndarray
    """(n_bowls, 3) bowl base centres"""
    zones: np.ndarray
    """(n_zones, 3) zone centres"""
    targets: np.ndarray
    """(n_targets, 3) reach target centres"""
    block_vel: np.ndarray
    """(n_blocks,) linear speed of each block, m/s"""
    grasped: np.ndarray
    """(n_blocks,) bool: both fingers touch the block"""
    touched: np.ndarray
    """(n_blocks,) bool: at least one finger touches the block"""


@dataclass
class Layout:
    """One initial state: where everything is, its colours and the instruction."""

    blocks: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))
    """(n_blocks, 3) block centres"""
    block_yaw: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """(n_blocks,) yaw of each block about z, radians"""
    bowls: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))
    zones: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))
    targets: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))
    colours: dict[str, list[str]] = field(default_factory=dict)
    """kind ("blocks", "bowls", "zones", "targets") -> colour name per entity"""
    instruction: str = ""


@dataclass(frozen=True)
class Task:
    """A registered task: scene needs plus pure layout/success/shaping functions."""

    name: str
    n_blocks: int
    n_bowls: int
    n_zones: int
    n_targets: int
    templates: tuple[str, ...]
    """instruction paraphrases; fields {obj} and {goal} are colour names"""
    success: Callable[[World], bool]
    """world -> success (a bool array of the worlds' batch shape; see `World`)"""
    shaping: Callable[[World], dict[str, float]]
    """term name -> value in [0, 1] (logged as ``reward/<term>``), arrays of the batch shape"""
    place: Callable[[np.random.Generator, Task], Layout]
    """positions only (colours and instruction are added by ``layout``)"""
    max_episode_steps: int = 100
    family: str = ""
    """family of the task ("reach", "push", ...): selects the scripted expert"""
    subject: str = "blocks"
    """kind of the entity named by {obj} (always its index 0)"""
    goal: tuple[str, int] | None = None
    """(kind, index) of the entity named by {goal}, or None"""
    subgoals: tuple = ()
    """a long-horizon task's `sim.composite.Subgoal`s, in order (empty for a primitive)"""
    instruct: Callable[[Task, dict, np.random.Generator], str] | None = None
    """``instruct(task, colours, colour_rng) -> instruction``, instead of ``templates``"""


def get_task(name: str) -> Task:
    """The registered task ``name`` (``TASKS``); `UnknownName` with the valid names if none."""
    return TASKS.get(name)


# ------------------------------------------------------------------ layout sampling
def _sample_xy(
    rng: np.random.Generator,
    placed: list[tuple[np.ndarray, float]],
    radius: float,
    near: np.ndarray | None = None,
    dist: tuple[float, float] = (0.0, 0.0),
):
    """A point in the workspace at least ``radius`` + other radius + 1 cm from every placed
    entity; with ``near``, at a distance in ``dist`` from it. Rejection sampling, 500 tries."""
    for _ in range(500):
        if near is None:
            xy = np.array([rng.uniform(*WORKSPACE_X), rng.uniform(*WORKSPACE_Y)])
        else:
            ang, r = rng.uniform(-np.pi, np.pi), rng.uniform(*dist)
            xy = near + r * np.array([np.cos(ang), np.sin(ang)])
            if not (
                WORKSPACE_X[0] <= xy[0] <= WORKSPACE_X[1]
                and WORKSPACE_Y[0] <= xy[1] <= WORKSPACE_Y[1]
            ):
                continue
        if all(np.linalg.norm(xy - p) >= radius + r_p + 0.01 for p, r_p in placed):
            placed.append((xy, radius))
            return xy
    raise RuntimeError(
        f"could not place an entity of radius {radius} among {len(placed)} others in the "
        "workspace; lower the number of distractors"
    )


def _on_table(xy: np.ndarray, z: float = 0.0) -> np.ndarray:
    return np.array([xy[0], xy[1], z])


BLOCK_R = BLOCK_HALF * 1.5  # footprint radius of a block for spacing (with yaw)


def _blocks(rng, placed, n) -> tuple[np.ndarray, np.ndarray]:
    pos = np.array([_on_table(_sample_xy(rng, placed, BLOCK_R), BLOCK_HALF) for _ in range(n)])
    return pos.reshape(n, 3), rng.uniform(-np.pi / 4, np.pi / 4, size=n)


def task_counts(task: Task) -> dict[str, int]:
    """Entities of each kind in ``task``'s scene, in the scene's kind order."""
    return {
        "blocks": task.n_blocks, "bowls": task.n_bowls,
        "zones": task.n_zones, "targets": task.n_targets,
    }  # fmt: skip


def layout(
    task: Task,
    colour_rng: np.random.Generator,
    pos_rng: np.random.Generator,
    wording: str = "train",
) -> Layout:
    """Sample a full initial state for ``task``: positions, distinct colours, an instruction
    (from the training templates, or in a held-out ``wording``: `sim.wording.reword`, drawn
    after the training instruction so the scene is the same)."""
    lay = task.place(pos_rng, task)
    counts = task_counts(task)
    names = list(COLOURS)
    perm = colour_rng.permutation(len(names))
    k = 0
    for kind, n in counts.items():
        lay.colours[kind] = [names[i] for i in perm[k : k + n]]
        k += n
    if task.instruct is not None:
        lay.instruction = task.instruct(task, lay.colours, colour_rng)
    else:
        template = task.templates[colour_rng.integers(len(task.templates))]
        goal = lay.colours[task.goal[0]][task.goal[1]] if task.goal else ""
        lay.instruction = template.format(obj=lay.colours[task.subject][0], goal=goal)
    if wording != "train":
        if not has_held_out(task):
            raise ValueError(
                f"env wording={wording!r}: task {task.name!r} has no held-out wording (the "
                f"families {', '.join(PARAPHRASES)} have); use wording=train"
            )
        obj = lay.colours[task.subject][0]
        others = [c for c in lay.colours[task.subject][1:] if c != goal]
        lay.instruction = reword(
            task.family, task.templates, obj, goal, others, colour_rng, wording
        )
    return lay


def has_held_out(task: Task) -> bool:
    """Whether ``task`` has held-out wordings (`sim.wording`): the primitive families do; a
    long-horizon task's composed instruction does not."""
    return task.instruct is None and task.family in PARAPHRASES


# ------------------------------------------------------------------ shaping helpers
def _closeness(d, scale: float = 10.0):
    return 1.0 - np.tanh(scale * d)


def _dist(a, b):
    """Euclidean distance over the last axis (any leading batch dimensions)."""
    return np.linalg.norm(a - b, axis=-1)


def _reach_term(w: World, i: int = 0):
    return _closeness(_dist(w.tcp, w.blocks[..., i, :]))


# ------------------------------------------------------------------ reach
def _place_reach(rng, task: Task) -> Layout:
    targets = []
    for _ in range(task.n_targets):
        for _ in range(500):
            p = np.array([rng.uniform(0.36, 0.64), rng.uniform(-0.2, 0.2), rng.uniform(0.06, 0.26)])
            if all(np.linalg.norm(p - q) > 0.1 for q in targets):
                targets.append(p)
                break
    return Layout(targets=np.array(targets))


def _reach_success(w: World):
    return _dist(w.tcp, w.targets[..., 0, :]) < 0.03


def _reach_shaping(w: World) -> dict:
    return {"reach": _closeness(_dist(w.tcp, w.targets[..., 0, :]))}


def reach_task(name: str = "reach", n_distractors: int = 2, max_episode_steps: int = 60) -> Task:
    """Move the gripper to the target sphere of the named colour."""
    return Task(
        name,
        0,
        0,
        0,
        1 + n_distractors,
        (
            "reach the {obj} target",
            "move the gripper to the {obj} ball",
            "touch the {obj} sphere",
            "go to the {obj} target",
        ),
        _reach_success,
        _reach_shaping,
        _place_reach,
        max_episode_steps,
        "reach",
        subject="targets",
    )


# ------------------------------------------------------------------ push
def _place_push(rng, task: Task) -> Layout:
    placed: list = []
    block = _sample_xy(rng, placed, BLOCK_R)
    zone = _sample_xy(rng, placed, ZONE_RADIUS, near=block, dist=(0.12, 0.18))
    zones = [zone] + [_sample_xy(rng, placed, ZONE_RADIUS) for _ in range(task.n_zones - 1)]
    others, yaw = _blocks(rng, placed, task.n_blocks - 1)
    blocks = np.concatenate([_on_table(block, BLOCK_HALF)[None], others])
    yaw = np.concatenate([rng.uniform(-np.pi / 4, np.pi / 4, size=1), yaw])
    return Layout(blocks, yaw, zones=np.array([_on_table(z) for z in zones]))


def _push_dist(w: World):
    return _dist(w.blocks[..., 0, :2], w.zones[..., 0, :2])


def _push_success(w: World):
    return (_push_dist(w) < ZONE_RADIUS - 0.01) & (w.blocks[..., 0, 2] < BLOCK_HALF + 0.01)


def _push_shaping(w: World) -> dict:
    return {"reach": _reach_term(w), "push": _closeness(_push_dist(w))}


def push_task(name: str = "push", n_distractors: int = 1, max_episode_steps: int = 120) -> Task:
    """Push the named block into the zone of the named colour."""
    return Task(
        name,
        1 + n_distractors,
        0,
        1 + n_distractors,
        0,
        (
            "push the {obj} block into the {goal} zone",
            "slide the {obj} cube onto the {goal} circle",
            "push the {obj} block to the {goal} area",
            "move the {obj} cube into the {goal} zone",
        ),
        _push_success,
        _push_shaping,
        _place_push,
        max_episode_steps,
        "push",
        goal=("zones", 0),
    )


# ------------------------------------------------------------------ pick
def _place_blocks(rng, task: Task) -> Layout:
    placed: list = []
    bowls = [_on_table(_sample_xy(rng, placed, BOWL_RADIUS)) for _ in range(task.n_bowls)]
    blocks, yaw = _blocks(rng, placed, task.n_blocks)
    return Layout(blocks, yaw, bowls=np.array(bowls).reshape(-1, 3))


def _pick_success(w: World):
    return (w.blocks[..., 0, 2] > BLOCK_HALF + LIFT_HEIGHT) & w.grasped[..., 0]


def _grasp_lift(w: World) -> dict:
    lift = np.clip((w.blocks[..., 0, 2] - BLOCK_HALF) / LIFT_HEIGHT, 0.0, 1.0)
    grasp = w.grasped[..., 0].astype(np.float64)
    return {"reach": _reach_term(w), "grasp": grasp, "lift": lift * grasp}


def pick_task(name: str = "pick", n_distractors: int = 2, max_episode_steps: int = 80) -> Task:
    """Pick up the named block and lift it."""
    return Task(
        name,
        1 + n_distractors,
        0,
        0,
        0,
        (
            "pick up the {obj} block",
            "lift the {obj} cube",
            "grab the {obj} block and lift it",
            "raise the {obj} cube off the table",
        ),
        _pick_success,
        _grasp_lift,
        _place_blocks,
        max_episode_steps,
        "pick",
    )


# ------------------------------------------------------------------ put (block in bowl)
def _in_bowl(w: World):
    return _dist(w.blocks[..., 0, :2], w.bowls[..., 0, :2])


def _put_success(w: World):
    return (_in_bowl(w) < BOWL_RADIUS - 0.02) & (w.blocks[..., 0, 2] < 0.05) & ~w.touched[..., 0]


def _put_shaping(w: World) -> dict:
    goal = w.bowls[..., 0, :] + np.array([0.0, 0.0, BLOCK_HALF + 0.005])
    terms = _grasp_lift(w)
    terms["place"] = _closeness(_dist(w.blocks[..., 0, :], goal))
    return terms


def put_task(name: str = "put", n_distractors: int = 1, max_episode_steps: int = 120) -> Task:
    """Put the named block in the bowl of the named colour."""
    return Task(
        name,
        1 + n_distractors,
        1 + n_distractors,
        0,
        0,
        (
            "put the {obj} block in the {goal} bowl",
            "place the {obj} cube into the {goal} bowl",
            "drop the {obj} block in the {goal} bowl",
            "move the {obj} cube into the {goal} bowl",
        ),
        _put_success,
        _put_shaping,
        _place_blocks,
        max_episode_steps,
        "put",
        goal=("bowls", 0),
    )


# ------------------------------------------------------------------ stack
def _stack_offset(w: World) -> np.ndarray:
    return w.blocks[..., 0, :] - (w.blocks[..., 1, :] + np.array([0.0, 0.0, 2 * BLOCK_HALF]))


def _stack_success(w: World):
    off = _stack_offset(w)
    return (
        (np.linalg.norm(off[..., :2], axis=-1) < 0.02)
        & (np.abs(off[..., 2]) < 0.006)
        & ~w.touched[..., 0]
        & (w.block_vel[..., 0] < 0.05)
    )


def _stack_shaping(w: World) -> dict:
    terms = _grasp_lift(w)
    terms["align"] = _closeness(np.linalg.norm(_stack_offset(w), axis=-1))
    return terms


def stack_task(name: str = "stack", n_distractors: int = 1, max_episode_steps: int = 120) -> Task:
    """Stack the named block on the block of the other named colour."""
    return Task(
        name,
        2 + n_distractors,
        0,
        0,
        0,
        (
            "stack the {obj} block on the {goal} block",
            "put the {obj} cube on top of the {goal} cube",
            "place the {obj} block onto the {goal} block",
            "stack the {obj} cube on the {goal} one",
        ),
        _stack_success,
        _stack_shaping,
        _place_blocks,
        max_episode_steps,
        "stack",
        goal=("blocks", 1),
    )


FAMILIES: dict[str, Callable[..., Task]] = {
    "reach": reach_task,
    "push": push_task,
    "pick": pick_task,
    "put": put_task,
    "stack": stack_task,
}
"""family name -> Task factory (keyword arguments: name, n_distractors, max_episode_steps)"""

VARIANTS: dict[str, Callable[..., Task]] = {
    "pick_clutter": functools.partial(pick_task, n_distractors=4, max_episode_steps=100),
}
"""extra registered tasks: a family factory with other arguments (no subclasses)"""

for _name, _factory in {**FAMILIES, **VARIANTS}.items():
    TASKS.register(_name, _factory(name=_name))
