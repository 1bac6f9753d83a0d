"""Vector envs and batched stepping for the VLA collector.

``make_vec(env_id, n, async_=...)`` builds a gymnasium ``SyncVectorEnv`` or ``AsyncVectorEnv``
(shared memory, forkserver workers; each worker creates its EGL renderer lazily). Sub-env ``i`` gets
``vector_index=i`` so reset options may carry one ``task_id``/``trial_id`` per env.
``BatchedEnv`` wraps one and hands out ``Batch`` records of [N, ...] numpy arrays plus the list of
instructions, which a policy can move to its device in one go. A worker of an async one that dies
or raises (in ``reset``, ``step`` or a state call) leaves the vector env unusable; ``BatchedEnv``
then raises `EnvWorkerError` whatever the worker's error was, so callers rebuild it in one place.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv


class EnvWorkerError(RuntimeError):
    """A worker process of an async vector env died or raised; the vector env must be rebuilt.
    The worker's own error is the ``__cause__``."""


def _make_one(env_id: str, index: int, kwargs: dict) -> gym.Env:
    return gym.make(env_id, vector_index=index, **kwargs)


def make_vec(
    env_id: str,
    n: int,
    async_: bool = False,
    context: str | None = "forkserver",
    autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
    **kwargs,
) -> gym.vector.VectorEnv:
    """``n`` copies of ``env_id`` (keyword arguments go to every ``gymnasium.make``).

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
    fns = [functools.partial(_make_one, env_id, i, kwargs) for i in range(n)]
    if async_:
        return AsyncVectorEnv(
            fns, shared_memory=True, context=context, autoreset_mode=autoreset_mode
        )
    return SyncVectorEnv(fns, autoreset_mode=autoreset_mode)


@dataclass
class Batch:
    """Observations of N envs as arrays."""

    images: dict[str, np.ndarray] = field(default_factory=dict)
    """camera name -> [N, H, W, 3] uint8 (empty in state mode)"""
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


class BatchedEnv:
    """A vector env that speaks in ``Batch`` records and [N] arrays.

    ``step`` returns ``(batch, rewards [N] float32, terminated [N] bool, truncated [N] bool,
    infos)``; ``infos`` is the vector env's dict (``success``, ``reward/<term>``, ...).
    ``reset(mask=...)`` resets only some envs (the collector decides who starts a new episode);
    ``envs`` are the sub-envs of an in-process vector env, ``processes`` the workers of an
    async one. Callers use these, never the gymnasium vector env underneath.
    """

    def __init__(self, env_id: str, n: int, async_: bool = False, **kwargs):
        self.env = make_vec(env_id, n, async_=async_, **kwargs)
        self.n = n
        self.env_id = env_id
        self.async_ = isinstance(self.env, AsyncVectorEnv)
        self.single_action_space = self.env.single_action_space
        self.single_observation_space = self.env.single_observation_space
        self.time_limit = kwargs.get("max_episode_steps") or gym.spec(env_id).max_episode_steps
        """steps of the time-limit wrapper of each sub-env (None: no wrapper)"""

    @contextlib.contextmanager
    def _workers(self):
        """Turn a dead or raising worker of an async vector env into `EnvWorkerError`. A worker
        that raised sends its exception to the parent, which gymnasium re-raises there after
        closing that worker's pipe; a dead one shows as a broken pipe or an EOF."""
        try:
            yield
        except Exception as e:
            if not self.async_:
                raise
            pipes = getattr(self.env, "parent_pipes", [])
            failed = [i for i, (p, q) in enumerate(zip(pipes, self.processes))
                      if p is None or not q.is_alive()]  # fmt: skip
            if failed or isinstance(e, (EOFError, OSError)):
                raise EnvWorkerError(
                    f"{self.env_id}: env worker(s) {failed or '?'} of {self.n} died or raised "
                    f"({type(e).__name__}: {e})"
                ) from e
            raise

    @property
    def envs(self) -> list[gym.Env]:
        """The N sub-envs (in-process vector envs only: their state, e.g. for scripted experts)."""
        if isinstance(self.env, AsyncVectorEnv):
            raise RuntimeError(
                f"BatchedEnv({self.env_id!r}) runs its {self.n} envs in worker processes; their "
                "objects are not in this process. Build it with async_=False (env.async_envs="
                "false) to read the envs' state"
            )
        return list(self.env.envs)

    @property
    def processes(self) -> list:
        """Worker processes of an async vector env ([] for an in-process one)."""
        return list(getattr(self.env, "processes", []))

    def reset(
        self, mask: np.ndarray | None = None, options: dict | None = None,
        seed: int | list[int | None] | None = None,
    ) -> tuple[Batch, dict]:  # fmt: skip
        """Reset all envs (``mask`` None) or those where ``mask`` [N] bool is True; the others
        keep their state and observations. ``seed``: an int seeds sub-env ``i`` with
        ``seed + i``, a list [N] seeds each; ``options`` go to every reset sub-env (per-env
        lists such as ``task_id`` are indexed by its ``vector_index``). Returns the
        observations of all N and the infos."""
        opts = dict(options or {})
        if mask is not None:
            mask = np.asarray(mask, bool)
            if mask.shape != (self.n,) or not mask.any():
                raise ValueError(
                    f"BatchedEnv.reset mask must be [N={self.n}] bool with at least one True "
                    f"(got shape {mask.shape}, {int(mask.sum())} True); pass mask=None to reset all"
                )
            if not mask.all():
                opts["reset_mask"] = mask
        with self._workers():
            obs, infos = self.env.reset(seed=seed, options=opts or None)
        return split_obs(obs), infos

    def step(self, actions: np.ndarray):
        """actions [N, A] -> (Batch, rewards [N], terminated [N], truncated [N], infos)."""
        actions = np.asarray(actions, np.float32)
        if actions.shape != (self.n, *self.single_action_space.shape):
            raise ValueError(
                f"BatchedEnv.step got actions of shape {actions.shape}; expected "
                f"{(self.n, *self.single_action_space.shape)}"
            )
        with self._workers():
            obs, rew, term, trunc, infos = self.env.step(actions)
        return (
            split_obs(obs),
            np.asarray(rew, np.float32),
            np.asarray(term, bool),
            np.asarray(trunc, bool),
            infos,
        )

    def get_state(self) -> list[dict]:
        """Per sub-env snapshot of its episode in flight: ``env`` (``ManipEnv.get_state``, None
        before its first reset) and ``elapsed_steps`` (the time-limit wrapper's count). Numpy
        arrays and plain Python values; in and out of worker processes by ``call``/``get_attr``."""
        with self._workers():
            envs = self.env.call("get_state")
            elapsed = self.env.get_attr("_elapsed_steps") if self.time_limit else [None] * self.n
        return [{"env": e, "elapsed_steps": t} for e, t in zip(envs, elapsed)]

    def set_state(self, states: list[dict | None]) -> None:
        """Continue the episodes of `get_state`'s ``states`` [N] (every sub-env reset once
        before; see ``ManipEnv.set_state``); a None entry leaves its env as it is (a branch of
        a VLA tree restores some envs only). The observations are not returned: they are the
        ones the snapshot's owner last saw."""
        if len(states) != self.n:
            raise ValueError(f"BatchedEnv.set_state got {len(states)} states for {self.n} envs")
        with self._workers():
            now = self.env.get_attr("_elapsed_steps") if self.time_limit else None
            self.env.call("set_state", [None if s is None else s["env"] for s in states])
            if self.time_limit:
                self.env.set_attr(
                    "_elapsed_steps",
                    [t if s is None else int(s["elapsed_steps"] or 0) for t, s in zip(now, states)],
                )

    def _broken(self) -> bool:
        """An async vector env with a worker that died or failed (its pipe was closed)."""
        pipes = getattr(self.env, "parent_pipes", [])
        return any(p is None for p in pipes) or any(not p.is_alive() for p in self.processes)

    def close(self) -> None:
        """Close the envs; an async one whose workers died or failed is torn down by force."""
        if not self.async_:
            self.env.close()
            return
        try:
            self.env.close(terminate=self._broken())
        except Exception:  # noqa: BLE001 - a broken pipe mid-close: end the workers ourselves
            for proc in self.processes:
                if proc.is_alive():
                    proc.terminate()
                proc.join(timeout=10)
            for pipe in self.env.parent_pipes:
                if pipe is not None:
                    pipe.close()
            self.env.closed = True
