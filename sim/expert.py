"""Scripted experts: privileged state + the env's own delta end-effector control.

``ScriptedExpert(env)`` reads ``env.unwrapped.world()`` (true positions, contacts) and returns
delta-EE actions ``(dx, dy, dz, dyaw, gripper)`` in [-1, 1]. Each family is a small phase machine
registered in ``perceptrl.registry.EXPERTS`` (``@EXPERTS.register("<family>")``); all share one
signature ``fn(expert, world) -> action (5,)``. The env must use ``control="ee"``.

An expert acts on the env's task in force: the focused subgoal's primitive (``SubgoalFocus``)
or, given ``subgoal``, that subgoal of a long-horizon task whatever the env's focus. The
``composite`` expert runs a long task's subgoals in order with one such sub-expert each (the
oracle plan executed by the oracle executor).
"""

from __future__ import annotations

import numpy as np

from ..registry import EXPERTS
from .composite import Subgoal, focus_world, holds, view_order
from .focus import focus_of
from .robot import FINGER_OPEN
from .scene import BLOCK_HALF
from .tasks import World, task_counts

OPEN, CLOSE = -1.0, 1.0
HOVER = 0.10
"""height above a block (metres) where the gripper lines up before descending"""


def _move(robot, goal: np.ndarray, yaw: float, grip: float) -> np.ndarray:
    """Delta-EE action (5,) that drives ``robot``'s target towards ``goal`` (3,) and ``yaw``."""
    dpos = (goal - robot.target_pos) / robot.cfg.pos_scale
    dyaw = (yaw - robot.target_yaw) / robot.cfg.yaw_scale
    return np.clip(np.concatenate([dpos, [dyaw, grip]]), -1.0, 1.0)


def _wrap_half_pi(angle: float) -> float:
    """Angle folded into [-pi/4, pi/4] (a cube looks the same every quarter turn)."""
    return float((angle + np.pi / 4) % (np.pi / 2) - np.pi / 4)


def _wrap_pi(angle: float) -> float:
    """Angle folded into [-pi/2, pi/2] (the gripper looks the same every half turn)."""
    return float((angle + np.pi / 2) % np.pi - np.pi / 2)


