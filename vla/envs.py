"""`VecRunner`: the vector env as the VLA collector sees it.

It builds the sim's `BatchedEnv` from the recipe's ``env`` section with autoreset disabled (the
collector decides who resets, and with which indexed initial state), executes action chunks,
and guards the physics:

* a NaN/inf action (or a non-action token decoded to NaN) is replaced by a no-op for that env,
  counted in ``counters["bad_actions"]`` and logged; it never reaches ``env.step``;
* an env worker (``AsyncVectorEnv``) that dies or raises, in a step, a reset (masked or full, the
  first one included) or a park, makes the runner rebuild the vector env and reset it; the
  episodes in flight are lost, counted in ``counters["dropped_episodes"]``, and
  :class:`EnvRestarted` tells the caller to drop or cut them;
* a physics blow-up (the env's ``info["sim_unstable"]``) is reported apart from time limits
  (``StepResult.unstable``): the env truncates and restores the episode's initial state, which is
  no successor of the last observation.

`VecRunner.get_state` / `VecRunner.set_state` snapshot and restore the episodes in flight (the
envs' physics, layouts, controllers, RNGs and time-limit counts, the last observations and
actions), in-process or through the workers, so a resumed collector continues them exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from gymnasium.vector import AutoresetMode

from ..sim.env import MUJOCO_ONLY
from ..sim.vector import Batch, BatchedEnv, EnvWorkerError
from .config import EnvConfig

log = logging.getLogger(__name__)

WORKER_ERRORS = (EnvWorkerError,)
"""what `BatchedEnv` raises when an ``AsyncVectorEnv`` worker died or raised (any exception a
worker raises ends that worker)"""
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
    unstable: np.ndarray | None = None
    """[N] bool: the episode was truncated by a physics blow-up (``truncated`` is set too; the
    env restored its initial state, so ``batch`` holds no successor); None: no blow-ups"""


def idle_action(action_dim: int, control: str) -> np.ndarray:
    """(A,) float32: no motion with the gripper open (ee control); zeros otherwise."""
    a = np.zeros(action_dim, np.float32)
    if control == "ee":
        a[-1] = -1.0
    return a


def env_kwargs(cfg: EnvConfig) -> dict:
    """Keyword arguments of ``gymnasium.make`` for the recipe's env section."""
    kw = dict(
        obs_mode=cfg.obs_mode, control=cfg.control, reward_mode=cfg.reward_mode,
        terminate_on_success=cfg.terminate_on_success,
        width=cfg.image_size, height=cfg.image_size, cameras=tuple(cfg.cameras),
        privileged_state=cfg.privileged_state,
    )  # fmt: skip
    for name in MUJOCO_ONLY:  # only when set: the warp env refuses them
        if getattr(cfg, name):
            kw[name] = True
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
        if self.cfg.backend == "warp":
            from ..sim.mjwarp import WarpEnv

            return WarpEnv(
                self.env_id, self.n, device=self.cfg.device,
                autoreset_mode=AutoresetMode.DISABLED, **env_kwargs(self.cfg),
            )  # fmt: skip
        return BatchedEnv(
            self.env_id, self.n, async_=self.cfg.async_envs,
            autoreset_mode=AutoresetMode.DISABLED, **env_kwargs(self.cfg),
        )  # fmt: skip

    def _noop_default(self) -> np.ndarray:
        return idle_action(self.action_dim, self.cfg.control)

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
        ``seeds`` [N] seed them. The first reset without seeds seeds env i with ``seed + i``;
        a first reset of some envs resets all of them first. Returns the observations of all
        N."""
        seed = seeds
        if seed is None and self.batch is None and self._resets == 0:
            seed = self.seed
        if mask is None or mask.all():
            mask = np.ones(self.n, bool)
        elif not mask.any():
            return self.batch
        elif self.batch is None:  # the others would wait (no-op steps) in envs never reset
            self.reset()
            seed = seeds
        self._resets += 1
        try:
            self.batch, _ = self.env.reset(mask=mask, options=options, seed=seed)
        except WORKER_ERRORS as e:
            self._restart(e)
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
        term, trunc, success, unstable = (np.zeros(N, bool) for _ in range(4))
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
            unstable |= live & np.asarray(info.get("sim_unstable", np.zeros(N, bool)), bool)
            steps += live
            self._park(live & (te | tr))
        self._restart_streak = 0
        self.batch = obs
        return StepResult(obs, reward, term, trunc, success, steps, unstable)

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
        """Rebuild and reset the vector env after a worker died or raised (a rebuilt env whose
        reset fails again is rebuilt again, up to `MAX_RESTARTS` in a row); raises
        `EnvRestarted`."""
        while True:
            self._restart_streak += 1
            self.counters["env_restarts"] += 1
            self.counters["dropped_episodes"] += self.n
            cause = error.__cause__ or error
            log.warning(
                "env worker died or raised (%r); restarting %d envs of %s", cause, self.n,
                self.env_id,
            )  # fmt: skip
            if self._restart_streak > MAX_RESTARTS:
                raise RuntimeError(
                    f"{self.env_id}: the vector env failed {self._restart_streak} times in a row "
                    f"(last error {cause!r}); check the env workers' stderr or set "
                    "env.async_envs=false to see the error in this process"
                ) from error
            try:
                self.env.close()
            except Exception:  # noqa: BLE001 - the old env is broken; closing is best effort
                pass
            self.env = self._make()
            try:
                self.batch, _ = self.env.reset(
                    seed=self.seed + 7919 * self.counters["env_restarts"]
                )
                break
            except WORKER_ERRORS as e:
                error = e
        self.last[:] = self._noop_default()
        raise EnvRestarted(f"{self.env_id}: env worker died or raised ({cause!r}); envs restarted")

    # ------------------------------------------------------------------ snapshots
    def get_state(self) -> dict:
        """The envs' episodes in flight and what this runner remembers of them: numpy arrays
        and plain Python values (see `BatchedEnv.get_state`)."""
        b = self.batch
        return {
            "envs": self.env.get_state(),
            "batch": None if b is None else {
                "images": dict(b.images), "proprio": b.proprio, "objects": b.objects,
                "instructions": list(b.instructions),
            },
            "last": self.last.copy(),
            "resets": self._resets,
            "restart_streak": self._restart_streak,
        }  # fmt: skip

    def snapshot(self, envs) -> list[dict]:
        """Each env of ``envs`` (indices): its episode in flight (a `BatchedEnv.get_state`
        entry), its last observation and last executed action, to `restore` into any env of
        this runner (the branch point of a VLA tree). Numpy arrays and plain values."""
        states, b = self.env.get_state(), self.batch
        return [
            {"env": states[i], "last": self.last[i].copy(), "obs": {
                "images": {k: _copy(v[i]) for k, v in b.images.items()},
                "proprio": b.proprio[i].copy(),
                "objects": None if b.objects is None else b.objects[i].copy(),
                "instruction": b.instructions[i]}}
            for i in envs
        ]  # fmt: skip

    def restore(self, mask: np.ndarray, snaps: list[dict]) -> Batch:
        """The envs of ``mask`` [N] continue ``snaps`` (`snapshot` entries, one per True entry
        in order); the other envs are untouched. Returns the observations of all N. Raises
        `EnvRestarted` when a worker died meanwhile (every env is then fresh)."""
        idx = np.flatnonzero(mask)
        if len(idx) != len(snaps):
            raise ValueError(
                f"VecRunner.restore: {len(idx)} envs in the mask, {len(snaps)} snapshots"
            )
        if self.batch is None:  # envs never reset cannot take a snapshot's physics
            self.reset()
        states: list[dict | None] = [None] * self.n
        for j, snap in zip(idx.tolist(), snaps):
            states[j] = snap["env"]
        try:
            self.env.set_state(states)
        except WORKER_ERRORS as e:
            self._restart(e)
        b = self.batch
        images = {k: _copy(v) for k, v in b.images.items()}
        proprio = b.proprio.copy()
        objects = None if b.objects is None else b.objects.copy()
        instructions = list(b.instructions)
        for j, snap in zip(idx.tolist(), snaps):
            obs = snap["obs"]
            for k in images:
                images[k][j] = obs["images"][k]
            proprio[j] = obs["proprio"]
            if objects is not None:
                objects[j] = obs["objects"]
            instructions[j] = obs["instruction"]
            self.last[j] = snap["last"]
        self.batch = Batch(images, proprio, objects, instructions)
        return self.batch

    def set_state(self, state: dict) -> None:
        """Continue the episodes of `get_state` in this runner's envs (built with the same
        recipe): a full reset, then each env's snapshot. Raises RuntimeError when a worker fails
        meanwhile (the envs are then fresh: resume again to continue exactly)."""
        try:
            self.env.reset()
            self.env.set_state(state["envs"])
        except WORKER_ERRORS as e:
            try:
                self._restart(e)
            except EnvRestarted:
                pass
            raise RuntimeError(
                f"{self.env_id}: an env worker failed while the episodes in flight were "
                f"restored ({e.__cause__!r}); resume again to continue them exactly"
            ) from e
        b = state["batch"]
        if b is not None:
            device = getattr(self.env, "torch_device", None)  # the warp backend's images
            self.batch = Batch(
                {k: np.asarray(v) if device is None else torch.as_tensor(v, device=device)
                 for k, v in b["images"].items()}, _array(b["proprio"]),
                _array(b["objects"]), [str(s) for s in b["instructions"]],
            )  # fmt: skip
        self.last[:] = np.asarray(state["last"], np.float32)
        self._resets = int(state["resets"])
        self._restart_streak = int(state["restart_streak"])

    def close(self) -> None:
        self.env.close()


def _copy(x):
    """A copy of a numpy array or a torch tensor (the warp backend's images)."""
    return x.clone() if isinstance(x, torch.Tensor) else x.copy()


def _array(x) -> np.ndarray | None:
    return None if x is None else np.asarray(x)


def _merge(old: Batch, new: Batch, live: np.ndarray) -> Batch:
    """Observations of ``new`` where ``live`` [N], else ``old`` (envs that already ended keep
    their final observation)."""
    if live.all():
        return new

    def pick(a, b):
        if a is None:
            return None
        sel = live.reshape(-1, *([1] * (a.ndim - 1)))
        if isinstance(b, torch.Tensor):  # images of the warp backend, on its device
            a = torch.as_tensor(a, device=b.device)
            return torch.where(torch.as_tensor(sel, device=b.device), b, a)
        return np.where(sel, b, a)

    return Batch(
        {k: pick(old.images[k], v) for k, v in new.images.items()},
        pick(old.proprio, new.proprio),
        pick(old.objects, new.objects),
        [n if lv else o for o, n, lv in zip(old.instructions, new.instructions, live)],
    )
