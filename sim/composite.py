"""Long-horizon tasks: registered compositions of primitive subgoals, with exact ground truth.

A composite task ("put the red block in the blue bowl then stack the green block on the yellow
block") is an ordinary `Task` whose ``subgoals`` list 2-4 `Subgoal`s: a primitive family
(``put``, ``stack``, ``push``: the ones whose success persists once the gripper lets go) bound to
entity indices of the composite scene. Each subgoal is an instruction of the primitive task that
the VLA recipes train on, and its success is the primitive's own success function, read through
a *view* of the scene (`view_order`): the entities reordered so that the subgoal's subject and
goal sit at the indices the primitive expects (subject = block 0; goal = bowl 0, block 1 or
zone 0), the others after them. `sim.focus.SubgoalFocus` puts an env into that view
(instruction, success, shaping, state observation and scripted expert all follow it), so a
primitive executor runs a subgoal of a long task unchanged.

Ground truth from the simulator: `holds(world, subgoal)` on the raw scene; a task's progress is
the share of its subgoals that hold *in order* (the longest prefix that holds now), and it
succeeds when all hold. `check_subgoal` says why a subgoal cannot be executed now, and
`parse_subgoal` turns any paraphrase of a primitive instruction back into a `Subgoal` of a
scene (the vocabulary a planner writes in).

Instructions come from the primitive templates joined by connective templates, e.g. "first put
the red block in the blue bowl and then stack the green cube on the yellow one".
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

import numpy as np

from ..registry import TASKS
from .scene import BLOCK_HALF, BOWL_RADIUS, COLOURS, ZONE_RADIUS
from .tasks import (
    BLOCK_R,
    Layout,
    Task,
    World,
    _on_table,
    _sample_xy,
    get_task,
    task_counts,
)

POSE_SIZE = 7
"""numbers per entity in a state observation's ``objects`` (position 3, quaternion 4)"""
ENTITY_KINDS = ("blocks", "bowls", "zones", "targets")
"""entity kinds in the order a state observation lists them"""
ENTITY_SIZE = POSE_SIZE + len(ENTITY_KINDS) + len(COLOURS)
"""numbers per entity with ``entity_features``: pose, kind one-hot, colour one-hot (`COLOURS`)"""
PRIMITIVES = ("put", "stack", "push")
"""primitive families a composite is made of (their success persists after the release)"""
KIND_OF_GOAL = {"put": "bowls", "stack": "blocks", "push": "zones"}
"""primitive family -> kind of the entity its {goal} names"""
GOAL_INDEX = {"put": 0, "stack": 1, "push": 0}
"""primitive family -> index of the goal entity in the primitive's own scene"""
CONNECTIVES = {
    2: ("{0} then {1}", "first {0} and then {1}", "{0} and after that {1}"),
    3: ("{0} then {1} then {2}", "first {0} then {1} and finally {2}"),
    4: ("{0} then {1} then {2} then {3}", "first {0} then {1} then {2} and finally {3}"),
}
"""number of subgoals -> paraphrases joining their instructions (the env's charset has no
commas)"""
PUSHER_CLEARANCE = 0.035
"""free radius (metres) kept around the spot behind a push subject where the pusher comes down"""
GRIPPER_CLEARANCE = 0.02
"""extra free margin (metres) around a bowl, so that fingers coming down on a block beside it
miss its wall (crowded long-horizon scenes had the scripted expert stuck there)"""
LAYOUT_TRIES = 20
"""whole-layout draws before a composite scene is declared too crowded"""
SUBGOAL_SLACK = 1.6
"""a composite's time limit: this many times the sum of its subgoals' primitive time limits"""


@dataclass(frozen=True)
class Subgoal:
    """A primitive instruction bound to entities of a scene."""

    family: str
    """primitive family: put | stack | push"""
    subject: int
    """index of the block it moves"""
    goal: int
    """index of the goal entity, of kind ``KIND_OF_GOAL[family]``"""

    @property
    def goal_kind(self) -> str:
        return KIND_OF_GOAL[self.family]

    def text(self, colours: dict[str, list[str]], template: int = 0) -> str:
        """The primitive instruction (``template``-th paraphrase) in a layout's colours."""
        t = get_task(self.family).templates[template]
        return t.format(
            obj=colours["blocks"][self.subject], goal=colours[self.goal_kind][self.goal]
        )