class ScriptedExpert:
    """Stateful scripted policy for one env; call ``reset()`` after each ``env.reset`` and after
    a change of the env's focus.

    Args:
        env: a ``ManipEnv`` (any wrappers) with ``control="ee"``.
        subgoal: act on this subgoal of the env's long-horizon task (default: the env's task in
            force, see the module docstring).
    """

    def __init__(self, env, subgoal: Subgoal | None = None):
        self.env = env.unwrapped
        self.subgoal = subgoal
        self._wrapped = env
        if self.env.cfg.control != "ee":
            raise ValueError(
                f"ScriptedExpert needs control='ee'; this env has control={self.env.cfg.control!r}"
            )
        self.reset()

    def reset(self) -> None:
        """Forget the phase of the previous episode; follow the env's current focus."""
        sub = self.subgoal or focus_of(self._wrapped)
        family = self.env.task.family if sub is None else sub.family
        self.fn = EXPERTS.get(family)  # UnknownName, with the valid families, if none
        self.order = None if sub is None else view_order(task_counts(self.env.task), sub)
        self.phase, self.timer, self.memo = 0, 0, {}

    def world(self) -> World:
        """The privileged state in this expert's view."""
        w = self.env.world()
        return w if self.order is None else focus_world(w, self.order)

    def act(self, obs=None) -> np.ndarray:
        """Action (5,) float32 for the current state (``obs`` is ignored: the expert is
        privileged)."""
        return np.asarray(self.fn(self, self.world()), np.float32)

    # --------------------------------------------------------------- helpers
    def block_yaw(self, i: int) -> float:
        """Yaw of block ``i`` (of this expert's view) about z, radians."""
        j = i if self.order is None else int(self.order["blocks"][i])
        d, adr = self.env.data, self.env.block_qadr[j]
        w, x, y, z = d.qpos[adr + 3 : adr + 7]
        return float(np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z)))

    def move(self, goal: np.ndarray, yaw: float, grip: float) -> np.ndarray:
        """Action that drives the end-effector target towards ``goal`` (3,) and ``yaw``."""
        return _move(self.env.robot, goal, yaw, grip)

    def near(self, w: World, goal: np.ndarray, tol: float) -> bool:
        """The tcp is within ``tol`` metres of ``goal``."""
        return bool(np.linalg.norm(w.tcp - goal) < tol)

    def advance(self, cond: bool = True) -> None:
        """Go to the next phase when ``cond`` holds."""
        if cond:
            self.phase, self.timer = self.phase + 1, 0

    def wait(self, steps: int) -> bool:
        """Count the steps spent in this phase; True once ``steps`` have passed."""
        self.timer += 1
        return self.timer >= steps

    def pick_phases(self, w: World, i: int) -> np.ndarray | None:
        """Phases 0-3 shared by pick, put and stack: grasp block ``i`` and lift it to HOVER.
        Returns None once the block is up."""
        block = w.blocks[i]
        if self.phase == 0:  # line up above the block
            self.memo["yaw"] = _wrap_half_pi(self.block_yaw(i))
            goal = block + [0.0, 0.0, HOVER]
            self.advance(
                self.near(w, goal, 0.015)
                and abs(self.env.robot.yaw(self.env.data) - self.memo["yaw"]) < 0.08
            )
            return self.move(goal, self.memo["yaw"], OPEN)
        if self.phase == 1:  # descend around it
            goal = np.array([block[0], block[1], max(block[2], BLOCK_HALF)])
            self.advance(self.near(w, goal, 0.008))
            return self.move(goal, self.memo["yaw"], OPEN)
        if self.phase == 2:  # close
            goal = np.array([block[0], block[1], max(block[2], BLOCK_HALF)])
            self.advance(self.wait(6))
            return self.move(goal, self.memo["yaw"], CLOSE)
        if self.phase == 3:  # lift
            goal = np.array([block[0], block[1], BLOCK_HALF + HOVER + 0.02])
            if not w.grasped[i] and self.timer > 3:
                self.phase, self.timer = 0, 0  # dropped: try again
                return self.move(w.tcp + [0, 0, 0.03], self.memo["yaw"], OPEN)
            self.timer += 1
            self.advance(w.tcp[2] > BLOCK_HALF + HOVER)
            return self.move(goal, self.memo["yaw"], CLOSE)
        return None

    def place_phases(self, w: World, goal: np.ndarray, release_z: float) -> np.ndarray:
        """Phases 4-7: carry the held block above ``goal`` (3,), lower the tcp to ``release_z``,
        open, retreat upwards."""
        yaw = self.memo["yaw"]
        above = np.array([goal[0], goal[1], release_z + 0.08])
        if self.phase == 4:
            self.advance(self.near(w, above, 0.012))
            return self.move(above, yaw, CLOSE)
        low = np.array([goal[0], goal[1], release_z])
        if self.phase == 5:
            self.advance(self.near(w, low, 0.006) or self.wait(25))
            return self.move(low, yaw, CLOSE)
        if self.phase == 6:
            self.advance(self.wait(5))
            return self.move(low, yaw, OPEN)
        return self.move(above + [0.0, 0.0, 0.05], yaw, OPEN)


@EXPERTS.register("reach")
def reach_expert(ex: ScriptedExpert, w: World) -> np.ndarray:
    return ex.move(w.targets[0], 0.0, OPEN)


@EXPERTS.register("pick")
def pick_expert(ex: ScriptedExpert, w: World) -> np.ndarray:
    act = ex.pick_phases(w, 0)
    if act is None:  # hold it up
        act = ex.move(np.array([w.tcp[0], w.tcp[1], 0.22]), ex.memo["yaw"], CLOSE)
    return act


@EXPERTS.register("put")
def put_expert(ex: ScriptedExpert, w: World) -> np.ndarray:
    act = ex.pick_phases(w, 0)
    if act is None:
        act = ex.place_phases(w, w.bowls[0], release_z=0.075)
    return act


@EXPERTS.register("stack")
def stack_expert(ex: ScriptedExpert, w: World) -> np.ndarray:
    act = ex.pick_phases(w, 0)
    if act is None:
        top = w.blocks[1] + [0.0, 0.0, 2 * BLOCK_HALF + 0.004]
        act = ex.place_phases(w, top, release_z=top[2])
    return act


