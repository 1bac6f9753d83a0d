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
    """

    def __init__(self, env_id: str, n: int, async_: bool = False, **kwargs):
        self.env = make_vec(env_id, n, async_=async_, **kwargs)
        self.n = n
        self.single_action_space = self.env.single_action_space

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[Batch, dict]:
        """Reset all envs (sub-env ``i`` gets seed ``seed + i``)."""
        obs, infos = self.env.reset(seed=seed, options=options)
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
