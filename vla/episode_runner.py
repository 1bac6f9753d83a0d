"""`EpisodeRunner`: the one loop that runs VLA episodes in N envs.

Every VLA job that steps envs (PPO and GRPO collection, seeded evaluation, expert
demonstrations, off-policy replay through ``on_step``) runs this loop; the jobs differ only in
what they hand it:

* an `Actor`: ``observe(sim batch) -> obs``, ``act(obs) -> (action [N, K*A], logp [N] | None,
  value [N] | None)`` (a policy, or scripted experts) and optionally ``value(obs) -> [N]``, the
  critic read without sampling an action for the bootstraps;
* a schedule: `EpisodeRunner.horizon` (``steps`` policy steps of every env, fresh episodes
  refilled as they end and continued across calls: PPO, demonstrations) or
  `EpisodeRunner.episodes` (a queue of `EpisodeSpecs`, indexed or seeded initial states given
  to free envs by masked resets until all have run: GRPO groups, evaluation).

Storage is CleanRL's: preallocated ``[T, N, ...]`` tensors (observations per key, actions,
rewards, log-probs, values) and ``[T, N]`` masks (``valid``: the env ran an episode at that
step; ``end``: how the segment ending there ended). Episodes end by masks; segments are cut out
in one gather at the end of a run (`Rows`). Observations that differ in shape per env (TokenVLA
prompts) are one list per step. The success rule (`episode_success`) and the episodes'
initial-state ids live here only.

Interface for other backends: the runner only needs the surface of `sim.vector.VecEnv` (``n``,
``action_dim``, ``time_limit``, ``batch``, ``reset(mask, options, seeds)``, ``step(actions
[N, K, A]) -> StepResult``, ``noop()``, ``snapshot``/``restore``, ``EnvRestarted``), so a
simulator that offers it plugs in unchanged (MJWarp plugs in behind `VecEnv`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..sim.vector import EnvRestarted, StepResult, VecEnv

CONTINUES, TERMINATED, TRUNCATED, CUT, UNSTABLE = 0, 1, 2, 3, 4
END_NAMES = ("", "terminated", "truncated", "cut", "unstable")
"""how a segment ended, by ``end`` code: terminal state | time limit | horizon or env restart |
physics blow-up (the step that blew up is dropped; the segment ends at the step before it,
bootstrapped with the value the actor gave at the blow-up step, never from the env's restored
initial state)"""


def episode_success(success: np.ndarray, terminated: np.ndarray) -> np.ndarray:
    """The success rule of every VLA job: a policy step [N] succeeded when the task reported
    success during it or the episode ended in a terminal state; an episode succeeded when any
    of its steps did."""
    return np.asarray(success, bool) | np.asarray(terminated, bool)


@dataclass
class EpisodeSpecs:
    """Initial states of queued episodes, arrays [M] int64; -1 marks an unused field."""

    group: np.ndarray
    """group id (episodes of a GRPO group share it and their initial state)"""
    task_id: np.ndarray
    """indexed initial state: reset option ``task_id`` (-1: not indexed)"""
    trial_id: np.ndarray
    """indexed initial state: reset option ``trial_id``"""
    seed: np.ndarray
    """reset seed (-1: none)"""
    state: list | None = None
    """[M] a branch point per episode (`EpisodeRunner` snapshots, or None): the episode
    continues it instead of starting from a reset (VLA trees)"""

    @classmethod
    def branched(cls, group, states: list[dict]) -> EpisodeSpecs:
        """Episodes that continue the snapshots ``states`` (one each; see `RunResult.cut`)."""
        g = np.asarray(group, np.int64)
        none = -np.ones_like(g)
        return cls(g, none, none.copy(), none.copy(), list(states))

    @classmethod
    def indexed(cls, group, task_id, trial_id) -> EpisodeSpecs:
        """Episodes reset with options ``task_id``/``trial_id`` (each [M])."""
        g = np.asarray(group, np.int64)
        return cls(
            g, np.asarray(task_id, np.int64), np.asarray(trial_id, np.int64), -np.ones_like(g)
        )

    @classmethod
    def seeded(cls, seeds) -> EpisodeSpecs:
        """One episode per reset seed (group = position in ``seeds``)."""
        s = np.asarray(seeds, np.int64)
        return cls(np.arange(len(s)), -np.ones_like(s), -np.ones_like(s), s)

    def __len__(self) -> int:
        return len(self.group)


@dataclass
class Actor:
    """What acts in the envs: a policy or scripted experts."""

    observe: Callable
    """sim ``Batch`` (N envs) -> observations: dict of [N, ...] tensors (or lists of N tensors)"""
    act: Callable
    """observations -> (action [N, K*A], logp [N] or None, value [N] or None)"""
    value: Callable | None = None
    """observations -> critic value [N] without sampling (bootstraps); None: bootstraps are 0"""
    to_env: Callable | None = None
    """what ``act`` sampled [N, X] -> the env's action chunk [N, K*A], when they differ (a flow
    head samples a denoising chain and stores it; the env executes its last state)"""

    @classmethod
    def of(cls, policy, act: Callable, value: Callable | None = None) -> Actor:
        """A policy's actor: its ``observe`` and, when it has one, its ``env_action``."""
        return cls(policy.observe, act, value, getattr(policy, "env_action", None))


