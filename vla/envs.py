"""`VecRunner`: the vector env as the VLA collector sees it.

It builds the sim's `BatchedEnv` from the recipe's ``env`` section with autoreset disabled (the
collector decides who resets, and with which indexed initial state), executes action chunks,
and guards the physics:

* a NaN/inf action (or a non-action token decoded to NaN) is replaced by a no-op for that env,
  counted in ``counters["bad_actions"]`` and logged; it never reaches ``env.step``;
* an env worker that dies (``AsyncVectorEnv``) makes the runner rebuild the vector env and
  reset it; the episodes in flight are lost, counted in ``counters["dropped_episodes"]``, and
  :class:`EnvRestarted` tells the collector to drop or cut them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from gymnasium.vector import AutoresetMode

from ..sim.vector import Batch, BatchedEnv
from .config import EnvConfig

log = logging.getLogger(__name__)

WORKER_ERRORS = (EOFError, BrokenPipeError, ConnectionError, OSError)
"""what a dead ``AsyncVectorEnv`` worker raises in the parent"""
MAX_RESTARTS = 3
"""consecutive restarts without a successful step before the runner gives up"""


class EnvRestarted(RuntimeError):
    """The vector env was rebuilt after a worker died; every episode in flight was dropped."""


@dataclass
class StepResult:
    """What one policy step (a chunk of K env steps) did, per env."""

    batch: Batch
    """observations after the chunk (the final observation for envs that ended)"""
    reward: np.ndarray
    """[N] float32: sum of the env rewards over the executed part of the chunk"""
    terminated: np.ndarray
    """[N] bool: the episode ended in a terminal state (success)"""
    truncated: np.ndarray
    """[N] bool: the episode hit the time limit (or a physics blow-up)"""
    success: np.ndarray
    """[N] bool: the task succeeded during the chunk"""
    env_steps: np.ndarray
    """[N] int: env steps executed (< K when the episode ended mid-chunk)"""


def env_kwargs(cfg: EnvConfig) -> dict:
    """Keyword arguments of ``gymnasium.make`` for the recipe's env section."""
    kw = dict(
        obs_mode=cfg.obs_mode, control=cfg.control, reward_mode=cfg.reward_mode,
        terminate_on_success=cfg.terminate_on_success,
        width=cfg.image_size, height=cfg.image_size, cameras=tuple(cfg.cameras),
        privileged_state=cfg.privileged_state,
    )  # fmt: skip
    if cfg.max_episode_steps > 0:
        kw["max_episode_steps"] = cfg.max_episode_steps
    return kw


