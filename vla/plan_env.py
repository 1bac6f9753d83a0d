"""Reason, then act: the episode environment of a VLM planner whose subgoals a VLA executes.

`PlanEnv` implements the VLM side's `EpisodeEnv` (``reset(samples)``, ``respond(row, text)``,
``fork``), so the multi-turn episode rollout, its training forward, trees and SFT traces run a
planner unchanged. A sample names an indexed initial state of a long-horizon task
(``meta["scene"] = {"task", "task_id", "trial_id"}``, see ``datasets/plan_tasks.py``); the prompt shows
the agent-view image and the long instruction. Each policy turn is read as:

* ``<subgoal>put the red block in the blue bowl</subgoal>``: parsed (`sim.composite.parse_subgoal`)
  and checked against the current state (`check_subgoal`); a valid one is executed by the
  executor in the simulator with the env focused on it (`sim.focus.SubgoalFocus`), up to the primitive's
  time limit (``plan.subgoal_steps``), and the planner gets the new agent-view image and a short
  outcome message. An invalid one (does not parse, names nothing in the scene, cannot be done
  now) gets an error observation, counts ``planner/invalid`` and changes nothing;
* ``<done/>`` ends the episode; a turn with neither gets an error observation too.

Executors (``vla/executors.py``): ``oracle`` (the scripted experts on the focused subgoal: the
upper bound) or frozen VLA policies saved by the VLA recipes, one per primitive family or one
that reads the subgoal's words for all (`PolicyExecutor`). A non-finite action becomes a no-op
and is counted; a physics blow-up ends the subgoal as failed and puts the scene back as it was
before it (``planner/unstable``). After each subgoal the
gripper rises clear (the scripted `sim.expert.clear_action`) so the next starts from free space;
a policy executor's arm then returns to the home pose (`sim.expert.home_action`), where every
episode it was cloned from began (the next subgoal started above the last bowl before, a state
no primitive episode shows).

Each row of a rollout is a snapshot of one env per task (``SubgoalFocus.get_state``): ``respond``
restores it, executes, and snapshots again, so the G rows of a group are G independent episodes
from the same indexed initial state and ``fork`` is a copy. Every observation carries the row's
cumulative record in ``Observation.info`` (never shown to the model): ``planner/subgoals``,
``planner/valid``, ``planner/invalid``, ``planner/executed`` (subgoals the executor finished),
``planner/unstable``, ``planner/env_steps``, and the simulator's ground truth
``planner/progress`` (share of the task's subgoals that hold in order) and ``planner/success``;
the ``plan_*`` rewards (``rewards/plan_rewards.py``) read them. Per answered turn, in order, it also
keeps the progress the turn made, whether it was invalid and whether its subgoal was the task's
next one in order (``planner/turn_progress``, ``planner/turn_invalid``, ``planner/turn_match``):
the ``plan_turns`` process reward scores each turn from them. ``planner/on_plan`` counts the
turns that named the task's next subgoal, whatever the executor then did, so that planning errors
and execution errors can be told apart.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import textwrap
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ..sim.composite import SubgoalError, check_subgoal, parse_subgoal
from ..sim.expert import CLEAR_HEIGHT, clear_action, home_action
from ..sim.focus import SubgoalFocus
from ..sim.tasks import get_task
from ..sim.vector import idle_action
from ..vlm.tools import Observation
from .executors import load_executor
from .run_plan import ExecutorPlan, resolve_executor

log = logging.getLogger(__name__)

SUBGOAL = re.compile(r"<subgoal>(.*?)</subgoal>", re.DOTALL)
DONE = re.compile(r"<done\s*/?>")
INVALID = "planner/invalid"
"""error counter of turns that name no executable subgoal"""
INVALID_FRAMES = 10
"""video frames an invalid turn is shown for (half a second at 20 fps)"""
CLEAR_STEPS = 20
"""most env steps the gripper takes to rise clear after a subgoal"""
HOME_STEPS = 60
"""most env steps the arm takes to return to the home pose after rising clear (executors
with ``from_home``)"""


# ---------------------------------------------------------------------------------------------
# the episode environment
# ---------------------------------------------------------------------------------------------


@dataclass
class PlanSettings:
    executor: object
    """`executors.OracleExecutor`, `executors.PolicyExecutor`, or anything with
    ``can(family) -> bool`` (a subgoal family it cannot execute is refused like a bad plan) and
    ``start(env) -> act``, ``act(obs) -> actions [K, A]`` for the subgoal the env is focused on;
    optionally ``start_many(envs)`` for several envs at once (`PolicyExecutor.start_many`: one
    policy forward for all)"""
    subgoal_steps: int = 0
    """env steps the executor gets per subgoal (0: the primitive task's time limit)"""
    home: bool | None = None
    """the arm returns to the home pose after each subgoal (None: the executor's ``from_home``)"""
    image_size: int = 128
    """side of the camera images (the planner's and a pixel executor's)"""
    obs_mode: str = "state"
    """what the executor observes: state | rgb"""
    cameras: tuple[str, ...] = ("agentview",)
    """cameras of a pixel executor (the planner always sees the agent view)"""
    record: int = 0
    """side of the video frames recorded per row while subgoals run (0: none; `replay_video`)"""
    memo: int = 4096
    """subgoal outcomes remembered (0: none). A deterministic executor (the oracle's scripted
    experts; a frozen VLA acting deterministically) run on the same subgoal from the same state
    does the same thing again, so an outcome is kept under (initial state, subgoals executed
    before it, subgoal) and replayed instead of simulated: SFT epochs over the same traces and
    group members that agree on a plan simulate it once. Not used while recording frames."""


@dataclass
class _Row:
    task: str
    state: dict
    record: dict = field(default_factory=dict)
    path: tuple = ()
    """the row's initial state's key, then every subgoal executed on it (the `PlanSettings.memo`
    key of its state)"""


@dataclass
class _Outcome:
    """A subgoal's execution, as `PlanSettings.memo` keeps it."""

    state: dict
    ok: bool
    unstable: bool
    steps: int
    image: np.ndarray


def _record() -> dict:
    keys = (
        "subgoals",
        "valid",
        "invalid",
        "executed",
        "on_plan",
        "unstable",
        "env_steps",
        "progress",
        "success",
    )
    return {**{f"planner/{k}": 0.0 for k in keys}, **{k: () for k in TURN_KEYS}}


TURN_PROGRESS, TURN_INVALID, TURN_MATCH = (
    "planner/turn_progress",
    "planner/turn_invalid",
    "planner/turn_match",
)
"""record keys of the answered turns in order: the progress each one made (its subgoal's change
of ``planner/progress``; 0 for an invalid turn), whether it was invalid (1.0) or not (0.0), and
whether it named the task's next subgoal in order (the first that does not hold yet; 1.0) or
not, for per-turn rewards (``rewards/plan_rewards.py``: ``plan_turns``)"""
TURN_KEYS = (TURN_PROGRESS, TURN_INVALID, TURN_MATCH)


def _add_turn(record: dict, progress: float, invalid: bool, match: bool = False) -> None:
    for key, value in zip(TURN_KEYS, (progress, float(invalid), float(match))):
        record[key] = (*record[key], value)


class PlanEnv:
    """`EpisodeEnv` of a planner; see the module docstring."""

    def __init__(
        self, settings: PlanSettings, memo: OrderedDict | None = None, sims: dict | None = None
    ):
        """``memo``: the `PlanSettings.memo` store, shared by the environments of one run (the
        rollout builds one per call); a new one when None. ``sims``: the simulators (per task, a
        list of `SubgoalFocus` envs), likewise shared so that a run builds them once; the environments
        sharing them must not run at the same time (one rollout at a time per process)."""
        self.settings = settings
        self._sims: dict[str, list] = {} if sims is None else sims
        self._starts: dict[tuple, dict] = {}
        self.rows: list[_Row] = []
        self.counters = {"bad_actions": 0}
        self.frames: list[list[np.ndarray]] = []
        """per row, the annotated agent-view frames of its subgoals (``settings.record``)"""
        self._memo: OrderedDict[tuple, _Outcome] = OrderedDict() if memo is None else memo
        self._ready: dict[tuple, _Outcome] = {}
        """outcomes `prepare` simulated for the turns about to be answered (memo keys)"""
        self.memo_hits = 0
        """subgoals replayed from `PlanSettings.memo` instead of simulated"""

    def scene(self, row: int):
        """Episode ``row``'s simulator (the `SubgoalFocus` env of its task, shared by the rows of
        that task) set to the row's current state."""
        env = self._env(self.rows[row].task)
        env.set_state(self.rows[row].state)
        return env

    def _env(self, task: str, k: int = 0):
        """Simulator ``k`` of ``task`` (0: the one the rows of that task share; the others run
        subgoals side by side in `prepare`)."""
        sims = self._sims.setdefault(task, [])
        while len(sims) <= k:
            sims.append(self._make_env(task))
        return sims[k]

    def _make_env(self, task: str):
        import gymnasium as gym

        import perceptrl.sim  # noqa: F401  (registers the ids)
        from perceptrl.sim import env_id

        s = self.settings
        env = gym.make(
            env_id(task),
            render_mode="rgb_array",
            obs_mode=s.obs_mode,
            width=s.image_size,
            height=s.image_size,
            cameras=tuple(s.cameras),
            entity_features=getattr(s.executor, "entity_features", False),
        ).unwrapped  # fmt: skip  (no time limit: the planner's budgets bound an episode)
        return SubgoalFocus(env)

    def reset(self, samples: list[dict]) -> None:
        self.rows = []
        for s in samples:
            scene = scene_of(s)
            key = (scene["task"], scene["task_id"], scene["trial_id"])
            if key not in self._starts:
                env = self._env(scene["task"])
                env.reset(options={"task_id": scene["task_id"], "trial_id": scene["trial_id"]})
                self._starts[key] = env.get_state()
            self.rows.append(_Row(scene["task"], self._starts[key], _record(), (key,)))
        self.frames = [[] for _ in samples]
        self._ready = {}

    def fork(self, src: int, dst: int) -> None:
        """Episode ``dst`` continues ``src``'s scene and record from here on, apart."""
        while len(self.rows) <= dst:
            self.rows.append(self.rows[src])
        r = self.rows[src]
        self.rows[dst] = _Row(r.task, r.state, dict(r.record), r.path)

    def respond(self, row: int, text: str) -> Observation | None:
        r = self.rows[row]
        rec = r.record
        m = SUBGOAL.search(text)
        if m is None:
            if DONE.search(text):
                return None
            return self._invalid(
                row, "write the next subgoal as <subgoal>...</subgoal>, or <done/>"
            )
        env = self._env(r.task)
        env.set_state(r.state)
        rec["planner/subgoals"] += 1
        sub, why = self._subgoal(env, m.group(1))
        if why is not None:
            return self._invalid(row, why, counted=True)
        rec["planner/valid"] += 1
        scene = env.unwrapped
        before, n = scene.subgoals_done(), len(scene.task.subgoals)
        match = before < n and sub == scene.task.subgoals[before]
        rec["planner/on_plan"] += match
        out = self._outcome_of(env, sub, row)
        rec["planner/executed"] += out.ok
        rec["planner/unstable"] += out.unstable
        rec["planner/env_steps"] += out.steps
        r.state, r.path = out.state, (*r.path, sub)
        done = scene.subgoals_done()
        _add_turn(rec, done / n - rec["planner/progress"], invalid=False, match=match)
        rec["planner/progress"] = done / n
        rec["planner/success"] = float(done == n)
        said = _outcome(sub.text(scene.layout.colours), out.ok, out.unstable, out.steps)
        return Observation(said, [Image.fromarray(out.image)], info=dict(rec))

    def _subgoal(self, env, words: str):
        """(the subgoal ``words`` name, None) when ``env`` (at the row's state) can execute it
        now, else (None, why not)."""
        try:
            sub = parse_subgoal(words, env.unwrapped.layout.colours)
        except SubgoalError as e:
            return None, str(e)
        why = check_subgoal(env.unwrapped.world(), sub)
        if why is None and not self.settings.executor.can(sub.family):
            why = f"this robot has no skill to {sub.family} (plan.policies)"
        return (sub, None) if why is None else (None, f"cannot do that now: {why}")

    def prepare(self, rows: list[int], texts: list[str]) -> None:
        """Execute the subgoals that turns ``texts`` of episodes ``rows`` name, side by side
        (one env per subgoal, the executor's ``start_many`` acting for all of them at once), so
        that `respond` then finds their outcomes ready. The rollout calls this with a round's
        turns before answering them one by one; the outcomes are the ones `respond` alone
        would get (up to the float rounding of a batched policy forward). Turns that name no
        executable subgoal, subgoals already in the memo, and duplicates (group members that
        agree) are left to `respond`. Does nothing while recording frames."""
        self._ready = {}
        if self.settings.record:
            return
        jobs: dict[tuple, tuple[int, object]] = {}
        for row, text in zip(rows, texts):
            m = SUBGOAL.search(text)
            if m is None:
                continue
            r = self.rows[row]
            env = self._env(r.task)
            env.set_state(r.state)
            sub, why = self._subgoal(env, m.group(1))
            key = (*r.path, sub)
            if why is None and key not in jobs and not (self.settings.memo and key in self._memo):
                jobs[key] = (row, sub)
        if len(jobs) < 2:
            return
        envs, used = [], Counter()
        for row, _ in jobs.values():
            task = self.rows[row].task
            env = self._env(task, used[task])
            used[task] += 1
            env.set_state(self.rows[row].state)
            envs.append(env)
        subs = [sub for _, sub in jobs.values()]
        results = self._execute(envs, subs, [row for row, _ in jobs.values()])
        for key, env, (ok, unstable, steps) in zip(jobs, envs, results):
            state = env.get_state()
            shown = self._env(self.rows[jobs[key][0]].task)  # rendered by one env per task
            shown.set_state(state)
            self._ready[key] = _Outcome(state, ok, unstable, steps, shown.render())

    def _outcome_of(self, env, sub, row: int) -> _Outcome:
        """Execute ``sub`` from the row's state (in ``env``, which is left at the state after
        it), or replay it from the memo."""
        size = 0 if self.settings.record else self.settings.memo
        key = (*self.rows[row].path, sub)
        hit = self._memo.get(key) if size else None
        if hit is not None:
            self._memo.move_to_end(key)
            self.memo_hits += 1
            env.set_state(hit.state)
            return hit
        out = self._ready.get(key)
        if out is not None:
            env.set_state(out.state)
        else:
            [(ok, unstable, steps)] = self._execute([env], [sub], [row])
            out = _Outcome(env.get_state(), ok, unstable, steps, env.render())
        if size:
            self._memo[key] = out
            while len(self._memo) > size:
                self._memo.popitem(last=False)
        return out

    def _invalid(self, row: int, message: str, counted: bool = False) -> Observation:
        r = self.rows[row]
        if not counted:
            r.record["planner/subgoals"] += 1
        r.record["planner/invalid"] += 1
        _add_turn(r.record, 0.0, invalid=True)
        if self.settings.record:
            env = self._env(r.task)
            env.set_state(r.state)
            frame = self._frame(env, row, f"invalid: {message}", (255, 90, 90))
            self.frames[row] += [frame] * INVALID_FRAMES
        return Observation(f"Error: {message}", error=INVALID, info=dict(r.record))

    def _frame(self, env, row: int, bottom: str, colour=(255, 255, 255)) -> np.ndarray:
        """The agent view now, scaled to ``settings.record`` px, with the task's instruction
        and subgoal count on top and ``bottom`` below."""
        import cv2

        from ..sim.demonstrations import annotate

        size = self.settings.record
        img = cv2.resize(env.render(), (size, size), interpolation=cv2.INTER_LINEAR)
        scene = env.unwrapped
        lines = textwrap.wrap(scene.layout.instruction, 40)
        done = f"subgoals done: {scene.subgoals_done()}/{len(scene.task.subgoals)}"
        return annotate(img, [*lines, done], bottom, colour)

    def _execute(self, envs: list, subs: list, rows: list[int]) -> list[tuple[bool, bool, int]]:
        """Run the executor on subgoal ``subs[i]`` in ``envs[i]`` (set to row ``rows[i]``'s
        state), all envs stepping in turn with one actor for all, then rise clear (and go home
        when the executor starts there). Returns (finished, blew up, env steps) per subgoal."""
        s = self.settings
        before = [copy.deepcopy(env.get_state()) for env in envs]
        obs = [env.focus(sub) for env, sub in zip(envs, subs)]
        start_many = getattr(s.executor, "start_many", None)
        if start_many is not None:
            act = start_many(envs)
        else:  # an executor with one actor per env
            actors = [s.executor.start(env) for env in envs]

            def act(live: list[int], seen: list[dict]) -> list[np.ndarray]:
                return [actors[i](o) for i, o in zip(live, seen)]

        limits = [s.subgoal_steps or get_task(sub.family).max_episode_steps for sub in subs]
        steps, ok, unstable = [0] * len(envs), [False] * len(envs), [False] * len(envs)
        said = [sub.text(env.unwrapped.layout.colours) for env, sub in zip(envs, subs)]
        noops = [idle_action(env.action_space.shape[0], env.unwrapped.cfg.control) for env in envs]
        live = list(range(len(envs)))
        while live:
            for i, chunk in zip(live, act(live, [obs[i] for i in live])):
                env = envs[i]
                for a in chunk:
                    if not np.isfinite(a).all():
                        self.counters["bad_actions"] += 1
                        a = noops[i]
                    obs[i], _, _, _, info = env.step(a)
                    steps[i] += 1
                    if s.record:
                        self.frames[rows[i]].append(
                            self._frame(env, rows[i], f"executing: {said[i]}")
                        )
                    unstable[i], ok[i] = bool(info["sim_unstable"]), bool(info["success"])
                    if ok[i] or unstable[i] or steps[i] >= limits[i]:
                        break
            live = [i for i in live if not (ok[i] or unstable[i] or steps[i] >= limits[i])]
        home = s.home
        if home is None:
            home = getattr(s.executor, "from_home", False)
        for env, state, bad in zip(envs, before, unstable):
            if bad:
                env.set_state(state)
            env.focus(None)
            for _ in range(CLEAR_STEPS):
                if env.unwrapped.world().tcp[2] >= CLEAR_HEIGHT:
                    break
                env.step(clear_action(env))
            for _ in range(HOME_STEPS if home else 0):
                action = home_action(env)
                if action is None:
                    break
                env.step(action)
        return list(zip(ok, unstable, steps))


def _outcome(said: str, ok: bool, unstable: bool, steps: int) -> str:
    """The message the planner reads after a subgoal ran."""
    if unstable:
        return f"The simulation failed while the robot tried to {said}; the scene is as before."
    if ok:
        return f"The robot did: {said} ({steps} steps)."
    return f"The robot tried to {said} for {steps} steps and did not finish."


def replay_video(
    settings: PlanSettings, sample: dict, turns: list[str], path, size: int = 256,
    sheet: str | Path | None = None,
):  # fmt: skip
    """Re-run a planner episode (its turn texts, e.g. ``meta["episode"]["texts"]``) and write
    the executor's view as an mp4 at ``size`` px, the current subgoal drawn on each frame (a
    deterministic executor replays the same trajectory). With ``sheet``, also a PNG strip of
    the episode's key frames: the start, the end of every turn, the outcome. Returns the
    episode's record."""
    from ..sim.demonstrations import write_video

    env = PlanEnv(dataclasses.replace(settings, record=size))
    env.reset([sample])
    e = env.scene(0)
    frames = [env._frame(e, 0, "start")] * INVALID_FRAMES
    keys = [frames[0]]
    for text in turns:
        before = len(env.frames[0])
        if env.respond(0, text) is None:
            break
        if len(env.frames[0]) > before:
            keys.append(env.frames[0][-1])
    frames += env.frames[0]
    e.set_state(env.rows[0].state)
    ok = bool(env.rows[0].record["planner/success"])
    last = env._frame(e, 0, "task complete" if ok else "task not complete",
                      (90, 255, 90) if ok else (255, 200, 90))  # fmt: skip
    frames += [last] * 20
    write_video(path, frames, fps=20)
    if sheet is not None:
        write_strip(sheet, [*keys, last])
    return env.rows[0].record


def write_strip(path: str | Path, frames: list[np.ndarray], most: int = 6) -> Path:
    """Frames side by side in one PNG (at most ``most``, evenly chosen, first and last kept)."""
    import cv2

    if len(frames) > most:
        frames = [frames[round(i * (len(frames) - 1) / (most - 1))] for i in range(most)]
    gap = np.full((frames[0].shape[0], 4, 3), 255, np.uint8)
    row = np.concatenate([x for f in frames for x in (f, gap)][:-1], axis=1)
    if not cv2.imwrite(str(path), cv2.cvtColor(row, cv2.COLOR_RGB2BGR)):
        raise RuntimeError(f"OpenCV could not write the PNG {path}; check the folder exists")
    return Path(path)


def scene_of(sample: dict) -> dict:
    """The indexed initial state a planner sample names: ``meta["scene"]`` with ``task``,
    ``task_id``, ``trial_id``; ValueError when it is missing or malformed."""
    scene = (sample.get("meta") or {}).get("scene")
    if not isinstance(scene, dict) or "task" not in scene:
        raise ValueError(
            f"sample {sample.get('id')!r} names no scene; a planner sample needs meta.scene = "
            "{task, task_id, trial_id} (see the plan generator)"
        )
    try:
        get_task(scene["task"])
        return {"task": scene["task"], "task_id": int(scene.get("task_id", 0)),
                "trial_id": int(scene.get("trial_id", 0))}  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"sample {sample.get('id')!r}: bad meta.scene {scene!r} ({e})") from e


