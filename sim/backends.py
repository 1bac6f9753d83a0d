"""The backends of the vector envs: N envs of one task with autoreset disabled, stepped as a batch.

`sim.vector.VecEnv` (the one vector-env layer) drives a backend through this surface:

* ``reset(mask [N] bool, options [N] dict | None, seeds [N] int | None) -> (Batch, infos)``:
  reset the envs of ``mask``, each with its own reset options and seed; returns the
  observations of all N;
* ``step(actions [N, A]) -> (Batch, rewards [N], terminated [N], truncated [N], infos)``;
* ``get_state() -> [N] {"env": snapshot | None, "elapsed_steps": int | None}``, ``set_state``
  of such a list (None entries leave their env as it is);
* ``single_observation_space``, ``single_action_space``, ``time_limit``, ``envs`` (the
  in-process envs, for scripted experts), ``async_`` and, for an async backend,
  ``failed_workers()``; ``close(force)``.

Two backends: `GymBackend` (CPU MuJoCo: a gymnasium ``SyncVectorEnv`` or ``AsyncVectorEnv`` of
`sim.focus.make_env` envs, one ``MjData`` each) and `sim.mjwarp.WarpEnv` (N worlds of one
batched MJWarp model); `sim.vector.make_backend` builds either. The checks (masks, shapes),
the seeding rule and the fault handling are the layer's, not the backends'.

``make_vec`` builds the gymnasium vector env itself, for code that wants gymnasium's API. A
gymnasium vector env hands every sub-env the same reset options and call arguments, so each
sub-env sits in a `VectorSlot` that knows its index and takes its own entry of per-env values
(reset option ``per_env``; `VectorSlot.restore`); the env itself never hears of the vector.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from .focus import make_env

PER_ENV = "per_env"
"""reset option of a `make_vec` vector env: a list with one options dict (or None) per
sub-env, which its `VectorSlot` merges into the options its env gets"""
MUJOCO_ONLY = ("entity_features", "subgoal_focus")
"""options of `make_env` that the batched warp env (`sim.mjwarp.WarpEnv`) does not have"""


@dataclass
class Batch:
    """Observations of N envs as arrays."""

    images: dict[str, np.ndarray] = field(default_factory=dict)
    """camera name -> [N, H, W, 3] uint8 (empty in state mode; torch tensors on the warp
    backend's device)"""
    proprio: np.ndarray | None = None
    """[N, 8] float32: tcp position, tcp quaternion, gripper width"""
    objects: np.ndarray | None = None
    """[N, n_entities * 7] float32 entity poses (state mode only)"""
    instructions: list[str] = field(default_factory=list)
    """N instructions"""


def split_obs(obs: dict) -> Batch:
    """Turn a vector env's Dict observation into a ``Batch``."""
    images = {
        k: np.asarray(v) for k, v in obs.items() if k not in ("proprio", "objects", "instruction")
    }
    objects = np.asarray(obs["objects"]) if "objects" in obs else None
    return Batch(images, np.asarray(obs["proprio"]), objects, [str(s) for s in obs["instruction"]])


# ---------------------------------------------------------------------------------------------
# gymnasium vector envs
# ---------------------------------------------------------------------------------------------


class VectorSlot(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Sub-env ``index`` of a `make_vec` vector env: takes its own entry of the per-env values
    the vector env broadcasts (see the module docstring).

    Args:
        env: the sub-env (any wrappers).
        index: its position in the vector env.
    """

    def __init__(self, env: gym.Env, index: int):
        gym.utils.RecordConstructorArgs.__init__(self, index=index)
        gym.Wrapper.__init__(self, env)
        self.index = index

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Reset with ``options`` whose `PER_ENV` list is replaced by this env's entry."""
        if options and PER_ENV in options:
            options = dict(options)
            own = options.pop(PER_ENV)
            if len(own) <= self.index:
                raise ValueError(
                    f"reset option {PER_ENV} has {len(own)} entries; sub-env {self.index} needs "
                    "one entry per env of the vector env"
                )
            options.update(own[self.index] or {})
        return self.env.reset(seed=seed, options=options or None)

    def snapshot(self) -> dict:
        """``{"env": the env's get_state(), "elapsed_steps": the time-limit count or None}``."""
        has_limit = self.env.has_wrapper_attr("_elapsed_steps")
        return {
            "env": self.env.get_wrapper_attr("get_state")(),
            "elapsed_steps": self.env.get_wrapper_attr("_elapsed_steps") if has_limit else None,
        }

    def restore(self, states: list[dict | None]) -> None:
        """Continue this env's entry of ``states`` (`snapshot` records, one per sub-env; None
        leaves the env as it is), its time-limit count included."""
        state = states[self.index]
        if state is None:
            return
        self.env.get_wrapper_attr("set_state")(state["env"])
        if self.env.has_wrapper_attr("_elapsed_steps"):
            self.env.set_wrapper_attr("_elapsed_steps", int(state["elapsed_steps"] or 0))


def _make_slot(env_id: str, index: int, kwargs: dict) -> gym.Env:
    return VectorSlot(make_env(env_id, **kwargs), index)


def make_vec(
    env_id: str,
    n: int,
    async_: bool = False,
    context: str | None = "forkserver",
    autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
    **kwargs,
) -> gym.vector.VectorEnv:
    """``n`` copies of ``env_id``, each in a `VectorSlot` (keyword arguments go to every
    `make_env`: `ManipEnv` options, ``max_episode_steps``, ``subgoal_focus``).

    Args:
        env_id: a registered id, e.g. ``"perceptrl/Pick-v0"``.
        n: number of envs.
        async_: one subprocess per env (``AsyncVectorEnv``, shared memory) instead of a loop.
        context: multiprocessing start method for ``async_``. The default "forkserver" is safe
            even when this process has already rendered: a plain "fork" after an EGL context
            exists in the parent hangs the workers (measured with Mesa llvmpipe).
        autoreset_mode: gymnasium autoreset mode (NEXT_STEP, SAME_STEP or DISABLED).
    """
    if n < 1:
        raise ValueError(f"make_vec needs n >= 1 envs, got {n}")
    fns = [functools.partial(_make_slot, env_id, i, kwargs) for i in range(n)]
    if async_:
        return AsyncVectorEnv(
            fns, shared_memory=True, context=context, autoreset_mode=autoreset_mode
        )
    return SyncVectorEnv(fns, autoreset_mode=autoreset_mode)


class GymBackend:
    """CPU MuJoCo: ``n`` `make_env` envs in a gymnasium vector env with autoreset disabled, in
    this process or one worker process each (``async_``); see the module docstring."""

    def __init__(self, env_id: str, n: int, async_: bool = False, **kwargs):
        self.env = make_vec(env_id, n, async_=async_, autoreset_mode=AutoresetMode.DISABLED,
                            **kwargs)  # fmt: skip
        self.n, self.env_id, self.async_ = n, env_id, async_
        self.single_action_space = self.env.single_action_space
        self.single_observation_space = self.env.single_observation_space
        self.time_limit = kwargs.get("max_episode_steps") or gym.spec(env_id).max_episode_steps
        """steps of the time-limit wrapper of each env (None: no wrapper)"""

    @property
    def envs(self) -> list[gym.Env]:
        """The N envs (in-process only: their state, e.g. for scripted experts)."""
        if self.async_:
            raise RuntimeError(
                f"the {self.n} envs of {self.env_id!r} run in worker processes; their objects "
                "are not in this process. Build them with async_=False (env.async_envs=false) "
                "to read the envs' state"
            )
        return list(self.env.envs)

    @property
    def processes(self) -> list:
        """Worker processes ([] in process)."""
        return list(getattr(self.env, "processes", []))

    def failed_workers(self) -> list[int]:
        """Workers that died or raised (gymnasium closes the pipe of a worker that raised)."""
        pipes = getattr(self.env, "parent_pipes", [])
        return [i for i, (p, q) in enumerate(zip(pipes, self.processes))
                if p is None or not q.is_alive()]  # fmt: skip

    def reset(self, mask: np.ndarray, options: list, seeds: list) -> tuple[Batch, dict]:
        opts = {} if mask.all() else {"reset_mask": mask}
        if any(o is not None for o in options):
            opts[PER_ENV] = options
        obs, infos = self.env.reset(seed=seeds, options=opts or None)
        return split_obs(obs), infos

    def step(self, actions: np.ndarray):
        obs, rew, term, trunc, infos = self.env.step(actions)
        return split_obs(obs), rew, term, trunc, infos

    def get_state(self) -> list[dict]:
        return list(self.env.call("snapshot"))

    def set_state(self, states: list[dict | None]) -> None:
        self.env.call("restore", list(states))

    def close(self, force: bool = False) -> None:
        """Close the envs; ``force`` (workers died or failed) tears an async one down."""
        if not self.async_:
            self.env.close()
            return
        try:
            self.env.close(terminate=force or bool(self.failed_workers()))
        except Exception:  # noqa: BLE001 - a broken pipe mid-close: end the workers ourselves
            for proc in self.processes:
                if proc.is_alive():
                    proc.terminate()
                proc.join(timeout=10)
            for pipe in self.env.parent_pipes:
                if pipe is not None:
                    pipe.close()
            self.env.closed = True


__all__ = ["Batch", "GymBackend", "VectorSlot", "make_vec", "split_obs"]