class VecRunner:
    """``cfg.num_envs`` envs of ``cfg.id``; see the module docstring."""

    def __init__(self, cfg: EnvConfig, seed: int = 0, env_id: str | None = None):
        import perceptrl.sim  # noqa: F401  (registers the perceptrl/* ids)

        self.cfg, self.seed = cfg, seed
        self.env_id = env_id or cfg.id
        self.n = cfg.num_envs
        self.counters = {"bad_actions": 0, "dropped_episodes": 0, "env_restarts": 0}
        self.env = self._make()
        space = self.env.single_action_space
        self.action_dim = int(space.shape[0])
        self.observation_space = self.env.single_observation_space
        self.action_space = space
        self.last = np.tile(self._noop_default(), (self.n, 1))  # (N, A) last executed actions
        self.batch: Batch | None = None
        self._resets = 0
        self._restart_streak = 0

    def _make(self) -> BatchedEnv:
        return BatchedEnv(
            self.env_id, self.n, async_=self.cfg.async_envs,
            autoreset_mode=AutoresetMode.DISABLED, **env_kwargs(self.cfg),
        )  # fmt: skip

    def _noop_default(self) -> np.ndarray:
        """No motion with the gripper open (ee control); zeros otherwise."""
        a = np.zeros(self.action_dim, np.float32)
        if self.cfg.control == "ee":
            a[-1] = -1.0
        return a

    def noop(self) -> np.ndarray:
        """[N, A] actions that change nothing: zero motion, gripper as last commanded (ee);
        the last executed target (joint control)."""
        if self.cfg.control != "ee":
            return self.last.copy()
        a = np.zeros_like(self.last)
        a[:, -1] = self.last[:, -1]
        return a

    @property
    def envs(self) -> list:
        """The sub-envs (synchronous envs only; see `BatchedEnv.envs`)."""
        return self.env.envs

    # ------------------------------------------------------------------ reset
    def reset(
        self, mask: np.ndarray | None = None, options: dict | None = None,
        seeds: list[int | None] | None = None,
    ) -> Batch:  # fmt: skip
        """Reset every env (``mask`` None) or those where ``mask`` [N] is True. ``options``
        (e.g. ``task_id``/``trial_id`` lists with one entry per env) go to each reset env;
        ``seeds`` [N] seed them. The first reset without seeds seeds env i with ``seed + i``.
        Returns the observations of all N."""
        seed = seeds
        if seed is None and self.batch is None and self._resets == 0:
            seed = self.seed
        if mask is None or mask.all():
            mask = np.ones(self.n, bool)
        elif not mask.any():
            return self.batch
        try:
            self.batch, _ = self.env.reset(mask=mask, options=options, seed=seed)
        except WORKER_ERRORS as e:
            self._restart(e)
        self._resets += 1
        self.last[mask] = self._noop_default()
        return self.batch

    # ------------------------------------------------------------------ step
    def sanitize(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """actions [N, K, A] -> (finite actions clipped to [-1, 1], bad [N] bool): an env whose
        chunk holds a NaN/inf gets no-ops for the whole chunk."""
        actions = np.asarray(actions, np.float32)
        if actions.ndim != 3 or actions.shape[0] != self.n or actions.shape[2] != self.action_dim:
            raise ValueError(
                f"VecRunner.step expects actions [N={self.n}, K, A={self.action_dim}]; got "
                f"{actions.shape}"
            )
        bad = ~np.isfinite(actions).all(axis=(1, 2))  # (N,)
        if bad.any():
            self.counters["bad_actions"] += int(bad.sum())
            log.warning(
                "VLA policy emitted %d non-finite action chunk(s) (envs %s); replaced by no-ops "
                "(total so far %d)", int(bad.sum()), np.flatnonzero(bad).tolist(),
                self.counters["bad_actions"],
            )  # fmt: skip
            actions = actions.copy()
            actions[bad] = self.noop()[bad][:, None, :]
        return np.clip(actions, -1.0, 1.0), bad

    def step(self, actions: np.ndarray) -> StepResult:
        """Execute a chunk ``actions`` [N, K, A] (raw policy outputs; sanitised here). An env
        whose episode ends mid-chunk is parked (reset, results ignored) for the rest of it; the
        collector resets it into its next episode before its next policy step."""
        actions, _ = self.sanitize(actions)
        N, K, _ = actions.shape
        reward = np.zeros(N, np.float32)
        term, trunc, success = (np.zeros(N, bool) for _ in range(3))
        steps = np.zeros(N, int)
        obs = self.batch
        for k in range(K):
            live = ~(term | trunc)
            if not live.any():
                break
            a = np.where(live[:, None], actions[:, k], self.noop())
            try:
                nxt, r, te, tr, info = self.env.step(a)
            except WORKER_ERRORS as e:
                self._restart(e)
            self.last[live] = a[live]
            obs = _merge(obs, nxt, live)
            reward += np.where(live, r, 0.0).astype(np.float32)
            success |= live & np.asarray(info.get("success", np.zeros(N, bool)), bool)
            term |= live & te
            trunc |= live & tr & ~te
            steps += live
            self._park(live & (te | tr))
        self._restart_streak = 0
        self.batch = obs
        return StepResult(obs, reward, term, trunc, success, steps)

    def _park(self, ended: np.ndarray) -> None:
        """Reset envs whose episode just ended so the vector env (autoreset disabled) may be
        stepped again; their final observation stays in the batch until the collector resets
        them into their next episode."""
        if ended.any():
            try:
                self.env.reset(mask=ended)
            except WORKER_ERRORS as e:
                self._restart(e)

    def _restart(self, error: BaseException) -> None:
        """Rebuild and reset the vector env after a worker died; raises `EnvRestarted`."""
        self._restart_streak += 1
        self.counters["env_restarts"] += 1
        self.counters["dropped_episodes"] += self.n
        log.warning("env worker died (%r); restarting %d envs of %s", error, self.n, self.env_id)
        if self._restart_streak > MAX_RESTARTS:
            raise RuntimeError(
                f"{self.env_id}: the vector env died {self._restart_streak} times in a row "
                f"(last error {error!r}); check the env workers' stderr or set env.async_envs=false"
            ) from error
        try:
            self.env.close()
        except Exception:  # noqa: BLE001 - the old env is broken; closing is best effort
            pass
        self.env = self._make()
        self.batch, _ = self.env.reset(seed=self.seed + 7919 * self.counters["env_restarts"])
        self.last[:] = self._noop_default()
        raise EnvRestarted(f"{self.env_id}: env worker died ({error!r}); envs restarted")

    def close(self) -> None:
        self.env.close()


def _merge(old: Batch, new: Batch, live: np.ndarray) -> Batch:
    """Observations of ``new`` where ``live`` [N], else ``old`` (envs that already ended keep
    their final observation)."""
    if live.all():
        return new

    def pick(a, b):
        if a is None:
            return None
        sel = live.reshape(-1, *([1] * (np.ndim(a) - 1)))
        return np.where(sel, b, a)

    return Batch(
        {k: pick(old.images[k], v) for k, v in new.images.items()},
        pick(old.proprio, new.proprio),
        pick(old.objects, new.objects),
        [n if lv else o for o, n, lv in zip(old.instructions, new.instructions, live)],
    )