# ---------------------------------------------------------------------------------------------
# the recipe's plan section, and the registration as episode environment ``plan``
# ---------------------------------------------------------------------------------------------

PLAN_EVAL = {"plan_success": 1.0}
"""held-out score of a planner: the share of episodes that complete the long-horizon task"""


def plan_settings(plan: ExecutorPlan) -> PlanSettings:
    """`PlanSettings` of a resolved ``plan`` section (`vla.run_plan.resolve_executor`): the
    executor it names, its policies loaded here."""
    from ..errors import ModelError
    from ..trainer.config import ConfigError
    from ..trainer.runtime import resolve_device

    try:  # what the policies' directories hold is known only once they are read
        executor = load_executor(
            plan.executor, dict(plan.policies), str(resolve_device(plan.device))
        )
    except ModelError:  # a damaged or foreign policy folder: the model's error, not the recipe's
        raise
    except (ValueError, OSError) as e:
        raise ConfigError(f"plan.executor: {e}") from e
    return PlanSettings(
        executor, subgoal_steps=plan.subgoal_steps, home=plan.home, image_size=plan.image_size,
        obs_mode=plan.obs_mode, cameras=plan.cameras, memo=plan.memo,
    )  # fmt: skip


def _plan_env(cfg) -> Callable[[], PlanEnv]:
    settings, memo, sims = plan_settings(resolve_executor(cfg)), OrderedDict(), {}
    return lambda: PlanEnv(settings, memo, sims)


def _register() -> None:
    from ..registry import EPISODE_ENVS

    EPISODE_ENVS.register("plan", _plan_env, eval_reward=PLAN_EVAL)


_register()
