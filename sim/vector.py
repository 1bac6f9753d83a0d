"""`VecEnv`: N envs of one task as the VLA episode runner sees them (the one vector-env layer).

It drives a backend (`sim.backends`: CPU MuJoCo in a gymnasium vector env, in process or one
worker process per env, or the batched MJWarp worlds of `sim.mjwarp.WarpEnv`) with autoreset
disabled, and owns everything the backends share:

* **masked resets**: ``reset(mask, options, seeds)`` resets the envs of ``mask`` [N] (all when
  None), each with its own reset options (a list of N dicts, e.g. ``task_id``/``trial_id`` of an
  indexed initial state) and seed; the first reset without seeds seeds env i with
  ``seed + i``, and a first reset of some envs resets all of them first (the others would wait
  in envs never reset). The others keep their state and observation (`VecEnv.batch`);
* **action chunks**: ``step(actions [N, K, A]) -> StepResult`` executes K actions open-loop; an
  env whose episode ends mid-chunk is parked (reset, results ignored) for the rest of it;
  ``noop()`` [N, A] are actions that change nothing;
* **faults**: a NaN/inf action is replaced by a no-op for that env, counted in
  ``counters["bad_actions"]`` and logged, and never reaches the backend; a worker of an async
  backend that dies or raises, in a step, a reset (masked or full, the first one included), a
  park or a restore, makes the layer rebuild the backend and reset it (seed ``seed + 7919 *
  restarts``): the episodes in flight are lost, counted in ``counters["dropped_episodes"]``, and
  `EnvRestarted` tells the caller to drop or cut them (`MAX_RESTARTS` failures in a row end
  the run); a physics blow-up (the env's ``info["sim_unstable"]``) is reported apart from time
  limits (``StepResult.unstable``): the env truncated and restored the episode's initial
  state, which is no successor of the last observation;
* **snapshots**: ``get_state``/``set_state`` save and continue the episodes in flight (the
  envs' physics, layouts, controllers, RNGs and time-limit counts, the last observations and
  actions) in process or through the workers; ``snapshot(envs)``/``restore(mask, snaps)`` move
  single episodes between envs (the branch points of a VLA tree).

Nothing here knows a recipe: `vla.envs.make_envs` builds a `VecEnv` from the ``env`` section.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import numpy as np

from .backends import Batch, GymBackend
from .env import ManipEnvConfig

log = logging.getLogger(__name__)

MAX_RESTARTS = 3
"""consecutive restarts without a successful step before the layer gives up"""
RESTART_SEED = 7919
"""the k-th restart resets the rebuilt backend with seed ``seed + RESTART_SEED * k``"""


class EnvRestarted(RuntimeError):
    """The envs were rebuilt after a worker died or raised; every episode in flight was dropped."""


class EnvWorkerError(RuntimeError):
    """A worker process of an async backend died or raised; the backend must be rebuilt. The
    worker's own error is the ``__cause__``."""


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


def make_backend(env_id: str, n: int, backend: str = "mujoco", async_: bool = False,
                 device: str = "auto", **kwargs):  # fmt: skip
    """The backend ``backend`` ("mujoco" | "warp") of ``n`` envs of ``env_id`` (keyword
    arguments: `make_env`'s; ``device``: the warp backend's)."""
    if backend == "warp":
        from .mjwarp import WarpEnv

        return WarpEnv(env_id, n, device=device, **kwargs)
    if backend != "mujoco":
        raise ValueError(f"unknown sim backend {backend!r}; valid: mujoco, warp")
    return GymBackend(env_id, n, async_=async_, **kwargs)