@EXPERTS.register("push")
def push_expert(ex: ScriptedExpert, w: World) -> np.ndarray:
    block, zone = w.blocks[0], w.zones[0]
    to_zone = zone[:2] - block[:2]
    u = to_zone / max(np.linalg.norm(to_zone), 1e-6)  # push direction (2,)
    yaw = _wrap_pi(float(np.arctan2(u[1], u[0])))
    back = block[:2] - u * (BLOCK_HALF + 0.04)
    grip = 0.4  # fingers part-closed: a 5 cm wide pusher
    if ex.phase == 0:  # above the start point behind the block
        goal = np.array([back[0], back[1], 0.09])
        ex.advance(ex.near(w, goal, 0.015))
        return ex.move(goal, yaw, grip)
    if ex.phase == 1:  # down to the table
        goal = np.array([back[0], back[1], 0.025])
        ex.advance(ex.near(w, goal, 0.008))
        return ex.move(goal, yaw, grip)
    # push through the block centre towards the zone; re-approach if it slid sideways
    rel = w.tcp[:2] - block[:2]
    lateral = abs(rel[0] * u[1] - rel[1] * u[0])
    if lateral > 0.02 or np.dot(rel, u) > 0:
        ex.phase = 0
        return ex.move(w.tcp + [0.0, 0.0, 0.05], yaw, grip)
    goal2 = block[:2] + u * min(0.03, np.linalg.norm(to_zone))
    return ex.move(np.array([goal2[0] - u[0] * 0.03, goal2[1] - u[1] * 0.03, 0.025]), yaw, grip)


SETTLE_STEPS = 3
"""the composite expert counts a subgoal done once it held this many steps in a row (a pushed
block still sliding may leave its zone again)"""
CLEAR_HEIGHT = 0.12
"""tcp height the composite expert rises to between subgoals (a pusher moving sideways at table
height would sweep the block it just placed)"""


def clear_action(env) -> np.ndarray:
    """Action (5,) that raises the tcp straight up above `CLEAR_HEIGHT`, gripper open."""
    env, robot = env.unwrapped, env.unwrapped.robot
    tcp = robot.tcp_pos(env.data)
    goal = np.array([tcp[0], tcp[1], CLEAR_HEIGHT + 0.02])
    return _move(robot, goal, robot.target_yaw, OPEN).astype(np.float32)


HOME_TOLERANCE = 0.01
"""metres (and radians of yaw) within which the tcp counts as back at the home pose"""


def home_action(env) -> np.ndarray | None:
    """Action (5,) that carries the tcp back to its pose at the home posture, gripper open, or
    None once it is there (within `HOME_TOLERANCE`, fingers open): where every episode of a
    primitive task starts."""
    env, robot = env.unwrapped, env.unwrapped.robot
    pos, yaw = robot.home_pose()
    off = np.linalg.norm(robot.tcp_pos(env.data) - pos)
    turned = abs(robot.yaw(env.data) - yaw)
    if (
        off < HOME_TOLERANCE
        and turned < HOME_TOLERANCE
        and robot.gripper_width(env.data) > 2 * FINGER_OPEN - HOME_TOLERANCE
    ):
        return None
    return _move(robot, pos, yaw, OPEN).astype(np.float32)


@EXPERTS.register("composite")
def composite_expert(ex: ScriptedExpert, w: World) -> np.ndarray:
    """The task's subgoals in order, each by its primitive's expert; once the current one has
    held for `SETTLE_STEPS` steps the gripper rises straight up to `CLEAR_HEIGHT`, then the next
    one starts."""
    subgoals = ex.env.task.subgoals
    k, sub = ex.memo.get("k", 0), ex.memo.get("sub")
    if sub is None:
        sub = ex.memo["sub"] = ScriptedExpert(ex.env, subgoals[0])
    held = ex.memo.get("held", 0) + 1 if holds(w, subgoals[k]) else 0
    ex.memo["held"] = held
    if held < SETTLE_STEPS or k + 1 == len(subgoals):
        return sub.act()
    if w.tcp[2] < CLEAR_HEIGHT:
        return clear_action(ex.env)
    ex.memo.update(k=k + 1, sub=ScriptedExpert(ex.env, subgoals[k + 1]), held=0)
    return ex.memo["sub"].act()


def rollout_expert(
    env, seed: int | None = None, options: dict | None = None, max_steps: int | None = None
) -> dict:
    """Run the scripted expert for one episode on ``env`` (a gymnasium env, any wrappers).

    Returns:
        dict with ``success`` (bool), ``steps`` (int), ``return`` (float), ``instruction``.
    """
    obs, info = env.reset(seed=seed, options=options)
    expert = ScriptedExpert(env)
    limit = max_steps or env.unwrapped.task.max_episode_steps
    total, success, steps = 0.0, False, 0
    while steps < limit:
        obs, r, terminated, truncated, info = env.step(expert.act(obs))
        total, steps = total + r, steps + 1
        success = success or bool(info["success"])
        if terminated or truncated:
            break
    return {"success": success, "steps": steps, "return": total, "instruction": obs["instruction"]}