# ---------------------------------------------------------------------------------------------
# views: a subgoal of a composite scene seen as its primitive task
# ---------------------------------------------------------------------------------------------


def view_order(counts: dict[str, int], sub: Subgoal) -> dict[str, np.ndarray]:
    """Per kind, scene indices in the order the primitive expects: the subject first among the
    blocks, the goal at `GOAL_INDEX` of its kind, every other entity after them by index."""
    order = {kind: list(range(n)) for kind, n in counts.items()}
    kind = sub.goal_kind
    if kind == "blocks":  # stack: the moved block, then the one it goes on
        head = [sub.subject, sub.goal]
        order["blocks"] = head + [i for i in order["blocks"] if i not in head]
    else:
        order["blocks"] = [sub.subject] + [i for i in order["blocks"] if i != sub.subject]
        order[kind] = [sub.goal] + [i for i in order[kind] if i != sub.goal]
    return {k: np.asarray(v, dtype=int) for k, v in order.items()}


def focus_world(world: World, order: dict[str, np.ndarray]) -> World:
    """``world`` with its entities reordered by `view_order` (per-block arrays follow blocks)."""
    b = order["blocks"]
    return dataclasses.replace(
        world,
        blocks=world.blocks[..., b, :], bowls=world.bowls[..., order["bowls"], :],
        zones=world.zones[..., order["zones"], :], targets=world.targets[..., order["targets"], :],
        block_vel=world.block_vel[..., b], grasped=world.grasped[..., b],
        touched=world.touched[..., b],
    )  # fmt: skip


def view_objects(objects: np.ndarray, counts: dict[str, int], prim: dict[str, int]) -> np.ndarray:
    """A focused env's state-mode ``objects`` [n * 7] (entities of ``counts`` per kind, in the
    view's order) cut to the first ``prim[kind]`` of each kind: the observation of the
    primitive's own scene, for an executor trained on it."""
    poses, keep, at = np.asarray(objects).reshape(-1, POSE_SIZE), [], 0
    for kind in ("blocks", "bowls", "zones", "targets"):
        keep.extend(range(at, at + prim[kind]))
        at += counts[kind]
    return poses[keep].reshape(-1)


def counts_of(world: World) -> dict[str, int]:
    return {
        "blocks": world.blocks.shape[-2], "bowls": world.bowls.shape[-2],
        "zones": world.zones.shape[-2], "targets": world.targets.shape[-2],
    }  # fmt: skip


def holds_batch(world: World, sub: Subgoal) -> np.ndarray:
    """Subgoal ``sub`` is achieved, per world of a batched ``world`` (bool array)."""
    view = focus_world(world, view_order(counts_of(world), sub))
    return np.asarray(get_task(sub.family).success(view), bool)


def holds(world: World, sub: Subgoal) -> bool:
    """Subgoal ``sub`` is achieved in ``world`` (the primitive's success on its view)."""
    return bool(holds_batch(world, sub))


def progress(world: World, subgoals: tuple[Subgoal, ...]):
    """How many subgoals hold in order: the length of the longest prefix that holds now (an
    int array of the worlds' batch shape)."""
    if not subgoals:
        return np.zeros(np.shape(world.tcp)[:-1], int)
    held = np.stack([holds_batch(world, sub) for sub in subgoals], axis=-1)
    return np.cumprod(held, axis=-1).sum(axis=-1)


# ---------------------------------------------------------------------------------------------
# validity: can this subgoal be executed in this state?
# ---------------------------------------------------------------------------------------------


def _on_top_of(world: World, upper: int, lower: int) -> bool:
    off = world.blocks[upper] - world.blocks[lower]
    return bool(
        np.linalg.norm(off[:2]) < 2 * BLOCK_HALF and 1.5 * BLOCK_HALF < off[2] < 3 * BLOCK_HALF
    )


def _covered(world: World, i: int) -> bool:
    return any(_on_top_of(world, j, i) for j in range(len(world.blocks)) if j != i)


