"""Vector envs and batched stepping for the VLA collector.

``make_vec(env_id, n, async_=...)`` builds a gymnasium ``SyncVectorEnv`` or ``AsyncVectorEnv``
(shared memory, forkserver workers; each worker creates its EGL renderer lazily). Sub-env ``i`` gets
``vector_index=i`` so reset options may carry one ``task_id``/``trial_id`` per env.
``BatchedEnv`` wraps one and hands out ``Batch`` records of [N, ...] numpy arrays plus the list of
instructions, which a policy can move to its device in one go.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv


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
        self.single_action_space = self.env.single_action_space
        self.single_observation_space = self.env.single_observation_space

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
        obs, rew, term, trunc, infos = self.env.step(actions)
        return (
            split_obs(obs),
            np.asarray(rew, np.float32),
            np.asarray(term, bool),
            np.asarray(trunc, bool),
            infos,
        )

    def close(self) -> None:
        self.env.close()
