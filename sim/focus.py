"""`SubgoalFocus`: a long-horizon task's subgoal shown as its primitive task (a gymnasium wrapper).

A composite task (``sim.composite``) is an ordinary `ManipEnv` task whose subgoals are primitive
instructions bound to entities of its scene. Wrapped in `SubgoalFocus`, the env can show one
subgoal as the primitive task it is, so a primitive executor and the scripted experts run it
unchanged: ``focus(subgoal)`` makes the instruction the subgoal's, the success rule, the
shaping terms, the reward and ``terminated`` the primitive's, and lists the state observation's
entities (``objects``) and `SubgoalFocus.world` in the primitive's order (subject first, see
`composite.view_order`), until the next reset or ``focus(None)``. The scene's own state stays
``env.unwrapped.world()``; ``env.unwrapped.subgoals_done()`` counts the task's subgoals that hold
in order.

``SubgoalFocus(env, draw=True)`` starts every episode of a composite task focused on one of its
subgoals that can be executed from the initial state, phrased by a random template of its
primitive, both drawn after the layout from the generator that drew it (`ManipEnv.layout_rng`),
so an indexed initial state fixes them too: single-subgoal episodes in long-horizon scenes, to
clone an executor on (``env.subgoal_focus``; `make_env` applies it). Primitive tasks have no
subgoals and pass through unchanged.

Snapshots: `SubgoalFocus.get_state` is the env's snapshot plus its ``focus``;
`SubgoalFocus.set_state` restores both.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from .composite import ENTITY_KINDS, Subgoal, check_subgoal, focus_world, view_order
from .tasks import Task, World, get_task, task_counts


class SubgoalFocus(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """A `ManipEnv` (any wrappers) that can show one of its task's subgoals as the primitive
    task; see the module docstring.

    Args:
        env: a `ManipEnv`, wrapped or not.
        draw: each reset focuses a random subgoal executable from the initial state.
    """

    def __init__(self, env: gym.Env, draw: bool = False):
        gym.utils.RecordConstructorArgs.__init__(self, draw=draw)
        gym.Wrapper.__init__(self, env)
        self.draw = draw
        self._focus: Subgoal | None = None
        self._text = ""
        self._order: dict[str, np.ndarray] | None = None
        """the focused subgoal's `composite.view_order` (None without a focus)"""
        self._rows: np.ndarray | None = None
        """the view's entity rows: indices into the scene's entity list, in the view's order"""

    @property
    def focused(self) -> Subgoal | None:
        """The subgoal in focus (None: the env's own task)."""
        return self._focus

    @property
    def active(self) -> Task:
        """The task in force: the focused subgoal's primitive, else the env's own task."""
        return self.unwrapped.task if self._focus is None else get_task(self._focus.family)

    def focus(self, subgoal: Subgoal | None, instruction: str | None = None) -> dict:
        """Act as ``subgoal``'s primitive task from now on, with ``instruction`` (default: the
        primitive's first template in this scene's colours); None returns to the env's own
        task. Returns the current observation in the new view."""
        if self.unwrapped.layout is None:
            raise RuntimeError("SubgoalFocus.focus before the first reset")
        self._set(subgoal, instruction)
        return self._view(self.unwrapped.observe())

    def world(self) -> World:
        """The privileged task state (`ManipEnv.world`) in the focused subgoal's view."""
        w = self.unwrapped.world()
        return w if self._order is None else focus_world(w, self._order)

    # ---------------------------------------------------------------- gymnasium API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = self.env.reset(seed=seed, options=options)
        self._set(None)
        if self.draw and self.unwrapped.task.subgoals and self._draw():
            obs, info = self._view(obs), self._score(info)[2]
            info["instruction"] = self._text
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self._focus is None:
            return obs, reward, terminated, truncated, info
        reward, terminated, info = self._score(info)
        return self._view(obs), reward, terminated, truncated, info

    # ---------------------------------------------------------------- snapshots
    def get_state(self) -> dict | None:
        """`ManipEnv.get_state` plus ``focus``: [family, subject, goal, instruction] or None."""
        state = self.unwrapped.get_state()
        if state is None:
            return None
        f = self._focus
        return {**state, "focus": None if f is None else [f.family, f.subject, f.goal, self._text]}

    def set_state(self, state: dict | None) -> None:
        """Continue the episode of `get_state`'s ``state`` (None leaves the env as it is)."""
        if state is None:
            return
        self.unwrapped.set_state(state)
        f = state.get("focus")
        self._set(None if f is None else Subgoal(str(f[0]), int(f[1]), int(f[2])),
                  None if f is None else str(f[3]))  # fmt: skip

    # ---------------------------------------------------------------- helpers
    def _set(self, subgoal: Subgoal | None, instruction: str | None = None) -> None:
        self._focus = subgoal
        if subgoal is None:
            self._order, self._rows, self._text = None, None, ""
            return
        env = self.unwrapped
        counts = task_counts(env.task)
        self._order = view_order(counts, subgoal)
        starts = np.cumsum([0, *(counts[k] for k in ENTITY_KINDS)])
        self._rows = np.concatenate(
            [start + self._order[k] for k, start in zip(ENTITY_KINDS, starts)]
        )
        self._text = instruction or subgoal.text(env.layout.colours)

    def _draw(self) -> bool:
        """Focus one of the task's subgoals that can be executed now, in a random paraphrase
        (both from the layout's generator); False when every subgoal is blocked."""
        env = self.unwrapped
        world = env.world()
        ready = [s for s in env.task.subgoals if check_subgoal(world, s) is None]
        if not ready:  # no layout leaves every subgoal blocked; keep the task if one did
            return False
        rng = env.layout_rng
        sub = ready[int(rng.integers(len(ready)))]
        template = int(rng.integers(len(get_task(sub.family).templates)))
        self._set(sub, sub.text(env.layout.colours, template))
        return True

    def _score(self, info: dict) -> tuple[float, bool, dict]:
        """(reward, terminated, info) of the primitive in force: the env's info with the task's
        terms replaced (a physics blow-up scores 0 and does not terminate, as the env's)."""
        unstable = bool(info.get("sim_unstable", False))
        reward, terminated, scored = self.unwrapped.score(self.active, self.world(), unstable)
        rest = {k: v for k, v in info.items() if k not in scored and not k.startswith("reward/")}
        return reward, terminated, {**scored, **rest}

    def _view(self, obs: dict) -> dict:
        """The env's observation in the focused view: instruction and entity order."""
        if self._focus is None:
            return obs
        obs = dict(obs)
        if "objects" in obs:
            rows = obs["objects"].reshape(self.unwrapped.n_entities, -1)
            obs["objects"] = rows[self._rows].reshape(-1)
        obs["instruction"] = self._text
        return obs


def focus_of(env) -> Subgoal | None:
    """The subgoal a `SubgoalFocus` among ``env``'s wrappers is focused on (None: no focus, or
    no such wrapper)."""
    while isinstance(env, gym.Wrapper):
        if isinstance(env, SubgoalFocus):
            return env.focused
        env = env.env
    return None


def make_env(env_id: str, *, subgoal_focus: bool = False, **kwargs) -> gym.Env:
    """``gymnasium.make(env_id, **kwargs)``, wrapped in ``SubgoalFocus(draw=True)`` when
    ``subgoal_focus`` (the vector envs build their sub-envs with it)."""
    env = gym.make(env_id, **kwargs)
    return SubgoalFocus(env, draw=True) if subgoal_focus else env


__all__ = ["SubgoalFocus", "focus_of", "make_env"]