@dataclass
class Episodes:
    """Episodes that ended during a run, arrays [E] in the order they ended (dropped ones, from
    an env restart, are not here)."""

    spec: np.ndarray
    """index into the run's `EpisodeSpecs` (-1: a fresh reset of a horizon run)"""
    success: np.ndarray  # bool, by `episode_success`
    ret: np.ndarray  # float64 sum of rewards
    length: np.ndarray  # env steps
    unstable: np.ndarray  # bool: the episode was cut by a physics blow-up


@dataclass
class Rows:
    """Segments cut out of the buffers, one row each, right-padded to the longest (T)."""

    actions: Tensor
    """[B, T, X] float32 what the actor sampled: raw actions (X = K*A), or a flow head's
    denoising chains (0 on padding)"""
    mask: Tensor
    """[B, T] float32, 1 on the valid steps (right-padded)"""
    rewards: Tensor
    """[B, T] float32 reward of each policy step"""
    logp: Tensor | None
    """[B, T] behaviour log-probs, when the actor gave them"""
    value: Tensor | None
    """[B, T] critic values at acting time, when the actor gave them"""
    inputs: dict[str, list[Tensor]]
    """observation key -> B tensors [T_i, ...] (valid steps only)"""
    bootstrap: Tensor
    """[B] V(s') after the last step: 0 terminal, V(final obs) time limit, V(next obs) cut,
    V(obs the blow-up step acted on) unstable"""
    end: np.ndarray
    """[B] int8 end code (`END_NAMES`)"""
    spec: np.ndarray
    """[B] int64 episode spec index (-1 for fresh resets)"""
    success: np.ndarray
    """[B] bool: the episode had succeeded by the segment's last step"""

    def __len__(self) -> int:
        return len(self.end)

    def lengths(self) -> list[int]:
        return [int(x) for x in self.mask.sum(1)]

    def select(self, order: np.ndarray) -> Rows:
        """Rows reordered (or subset) by ``order`` [B']."""
        idx = torch.as_tensor(order, dtype=torch.long)
        opt = lambda x: None if x is None else x[idx]  # noqa: E731
        return Rows(
            self.actions[idx], self.mask[idx], self.rewards[idx], opt(self.logp),
            opt(self.value), {k: [v[j] for j in order] for k, v in self.inputs.items()},
            self.bootstrap[idx], self.end[order], self.spec[order], self.success[order],
        )  # fmt: skip