class VecEnv:
    """``n`` envs of ``env_id``; see the module docstring.

    Args:
        env_id: a registered id (``perceptrl/<Task>-v0``).
        n: number of envs.
        seed: the first reset seeds env i with ``seed + i``; restarts derive theirs from it.
        backend: "mujoco" (CPU MuJoCo) | "warp" (MJWarp worlds on ``device``).
        async_: mujoco backend: one worker process per env.
        device: warp backend: the simulation's device (auto | cpu | cuda | cuda:N).
        **kwargs: options of every env (`sim.focus.make_env`: `ManipEnv`'s,
            ``max_episode_steps``, ``subgoal_focus``).
    """

    def __init__(self, env_id: str, n: int, *, seed: int = 0, backend: str = "mujoco",
                 async_: bool = False, device: str = "auto", **kwargs):  # fmt: skip
        self.env_id, self.n, self.seed = env_id, n, seed
        self._spec = dict(backend=backend, async_=async_, device=device, **kwargs)
        self.control = kwargs.get("control", ManipEnvConfig.control)
        self.counters = {"bad_actions": 0, "dropped_episodes": 0, "env_restarts": 0}
        self.env = self._make()
        """the backend (`sim.backends`); rebuilt after a worker failure"""
        self.action_space = self.env.single_action_space
        self.observation_space = self.env.single_observation_space
        self.action_dim = int(self.action_space.shape[0])
        self.time_limit: int | None = self.env.time_limit
        """env steps per episode (None: no limit)"""
        self.last = np.tile(self._idle(), (n, 1))  # (N, A) last executed actions
        self.batch: Batch | None = None
        """the observations of all N envs now (None before the first reset)"""
        self._resets = 0
        self._restart_streak = 0

    def _make(self):
        return make_backend(self.env_id, self.n, **self._spec)

    @property
    def async_(self) -> bool:
        """The envs run in worker processes."""
        return bool(self.env.async_)

    @property
    def envs(self) -> list:
        """The N envs in this process (their privileged state, e.g. for scripted experts)."""
        return self.env.envs

    def _idle(self) -> np.ndarray:
        return idle_action(self.action_dim, self.control)

    def noop(self) -> np.ndarray:
        """[N, A] actions that change nothing: zero motion, gripper as last commanded (ee);
        the last executed target (joint control)."""
        if self.control != "ee":
            return self.last.copy()
        a = np.zeros_like(self.last)
        a[:, -1] = self.last[:, -1]
        return a

    # ------------------------------------------------------------------ reset
    def reset(
        self, mask: np.ndarray | None = None, options: dict | list | None = None,
        seeds: int | list[int | None] | None = None,
    ) -> Batch:  # fmt: skip
        """Reset every env (``mask`` None) or those where ``mask`` [N] is True; see the module
        docstring. ``options``: one dict per env (a list [N]; entries of envs not reset are
        ignored) or one for all; ``seeds``: a list [N] or an int (env i gets ``seeds + i``).
        Returns the observations of all N."""
        seed = seeds
        if seed is None and self.batch is None and self._resets == 0:
            seed = self.seed
        if mask is None or np.asarray(mask).all():
            mask = np.ones(self.n, bool)
        elif not np.asarray(mask).any():
            return self.batch
        elif self.batch is None:  # the others would wait (no-op steps) in envs never reset
            self.reset()
            seed = seeds
        mask = self._mask(mask)
        per_env, per_seed = self._options(options), self._seeds(seed)
        self._resets += 1
        try:
            with self._guard():
                self.batch, _ = self.env.reset(mask, per_env, per_seed)
        except EnvWorkerError as e:
            self._restart(e)
        self.last[mask] = self._idle()
        return self.batch

    def _mask(self, mask) -> np.ndarray:
        mask = np.asarray(mask, bool)
        if mask.shape != (self.n,):
            raise ValueError(f"VecEnv.reset mask must be [N={self.n}] bool, got shape {mask.shape}")
        return mask

    def _options(self, options: dict | list | None) -> list[dict | None]:
        if options is None or isinstance(options, dict):
            return [options] * self.n
        if len(options) != self.n:
            raise ValueError(
                f"VecEnv.reset got {len(options)} reset options for {self.n} envs; give one "
                "entry (a dict or None) per env, or one dict for all"
            )
        return list(options)

    def _seeds(self, seed) -> list[int | None]:
        if seed is None:
            return [None] * self.n
        if isinstance(seed, (list, tuple, np.ndarray)):
            if len(seed) != self.n:
                raise ValueError(f"VecEnv.reset got {len(seed)} seeds for {self.n} envs")
            return [None if s is None else int(s) for s in seed]
        return [int(seed) + i for i in range(self.n)]

    # ------------------------------------------------------------------ step
    def sanitize(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """actions [N, K, A] -> (finite actions clipped to [-1, 1], bad [N] bool): an env whose
        chunk holds a NaN/inf gets no-ops for the whole chunk."""
        actions = np.asarray(actions, np.float32)
        if actions.ndim != 3 or actions.shape[0] != self.n or actions.shape[2] != self.action_dim:
            raise ValueError(
                f"VecEnv.step expects actions [N={self.n}, K, A={self.action_dim}]; got "
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
        whose episode ends mid-chunk is parked for the rest of it; the caller resets it into
        its next episode before its next policy step."""
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
                with self._guard():
                    nxt, r, te, tr, info = self.env.step(a)
            except EnvWorkerError as e:
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
        """Reset envs whose episode just ended so the backend (autoreset disabled) may be
        stepped again; their final observation stays in the batch until the caller resets
        them into their next episode."""
        if ended.any():
            try:
                with self._guard():
                    self.env.reset(ended, [None] * self.n, [None] * self.n)
            except EnvWorkerError as e:
                self._restart(e)

    # ------------------------------------------------------------------ faults
    @contextlib.contextmanager
    def _guard(self):
        """Turn a dead or raising worker of an async backend into `EnvWorkerError`. A worker
        that raised sends its exception to the parent, which gymnasium re-raises there after
        closing that worker's pipe; a dead one shows as a broken pipe or an EOF. In process,
        an env's error is raised as it is."""
        try:
            yield
        except Exception as e:
            if not self.async_:
                raise
            failed = self.env.failed_workers()
            if failed or isinstance(e, (EOFError, OSError)):
                raise EnvWorkerError(
                    f"{self.env_id}: env worker(s) {failed or '?'} of {self.n} died or raised "
                    f"({type(e).__name__}: {e})"
                ) from e
            raise

    def _restart(self, error: BaseException) -> None:
        """Rebuild and reset the backend after a worker died or raised (a rebuilt backend whose
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
            except Exception:  # noqa: BLE001 - the old backend is broken; closing is best effort
                pass
            self.env = self._make()
            seeds = self._seeds(self.seed + RESTART_SEED * self.counters["env_restarts"])
            try:
                with self._guard():
                    self.batch, _ = self.env.reset(np.ones(self.n, bool), [None] * self.n, seeds)
                break
            except EnvWorkerError as e:
                error = e
        self.last[:] = self._idle()
        raise EnvRestarted(f"{self.env_id}: env worker died or raised ({cause!r}); envs restarted")

    # ------------------------------------------------------------------ snapshots
    def get_state(self) -> dict:
        """The envs' episodes in flight and what this layer remembers of them: numpy arrays and
        plain Python values (the backend's per-env ``{"env", "elapsed_steps"}`` records)."""
        b = self.batch
        with self._guard():
            envs = self.env.get_state()
        return {
            "envs": envs,
            "batch": None if b is None else {
                "images": dict(b.images), "proprio": b.proprio, "objects": b.objects,
                "instructions": list(b.instructions),
            },
            "last": self.last.copy(),
            "resets": self._resets,
            "restart_streak": self._restart_streak,
        }  # fmt: skip

    def snapshot(self, envs) -> list[dict]:
        """Each env of ``envs`` (indices): its episode in flight, its last observation and last
        executed action, to `restore` into any env of this layer (the branch point of a VLA
        tree). Numpy arrays and plain values."""
        with self._guard():
            states = self.env.get_state()
        b = self.batch
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
            raise ValueError(f"VecEnv.restore: {len(idx)} envs in the mask, {len(snaps)} snapshots")
        if self.batch is None:  # envs never reset cannot take a snapshot's physics
            self.reset()
        states: list[dict | None] = [None] * self.n
        for j, snap in zip(idx.tolist(), snaps):
            states[j] = snap["env"]
        try:
            with self._guard():
                self.env.set_state(states)
        except EnvWorkerError as e:
            self._restart(e)
        self.batch = _with_rows(self.batch, idx, [s["obs"] for s in snaps])
        for j, snap in zip(idx.tolist(), snaps):
            self.last[j] = snap["last"]
        return self.batch

    def set_state(self, state: dict) -> None:
        """Continue the episodes of `get_state` in these envs (built with the same options): a
        full reset, then each env's snapshot. Raises RuntimeError when a worker fails meanwhile
        (the envs are then fresh: resume again to continue exactly)."""
        try:
            with self._guard():
                self.env.reset(np.ones(self.n, bool), [None] * self.n, [None] * self.n)
                self.env.set_state(state["envs"])
        except EnvWorkerError as e:
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
                {k: _on(v, device) for k, v in b["images"].items()}, _array(b["proprio"]),
                _array(b["objects"]), [str(s) for s in b["instructions"]],
            )  # fmt: skip
        self.last[:] = np.asarray(state["last"], np.float32)
        self._resets = int(state["resets"])
        self._restart_streak = int(state["restart_streak"])

    def close(self) -> None:
        self.env.close()


# ---------------------------------------------------------------------------------------------
# observations: numpy arrays, or torch tensors on the warp backend's device (torch is imported
# only when such tensors are there: sim stays importable without it)
# ---------------------------------------------------------------------------------------------


def _copy(x):
    """A copy of a numpy array or a torch tensor."""
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def _array(x) -> np.ndarray | None:
    return None if x is None else np.asarray(x)


def _on(x, device):
    """``x`` as a numpy array (``device`` None) or a torch tensor on ``device``."""
    if device is None:
        return np.asarray(x)
    import torch

    return torch.as_tensor(x, device=device)


def _with_rows(b: Batch, idx: np.ndarray, rows: list[dict]) -> Batch:
    """``b`` with env ``idx[j]``'s observation replaced by ``rows[j]`` (a `VecEnv.snapshot`
    observation)."""
    images = {k: _copy(v) for k, v in b.images.items()}
    proprio = b.proprio.copy()
    objects = None if b.objects is None else b.objects.copy()
    instructions = list(b.instructions)
    for j, obs in zip(idx.tolist(), rows):
        for k in images:
            images[k][j] = obs["images"][k]
        proprio[j] = obs["proprio"]
        if objects is not None:
            objects[j] = obs["objects"]
        instructions[j] = obs["instruction"]
    return Batch(images, proprio, objects, instructions)


def _merge(old: Batch, new: Batch, live: np.ndarray) -> Batch:
    """Observations of ``new`` where ``live`` [N], else ``old`` (envs that already ended keep
    their final observation)."""
    if live.all():
        return new

    def pick(a, b):
        if a is None:
            return None
        sel = live.reshape(-1, *([1] * (a.ndim - 1)))
        if isinstance(b, np.ndarray):
            return np.where(sel, b, a)
        import torch  # images of the warp backend, on its device

        a = torch.as_tensor(a, device=b.device)
        return torch.where(torch.as_tensor(sel, device=b.device), b, a)

    return Batch(
        {k: pick(old.images[k], v) for k, v in new.images.items()},
        pick(old.proprio, new.proprio),
        pick(old.objects, new.objects),
        [n if lv else o for o, n, lv in zip(old.instructions, new.instructions, live)],
    )


__all__ = ["Batch", "EnvRestarted", "StepResult", "VecEnv", "idle_action", "make_backend"]