def check_subgoal(world: World, sub: Subgoal) -> str | None:
    """None when ``sub`` can be executed now, else why not (a short sentence for the planner)."""
    counts = counts_of(world)
    if sub.family not in PRIMITIVES:
        return f"{sub.family!r} is not a subgoal action; use one of {', '.join(PRIMITIVES)}"
    if not 0 <= sub.subject < counts["blocks"] or not 0 <= sub.goal < counts[sub.goal_kind]:
        return "it names an entity that is not in the scene"
    if sub.family == "stack" and sub.goal == sub.subject:
        return "a block cannot be stacked on itself"
    if holds(world, sub):
        return "it is already done"
    if _covered(world, sub.subject):
        return "another block lies on the block to move"
    if sub.family == "stack" and (
        _covered(world, sub.goal) or _on_top_of(world, sub.goal, sub.subject)
    ):
        return "the block to stack on is not free"
    if sub.family == "push" and world.blocks[sub.subject, 2] > BLOCK_HALF + 0.01:
        return "only a block resting on the table can be pushed"
    return None


# ---------------------------------------------------------------------------------------------
# parsing what a planner writes
# ---------------------------------------------------------------------------------------------


def _pattern(template: str) -> re.Pattern:
    body = re.escape(template).replace(r"\{obj\}", r"(?P<obj>[a-z]+)")
    body = body.replace(r"\{goal\}", r"(?P<goal>[a-z]+)").replace(r"\ ", r"\s+")
    return re.compile(rf"^\s*{body}\s*\.?\s*$")


@functools.cache
def _patterns() -> list[tuple[str, int, re.Pattern]]:
    """(family, template index, pattern) of every paraphrase of the primitive instructions."""
    return [
        (fam, k, _pattern(t)) for fam in PRIMITIVES for k, t in enumerate(get_task(fam).templates)
    ]


class SubgoalError(ValueError):
    """A subgoal text that names no primitive instruction or no entity of the scene."""


def parse_subgoal(text: str, colours: dict[str, list[str]]) -> Subgoal:
    """The `Subgoal` a paraphrase of a primitive instruction names in a scene of ``colours``
    (case and surrounding blanks ignored). Raises `SubgoalError` with what is wrong."""
    said = " ".join(text.lower().split())
    for fam, _, pat in _patterns():
        m = pat.match(said)
        if m is None:
            continue
        obj, goal = m.group("obj"), m.group("goal")
        kind = KIND_OF_GOAL[fam]
        if obj not in colours.get("blocks", []):
            raise SubgoalError(f"there is no {obj} block in the scene")
        if goal not in colours.get(kind, []):
            raise SubgoalError(f"there is no {goal} {kind[:-1]} in the scene")
        return Subgoal(fam, colours["blocks"].index(obj), colours[kind].index(goal))
    examples = "; ".join(
        get_task(f).templates[0].format(obj="<colour>", goal="<colour>") for f in PRIMITIVES
    )
    raise SubgoalError(f"{text.strip()[:80]!r} is not a subgoal I can execute (e.g. {examples})")


# ---------------------------------------------------------------------------------------------
# composite tasks
# ---------------------------------------------------------------------------------------------


def _place_composite(rng: np.random.Generator, task: Task) -> Layout:
    """`_place_once`, drawn again (up to `LAYOUT_TRIES` times) when a crowded scene leaves an
    entity no room."""
    for attempt in range(LAYOUT_TRIES):
        try:
            return _place_once(rng, task)
        except RuntimeError:
            if attempt == LAYOUT_TRIES - 1:
                raise


def _place_once(rng: np.random.Generator, task: Task) -> Layout:
    """Each push subject first, with its zone 12-18 cm away (as the push task places them) and
    the spot behind it, where the pusher comes down, kept free; then the bowls, the other
    blocks and zones anywhere free."""
    placed: list = []
    blocks: dict[int, np.ndarray] = {}
    zones: dict[int, np.ndarray] = {}
    for sub in task.subgoals:
        if sub.family == "push":
            xy = _sample_xy(rng, placed, BLOCK_R)
            blocks[sub.subject] = _on_table(xy, BLOCK_HALF)
            zone = _sample_xy(rng, placed, ZONE_RADIUS, near=xy, dist=(0.12, 0.18))
            zones[sub.goal] = _on_table(zone)
            u = (zone - xy) / np.linalg.norm(zone - xy)
            placed.append((xy - u * (BLOCK_HALF + 0.04), PUSHER_CLEARANCE))
    bowls = [
        _on_table(_sample_xy(rng, placed, BOWL_RADIUS + GRIPPER_CLEARANCE))
        for _ in range(task.n_bowls)
    ]
    for i in range(task.n_zones):
        if i not in zones:
            zones[i] = _on_table(_sample_xy(rng, placed, ZONE_RADIUS))
    for i in range(task.n_blocks):
        if i not in blocks:
            blocks[i] = _on_table(_sample_xy(rng, placed, BLOCK_R), BLOCK_HALF)
    return Layout(
        np.array([blocks[i] for i in range(task.n_blocks)]).reshape(-1, 3),
        rng.uniform(-np.pi / 4, np.pi / 4, size=task.n_blocks),
        bowls=np.array(bowls).reshape(-1, 3),
        zones=np.array([zones[i] for i in range(task.n_zones)]).reshape(-1, 3),
    )