@dataclass
class RunResult:
    """What one `EpisodeRunner.horizon` / `EpisodeRunner.episodes` call produced."""

    rows: Rows | None
    """the segments (None for a runner built with ``rows=False``)"""
    episodes: Episodes
    env_steps: int
    """env steps executed by envs that were running an episode"""
    cut: list[tuple[int, dict]] = dataclasses.field(default_factory=list)
    """`EpisodeRunner.episodes` with ``max_steps``: (spec index, snapshot) of every episode
    stopped at the cap, to continue with `EpisodeSpecs.branched` (its segment ends ``cut``)"""


class EpisodeRunner:
    """N envs of a `VecEnv`, fixed ``[T, N]`` buffers and masks; see the module docstring.

    Args:
        vec: the envs (the runner decides who resets, with which state).
        rows: store observations and actions and emit `Rows` (False: episode outcomes only,
            e.g. evaluation).
        on_reset: called with the [N] bool mask of envs that just started an episode (after
            their reset), e.g. to reset scripted experts.
        chunk: K, env steps per policy step (sizes the buffers of `episodes`).
        on_step: ``(obs, actions [N, X], StepResult, running [N])`` after every policy step.
    """

    def __init__(self, vec: VecEnv, rows: bool = True, on_reset: Callable | None = None,
                 chunk: int = 1, on_step: Callable | None = None):  # fmt: skip
        self.vec, self.store, self.on_reset, self.chunk = vec, rows, on_reset, chunk
        self.on_step = on_step
        N = vec.n
        self.active = np.zeros(N, bool)
        """[N] the env runs an episode"""
        self.slot = np.full(N, -1, np.int64)
        """[N] spec index of the env's episode (-1: a fresh reset)"""
        self.ret, self.length = np.zeros(N), np.zeros(N, np.int64)
        self.success = np.zeros(N, bool)
        """[N] `episode_success` so far in the env's episode"""
        self.seg_start = np.zeros(N, np.int64)
        """[N] buffer row where the env's current segment began"""
        self.started = False
        """a horizon run has episodes in flight (they continue in the next call)"""
        self.specs = EpisodeSpecs.indexed([], [], [])
        self.queue = np.zeros(0, np.int64)
        """spec indices waiting for a free env"""
        self.cap = 0
        self.tensors: dict[str, Tensor] = {}
        """``obs/<key>``, ``actions``, ``rewards``, ``logp``, ``value``: [cap, N, ...]"""
        self.lists: dict[str, list] = {}
        """observation keys given as lists of N tensors: one list per step"""
        self.valid = np.zeros((0, N), bool)
        self.end = np.zeros((0, N), np.int8)
        self.boot = np.zeros((0, N), np.float32)
        self.end_spec = np.zeros((0, N), np.int64)
        self.end_success = np.zeros((0, N), bool)
        self._done: list[tuple] = []
        self._capped: list[tuple[int, dict]] = []
        self.env_steps = 0

    # ------------------------------------------------------------------ schedules
    def horizon(self, actor: Actor, steps: int) -> RunResult:
        """``steps`` policy steps of every env; an env whose episode ends starts a fresh one
        (plain reset); episodes in flight continue in the next call. Segments end at episode
        ends and at the horizon, where ``bootstrap`` = ``actor.value`` of the next observation."""
        self._begin_run()
        self._reserve(steps)
        N = self.vec.n
        fresh = np.full(N, -1)
        if not self.started:
            try:
                self.vec.reset()
            except EnvRestarted:  # the rebuilt envs were reset: nothing was in flight
                pass
            self._start(np.ones(N, bool), fresh, 0)
            self.started = True
        self.seg_start[:] = 0
        for t in range(steps):
            ended = self._step(t, actor)
            if ended is not None and ended.any():
                try:
                    self.vec.reset(mask=ended)
                    self._start(ended, fresh, t + 1)
                except EnvRestarted:
                    ended = None  # the ended envs' episodes are closed; the others' are lost
            if ended is None:  # env restart: drop the step of the episodes in flight and cut
                self.valid[t, self.active] = False  # them before it; all envs start afresh
                self._cut(t - 1, self.active, self._values_at(t))
                self._start(np.ones(N, bool), fresh, t + 1)
        if steps > 0:
            v = actor.value(actor.observe(self.vec.batch)) if actor.value is not None else None
            self._cut(steps - 1, self.active, None if v is None else _numpy(v))
        return self._result(steps)

    def episodes(self, actor: Actor, specs: EpisodeSpecs, max_steps: int = 0) -> RunResult:
        """Run every episode of ``specs`` to its end, ``N`` at a time: free envs take the next
        queued initial state by a masked reset (or continue a branch point, `EpisodeSpecs.state`);
        envs wait (no-op actions) once the queue is empty. An episode dropped by an env restart
        goes back to the queue's front. With ``max_steps`` > 0 an episode still running after
        that many policy steps of this run is stopped there: its segment ends ``cut`` (no
        bootstrap) and its snapshot goes to `RunResult.cut`."""
        self._begin_run()
        self.started = False
        self.specs, self.queue = specs, np.arange(len(specs), dtype=np.int64)
        self.active[:] = False
        N = self.vec.n
        per_episode = math.ceil((self.vec.time_limit or 0) / self.chunk)
        if max_steps > 0:
            per_episode = min(per_episode, max_steps)
        self._reserve(math.ceil(len(specs) / N) * per_episode + 1)
        self._assign(np.ones(N, bool), 0)
        t = 0
        while self.active.any():
            ended = self._step(t, actor)
            if ended is None:
                self._requeue(t)
                t += 1
                continue
            if max_steps > 0:
                capped = self.active & (t + 1 - self.seg_start >= max_steps)
                if capped.any():
                    self._stop(t, capped)
                    ended = ended | capped
            if ended.any():
                self._assign(ended, t + 1)
            t += 1
        return self._result(t)

    def _stop(self, t: int, envs: np.ndarray) -> None:
        """Stop the episodes of ``envs`` [N] at the step cap after row ``t``: cut their segments
        and keep each one's snapshot (physics, last observation, return, length, success)."""
        idx = np.flatnonzero(envs)
        for i, snap in zip(idx.tolist(), self.vec.snapshot(idx)):
            snap.update(ret=float(self.ret[i]), length=int(self.length[i]),
                        success=bool(self.success[i]))  # fmt: skip
            self._capped.append((int(self.slot[i]), snap))
        self._cut(t, envs, None)
        self.active[envs] = False

    # ------------------------------------------------------------------ one policy step
    def _step(self, t: int, actor: Actor) -> np.ndarray | None:
        """Act, store, step every env; end the episodes that ended. Returns the [N] mask of
        envs whose episode ended, or None when the envs were restarted (nothing stepped)."""
        vec, active = self.vec, self.active
        obs = actor.observe(vec.batch)
        action, logp, value = actor.act(obs)
        action = action.detach().float().cpu()  # (N, X): what the actor sampled
        self._write(t, obs, action, logp, value)
        env_a = actor.to_env(action) if actor.to_env is not None else action  # (N, K*A)
        env_a = env_a.numpy().reshape(vec.n, -1, vec.action_dim)  # (N, K, A)
        if not active.all():
            env_a = env_a.copy()
            env_a[~active] = vec.noop()[~active][:, None, :]  # idle envs wait for the others
        try:
            res = vec.step(env_a)
        except EnvRestarted:
            return None
        if self.on_step is not None:
            self.on_step(obs, action, res, active.copy())
        reward = np.where(active, res.reward, np.float32(0))  # (N,) float32
        if self.store:
            self.tensors["rewards"][t] = torch.from_numpy(reward)
        self.env_steps += int(res.env_steps[active].sum())
        self.ret += reward
        self.length += np.where(active, res.env_steps, 0)
        self.success |= active & episode_success(res.success, res.terminated)
        ended = active & (res.terminated | res.truncated)
        if ended.any():
            self._end(t, ended, res, actor)
        return ended

    def _end(self, t: int, ended: np.ndarray, res: StepResult, actor: Actor) -> None:
        """Close the episodes of the ``ended`` envs at step ``t``; a time limit bootstraps from
        ``actor.value`` of the final observation. A physics blow-up is no time limit: its step
        is dropped and the segment cut before it (see `UNSTABLE`)."""
        blown = ended & (res.unstable if res.unstable is not None else False)
        done = ended & ~blown
        trunc = done & res.truncated
        self.end[t, done] = np.where(res.terminated, TERMINATED, TRUNCATED)[done]
        if actor.value is not None and trunc.any():
            v = _numpy(actor.value(actor.observe(res.batch)))
            self.boot[t, trunc] = v[trunc]
        self.end_spec[t, done] = self.slot[done]
        self.end_success[t, done] = self.success[done]
        if blown.any():
            self.valid[t, blown] = False
            self._cut(t - 1, blown, self._values_at(t), UNSTABLE)
        i = np.flatnonzero(ended)
        self._done.append((self.slot[i], self.success[i], self.ret[i], self.length[i], blown[i]))
        self.active[ended] = False

    def _cut(self, t: int, envs: np.ndarray, value: np.ndarray | None, code: int = CUT) -> None:
        """End the segments in flight of ``envs`` [N] at row ``t`` with end ``code`` (their
        episodes go on, or were lost), bootstrapped with ``value`` [N] (None: 0)."""
        cut = envs & (self.seg_start <= t)
        if t < 0 or not cut.any():
            return
        self.end[t, cut] = code
        self.boot[t, cut] = 0.0 if value is None else value[cut]
        self.end_spec[t, cut] = self.slot[cut]
        self.end_success[t, cut] = self.success[cut]

    # ------------------------------------------------------------------ episode starts
    def _start(self, mask: np.ndarray, slot: np.ndarray, row: int) -> None:
        """Envs in ``mask`` [N] were just reset into the episodes ``slot`` [N] (or restored to
        their branch points, whose return, length and success so far they carry on); their
        first step goes to buffer row ``row``."""
        self.active[mask] = True
        self.slot[mask] = slot[mask]
        self.ret[mask], self.length[mask], self.success[mask] = 0.0, 0, False
        states = self.specs.state
        if states is not None:
            for i in np.flatnonzero(mask).tolist():
                snap = states[slot[i]] if slot[i] >= 0 else None
                if snap is not None:
                    self.ret[i], self.length[i] = snap["ret"], snap["length"]
                    self.success[i] = snap["success"]
        self.seg_start[mask] = row
        if self.on_reset is not None:
            self.on_reset(mask)

    def _assign(self, free: np.ndarray, row: int) -> None:
        """Give the next queued initial states to the ``free`` [N] envs (one masked reset)."""
        envs = np.flatnonzero(free)[: len(self.queue)]
        if len(envs) == 0:
            return
        ids, self.queue = self.queue[: len(envs)], self.queue[len(envs) :]
        N, sp = self.vec.n, self.specs
        mask, slot = np.zeros(N, bool), np.full(N, -1, np.int64)
        mask[envs], slot[envs] = True, ids
        options, seeds = None, None
        if (sp.task_id[ids] >= 0).any():
            options = [None] * N
            for e, a, b in zip(envs.tolist(), sp.task_id[ids].tolist(), sp.trial_id[ids].tolist()):
                options[e] = {"task_id": a, "trial_id": b}
        if (sp.seed[ids] >= 0).any():
            seeds = [None] * N
            for e, s in zip(envs.tolist(), sp.seed[ids].tolist()):
                seeds[e] = s if s >= 0 else None
        branch = np.zeros(N, bool)
        if sp.state is not None:
            branch[envs] = [sp.state[j] is not None for j in ids.tolist()]
        try:
            if (mask & ~branch).any():
                self.vec.reset(mask=mask & ~branch, options=options, seeds=seeds)
            if branch.any():
                self.vec.restore(branch, [sp.state[j] for j in slot[branch].tolist()])
        except EnvRestarted:  # these episodes never started: back to the queue, with the lost
            self.queue = np.concatenate([ids, self.queue])
            self._requeue(row - 1)
            return
        self._start(mask, slot, row)

    def _requeue(self, t: int) -> None:
        """After an env restart: drop the partial episodes (their steps become invalid), put
        their specs back at the queue's front, and refill every env."""
        live = np.flatnonzero(self.active)
        for n in live:
            self.valid[self.seg_start[n] : t + 1, n] = False
        self.queue = np.concatenate([self.slot[live], self.queue])
        self.active[:] = False
        self._assign(np.ones(self.vec.n, bool), t + 1)

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        """Between runs: the episodes in flight that the next `horizon` call continues (which
        envs run one, its spec, return, length and success so far). Segments never carry over
        (every run cuts its own), so this and the envs' state (`VecEnv.get_state`) are all a
        resumed runner needs. Numpy arrays and plain Python values."""
        return {
            "started": self.started, "active": self.active.copy(), "slot": self.slot.copy(),
            "ret": self.ret.copy(), "length": self.length.copy(), "success": self.success.copy(),
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.started = bool(state["started"])
        for key in ("active", "slot", "ret", "length", "success"):
            getattr(self, key)[:] = np.asarray(state[key])

    # ------------------------------------------------------------------ buffers
    def _begin_run(self) -> None:
        """Forget the previous run's finished episodes, stopped branches and step count."""
        self._done, self._capped, self.env_steps = [], [], 0

    def _reserve(self, cap: int) -> None:
        """Grow the [T, N] buffers to at least ``cap`` rows (kept across runs)."""
        if cap <= self.cap:
            return
        extra, N = cap - self.cap, self.vec.n
        grow = lambda a: np.concatenate([a, np.zeros((extra, N), a.dtype)])  # noqa: E731
        self.valid, self.end, self.boot = grow(self.valid), grow(self.end), grow(self.boot)
        self.end_spec, self.end_success = grow(self.end_spec), grow(self.end_success)
        if self.store:
            self.tensors.setdefault("rewards", torch.zeros(self.cap, N))
        for k, x in self.tensors.items():
            self.tensors[k] = torch.cat([x, x.new_zeros(extra, *x.shape[1:])])
        for v in self.lists.values():
            v.extend([None] * extra)
        self.cap = cap

    def _write(self, t: int, obs: dict, action: Tensor, logp, value) -> None:
        """Row ``t``: masks of the envs running episodes, and (``rows=True``) what they saw
        and did."""
        if t >= self.cap:
            self._reserve(max(2 * self.cap, t + 1))
        self.valid[t], self.end[t], self.boot[t] = self.active, CONTINUES, 0.0
        if not self.store:
            return
        self._put(t, "actions", action)
        self._put(t, "logp", None if logp is None else logp.detach().float().cpu())
        self._put(t, "value", None if value is None else value.detach().float().cpu())
        for k, v in obs.items():
            if isinstance(v, Tensor):
                self._put(t, f"obs/{k}", v.detach())
            else:  # a list of N tensors whose shapes differ per env
                self.lists.setdefault(k, [None] * self.cap)[t] = list(v)

    def _put(self, t: int, key: str, v: Tensor | None) -> None:
        """``tensors[key][t] = v`` [N, ...], allocating [cap, N, ...] on a run's first step."""
        buf = self.tensors.get(key)
        if v is None:
            self.tensors.pop(key, None)
            return
        if buf is None or buf.shape[1:] != v.shape or buf.dtype != v.dtype:
            if t > 0:
                raise ValueError(
                    f"the actor's {key} changed from {None if buf is None else tuple(buf.shape[1:])}"
                    f" to {tuple(v.shape)} in the middle of a run; observe/act must keep their "
                    "layout for every step"
                )
            self.tensors[key] = buf = torch.zeros(
                self.cap, *v.shape, dtype=v.dtype, device=v.device
            )
        _copy_into(buf[t], v)

    def _values_at(self, t: int) -> np.ndarray | None:
        """[N] values the actor gave at row ``t`` (None when it gives none)."""
        v = self.tensors.get("value") if self.store else None
        return None if v is None else v[t].numpy()

    # ------------------------------------------------------------------ results
    def _result(self, T: int) -> RunResult:
        if self._done:
            episodes = Episodes(*(np.concatenate(c) for c in zip(*self._done)))
        else:
            kinds = (np.int64, bool, float, np.int64, bool)
            episodes = Episodes(*(np.zeros(0, d) for d in kinds))
        rows = self._rows(T) if self.store else None
        return RunResult(rows, episodes, self.env_steps, list(self._capped))

    def _segments(self, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every segment that ended in rows [0, T): (last row, env, end code, length), each
        [B], ordered by last row, then horizon (or restart) cuts after episode ends, then env."""
        end = self.end[:T]
        tt, nn = np.nonzero(end)
        order = np.lexsort((nn, end[tt, nn] == CUT, tt))
        tt, nn = tt[order], nn[order]
        # a segment's length: valid steps since the previous segment end of the same env
        count = np.cumsum(self.valid[:T], axis=0)[tt, nn]  # (B,)
        by_env = np.lexsort((tt, nn))
        prev = np.r_[0, count[by_env][:-1]]
        prev[np.r_[True, nn[by_env][1:] != nn[by_env][:-1]]] = 0
        lens = np.empty_like(count)
        lens[by_env] = count[by_env] - prev
        return tt, nn, end[tt, nn], lens

    def _rows(self, T: int) -> Rows:
        """Cut the segments (`_segments`) out of the buffers: one gather per buffer."""
        tt, nn, codes, lens = self._segments(T)
        steps = np.arange(int(lens.max()) if len(lens) else 0)
        valid = steps[None] < lens[:, None]  # (B, L) right-padded
        ti = np.where(valid, (tt - lens + 1)[:, None] + steps[None], 0)  # (B, L) buffer rows
        ni = np.broadcast_to(nn[:, None], ti.shape)  # (B, L) envs

        def padded(key: str) -> Tensor | None:
            if key not in self.tensors:
                return None
            x = _take(self.tensors[key], ti, ni)  # (B, L, ...)
            x[torch.from_numpy(~valid)] = 0
            return x

        split = lens.tolist()
        ft, fn = ti[valid], ni[valid]  # the valid steps, row after row
        inputs = {
            k[4:]: list(torch.split(_take(x, ft, fn), split))
            for k, x in self.tensors.items()
            if k.startswith("obs/")
        }
        for k, per_step in self.lists.items():
            inputs[k] = [
                torch.stack([per_step[t][n] for t in range(e - m + 1, e + 1)])
                for e, n, m in zip(tt.tolist(), nn.tolist(), split)
            ]
        return Rows(
            padded("actions"), torch.from_numpy(valid).float(), padded("rewards"),
            padded("logp"), padded("value"), inputs,
            torch.from_numpy(self.boot[tt, nn].astype(np.float32)), codes.astype(np.int8),
            self.end_spec[tt, nn], self.end_success[tt, nn],
        )  # fmt: skip


def _on_host(x: Tensor) -> bool:
    """A CPU tensor numpy can view (torch's intra-op threads cost more than the copies and
    gathers of a step's observations: 1.1 ms vs 0.06 ms for 8 envs' images, 2 busy cores)."""
    return x.device.type == "cpu" and x.dtype != torch.bfloat16


def _copy_into(dst: Tensor, src: Tensor) -> None:
    """``dst[...] = src`` (same shape and dtype)."""
    if _on_host(dst) and _on_host(src):
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


def _take(x: Tensor, ti: np.ndarray, ni: np.ndarray) -> Tensor:
    """``x[ti, ni]`` [*ti.shape, ...] for buffer rows ``ti`` and envs ``ni`` (one shape)."""
    if _on_host(x):
        return torch.from_numpy(x.numpy()[ti, ni])
    return x[tuple(torch.from_numpy(np.ascontiguousarray(a)).to(x.device) for a in (ti, ni))]


def _numpy(x) -> np.ndarray:
    """A [N] tensor (any device) -> float32 numpy."""
    return x.detach().float().cpu().numpy()