def composite_instruction(
    task: Task, colours: dict[str, list[str]], rng: np.random.Generator
) -> str:
    """A paraphrase of the whole task: one template per subgoal, joined by a connective."""
    parts = []
    for sub in task.subgoals:
        k = int(rng.integers(len(get_task(sub.family).templates)))
        parts.append(sub.text(colours, k))
    joins = CONNECTIVES[len(parts)]
    return joins[int(rng.integers(len(joins)))].format(*parts)


def composite_task(name: str, subgoals: list[tuple[str, int, int]], n_blocks: int,
                   n_bowls: int = 0, n_zones: int = 0) -> Task:  # fmt: skip
    """A long-horizon task of ``subgoals`` (family, subject block, goal index), in order, on a
    scene of the given entity counts; success when all hold, ``reward/progress`` their share
    in order."""
    subs = tuple(Subgoal(*s) for s in subgoals)
    if not 2 <= len(subs) <= 4:
        raise ValueError(f"composite task {name!r}: 2-4 subgoals, got {len(subs)}")
    counts = {"blocks": n_blocks, "bowls": n_bowls, "zones": n_zones, "targets": 0}
    for sub in subs:
        prim = task_counts(get_task(sub.family))
        short = [k for k, n in prim.items() if counts[k] < n]
        if sub.family not in PRIMITIVES or short:
            raise ValueError(
                f"composite task {name!r}: subgoal {sub} needs family in {PRIMITIVES} and at "
                f"least the primitive's entities (short of {short})"
            )

    def success(w: World) -> bool:
        return progress(w, subs) == len(subs)

    def shaping(w: World) -> dict[str, float]:
        return {"progress": progress(w, subs) / len(subs)}

    limit = int(SUBGOAL_SLACK * sum(get_task(s.family).max_episode_steps for s in subs))
    return Task(
        name, n_blocks, n_bowls, n_zones, 0, (), success, shaping, _place_composite,
        max_episode_steps=limit, family="composite", subgoals=subs,
        instruct=composite_instruction,
    )  # fmt: skip


COMPOSITES = {
    "put_two": dict(subgoals=[("put", 0, 0), ("put", 1, 1)], n_blocks=3, n_bowls=2),
    "put_then_stack": dict(subgoals=[("put", 0, 0), ("stack", 1, 2)], n_blocks=4, n_bowls=2),
    "push_then_put": dict(
        subgoals=[("push", 0, 0), ("put", 1, 0)], n_blocks=3, n_bowls=2, n_zones=2
    ),
    "put_three": dict(
        subgoals=[("put", 0, 0), ("put", 1, 1), ("put", 2, 2)], n_blocks=4, n_bowls=3
    ),
}
"""registered composites: name -> `composite_task` arguments (2 and 3 subgoals, three
primitive families)"""

SKILL_SCENES = {
    "skills": dict(
        subgoals=[("push", 0, 1), ("put", 1, 1), ("stack", 2, 3)],
        n_blocks=4,
        n_bowls=2,
        n_zones=2,
    ),
}
"""scenes to train one executor for every primitive family in (with ``subgoal_focus``): every
family, the most blocks of a composite and as many entities as there are colours; not planner
tasks (`COMPOSITES` are)"""

for _name, _kw in {**COMPOSITES, **SKILL_SCENES}.items():
    TASKS.register(_name, composite_task(_name, **_kw))
