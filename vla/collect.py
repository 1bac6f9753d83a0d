"""Env-rollout collectors: the VLA side's `RolloutSource`s.

`PPOCollector` runs ``env.num_envs`` envs for ``env.steps_per_rollout`` policy steps each and
cuts every env's stream at episode ends into *segments*; each segment is one row of the batch:

    tokens [B, T, K*A] raw sampled actions      mask [B, T] right-padded valid steps
    rewards [B, T] reward of each policy step   bootstrap_value [B] V(s') after the last step
    inputs[k]: list of B tensors [T_i, ...]     (observations, only the valid steps)

``bootstrap_value`` is 0 when the segment ends in a terminal state, V(final observation) when the
episode hit its time limit, and V(next observation) when the rollout horizon cut the episode (it
continues in the next batch). ``logp_old`` and ``values_old`` [B, T] are the log-probs and values
the policy computed when it acted: the parameters have not changed since, so the trainer uses them
instead of scoring the batch again (as CleanRL and SB3 do).

`GRPOCollector` runs ``rollout.prompts_per_step`` groups of ``rollout.group_size`` whole episodes;
the episodes of a group start from the same indexed initial state (reset options ``task_id`` /
``trial_id``) and share a ``group_id``; the sequence reward is success (0/1), so the trainer's
``algo.dynamic_sampling`` drops groups that all succeed or all fail.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..trainer.batch import RolloutBatch
from ..trainer.config import EnvConfig, RolloutConfig
from .envs import EnvRestarted, StepResult, VecRunner


@dataclass
class Episode:
    """Steps of one env since its current segment started."""

    obs: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    actions: list = field(default_factory=list)
    rewards: list = field(default_factory=list)
    logps: list = field(default_factory=list)
    """PPO: behaviour log-prob of each action (at acting time)"""
    values: list = field(default_factory=list)
    """PPO: critic value of each observation (at acting time)"""
    ret: float = 0.0
    """return of the whole episode so far (segments of one episode share it)"""
    length: int = 0
    """policy steps of the whole episode so far"""
    env_steps: int = 0
    spec: tuple[int, int, int] | None = None
    """GRPO: (group, task_id, trial_id) of the initial state"""
    end: str = ""
    """how the segment ended: terminated | truncated | cut (rollout horizon or env restart)"""

    def add(self, obs: dict, i: int, action, reward: float, env_steps: int) -> None:
        for k, v in obs.items():
            self.obs[k].append(v[i])
        self.actions.append(action)
        self.rewards.append(reward)
        self.ret += reward
        self.length += 1
        self.env_steps += env_steps

    def cut(self) -> Episode:
        """A fresh segment of the same episode (return, length and spec carried over)."""
        return Episode(ret=self.ret, length=self.length, env_steps=self.env_steps, spec=self.spec)


def make_rows(segments: list[Episode]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Segments -> (tokens [B, T, D], mask [B, T], rewards [B, T], inputs {k: list of [T_i, ...]})."""
    B = len(segments)
    T = max(len(s.actions) for s in segments)
    D = segments[0].actions[0].shape[-1]
    tokens = torch.zeros(B, T, D)
    mask, rewards = torch.zeros(B, T), torch.zeros(B, T)
    inputs: dict[str, list] = defaultdict(list)
    for b, s in enumerate(segments):
        n = len(s.actions)
        tokens[b, :n] = torch.stack(s.actions)
        mask[b, :n] = 1.0
        rewards[b, :n] = torch.tensor(s.rewards)
        for k, v in s.obs.items():
            inputs[k].append(torch.stack(v))
    return tokens, mask, rewards, dict(inputs)


class _Base:
    """Shared bookkeeping: runner, episode stats, counters, resume state."""

    def __init__(self, env_cfg: EnvConfig, seed: int, runner: VecRunner | None = None):
        self.env_cfg = env_cfg
        self.seed = seed
        self.runner = runner or VecRunner(env_cfg, seed=seed)
        self.rng = np.random.default_rng(seed)
        self.K = env_cfg.action_chunk
        self.stats: dict[str, list] = defaultdict(list)
        self.episodes_done = 0

    def _act(self, policy, obs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sampled raw actions [N, K*A], their log-probs [N] and values [N] (CPU)."""
        action, logp, value = policy.act(obs)
        return action.float().cpu(), logp.float().cpu(), value.float().cpu()

    def _env_actions(self, action: torch.Tensor) -> np.ndarray:
        return action.numpy().reshape(action.shape[0], self.K, self.runner.action_dim)

    def _finish(self, ep: Episode, success: bool) -> None:
        self.stats["success"].append(float(success))
        self.stats["return"].append(ep.ret)
        self.stats["length"].append(ep.env_steps)
        self.episodes_done += 1

    def _metrics(self, env_steps: int, seconds: float) -> dict[str, float]:
        m = {
            "rollout/episodes": float(len(self.stats["success"])),
            "rollout/env_steps_per_s": env_steps / max(seconds, 1e-9),
            **{f"rollout/{k}": float(v) for k, v in self.runner.counters.items()},
        }
        for key, name in (("success", "success_rate"), ("return", "episode_return")):
            if self.stats[key]:
                m[f"rollout/{name}"] = float(np.mean(self.stats[key]))
        if self.stats["length"]:
            m["rollout/episode_length"] = float(np.mean(self.stats["length"]))
        self.stats.clear()
        return m

    def state_dict(self) -> dict:
        """Resume state: RNG and counters (episodes in flight restart from a fresh reset)."""
        return {
            "rng": self.rng.bit_generator.state,
            "counters": dict(self.runner.counters),
            "episodes_done": self.episodes_done,
        }

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.rng.bit_generator.state = state["rng"]
        self.runner.counters.update(state["counters"])
        self.episodes_done = state["episodes_done"]

    def close(self) -> None:
        self.runner.close()


class PPOCollector(_Base):
    """Per-step experience for PPO with GAE; see the module docstring."""

    def __init__(self, env_cfg: EnvConfig, seed: int = 0, runner: VecRunner | None = None):
        super().__init__(env_cfg, seed, runner)
        self.live: list[Episode] = []

    def collect(self, policy, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """``env.steps_per_rollout`` policy steps of every env -> (batch, metrics)."""
        t0, env_steps = time.perf_counter(), 0
        run = self.runner
        if run.batch is None or not self.live:
            run.reset()
            self.live = [Episode() for _ in range(run.n)]
        done_rows: list[Episode] = []
        boots: list[float] = []
        for _ in range(self.env_cfg.steps_per_rollout):
            obs = policy.observe(run.batch)
            action, logp, value = self._act(policy, obs)
            if not torch.isfinite(value).all():
                raise ValueError(
                    "the policy's critic returned NaN/inf values while collecting PPO "
                    "experience. With vla.critic=state the env must give the true poses: set "
                    "env.privileged_state=true; otherwise the critic diverged (lower train.lr, "
                    "or resume from an earlier checkpoint)"
                )
            try:
                res = run.step(self._env_actions(action))
            except EnvRestarted:  # keep what was collected, bootstrapped at the last state
                self._cut_all(done_rows, boots, value)
                self.live = [Episode() for _ in range(run.n)]  # the episodes were dropped
                continue
            env_steps += int(res.env_steps.sum())
            for i, ep in enumerate(self.live):
                ep.add(obs, i, action[i], float(res.reward[i]), int(res.env_steps[i]))
                ep.logps.append(float(logp[i]))
                ep.values.append(float(value[i]))
            self._end_episodes(policy, res, done_rows, boots)
        _, _, value = self._act(policy, policy.observe(run.batch))
        self._cut_all(done_rows, boots, value)
        tokens, mask, rewards, inputs = make_rows(done_rows)
        logp_old, values_old = torch.zeros_like(mask), torch.zeros_like(mask)
        for b, s in enumerate(done_rows):
            logp_old[b, : len(s.logps)] = torch.tensor(s.logps)
            values_old[b, : len(s.values)] = torch.tensor(s.values)
        batch = RolloutBatch(
            tokens=tokens, mask=mask, group_id=torch.arange(len(done_rows)), rewards=rewards,
            logp_old=logp_old, values_old=values_old,
            bootstrap_value=torch.tensor(boots, dtype=torch.float32), inputs=inputs,
            meta=[{"length": len(s.actions), "end": s.end} for s in done_rows],
        )  # fmt: skip
        return batch, self._metrics(env_steps, time.perf_counter() - t0)

    def _end_episodes(self, policy, res: StepResult, rows: list, boots: list) -> None:
        """Close the segments of envs whose episode ended; reset those envs."""
        ended = res.terminated | res.truncated
        if not ended.any():
            return
        final_v = None
        if res.truncated.any():  # time limit: bootstrap from the final observation
            _, _, final_v = self._act(policy, policy.observe(res.batch))
        for i in np.flatnonzero(ended):
            ep = self.live[i]
            ep.end = "truncated" if res.truncated[i] else "terminated"
            rows.append(ep)
            boots.append(float(final_v[i]) if res.truncated[i] else 0.0)
            self._finish(ep, bool(res.success[i]) or bool(res.terminated[i]))
            self.live[i] = Episode()
        self.runner.reset(mask=ended)

    def _cut_all(self, rows: list, boots: list, value: torch.Tensor) -> None:
        """Close every non-empty live segment at the horizon, bootstrapped with ``value`` [N]."""
        for i, ep in enumerate(self.live):
            if ep.actions:
                ep.end = "cut"
                rows.append(ep)
                boots.append(float(value[i]))
                self.live[i] = ep.cut()


class GRPOCollector(_Base):
    """Groups of whole episodes from shared indexed initial states; see the module docstring."""

    def __init__(
        self, env_cfg: EnvConfig, rollout: RolloutConfig, seed: int = 0,
        runner: VecRunner | None = None, deterministic: bool = False,
    ):  # fmt: skip
        super().__init__(env_cfg, seed, runner)
        self.groups, self.group_size = rollout.prompts_per_step, rollout.group_size
        self.deterministic = deterministic

    def next_specs(self, step: int) -> list[tuple[int, int, int]]:
        """(group id, task_id, trial_id) of every episode of this step, G per group."""
        specs = []
        for g in range(self.groups):
            task_id, trial_id = (int(x) for x in self.rng.integers(0, 10**6, size=2))
            gid = step * self.groups + g
            specs += [(gid, task_id, trial_id)] * self.group_size
        return specs

    def collect(self, policy, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """``prompts_per_step x group_size`` episodes -> (batch with [B] success rewards, metrics)."""
        t0 = time.perf_counter()
        queue = self.next_specs(step)
        rows, rewards, env_steps = self.run_episodes(policy, queue)
        order = sorted(range(len(rows)), key=lambda j: rows[j].spec)  # groups contiguous
        rows, rewards = [rows[j] for j in order], [rewards[j] for j in order]
        tokens, mask, _, inputs = make_rows(rows)
        batch = RolloutBatch(
            tokens=tokens, mask=mask, rewards=torch.tensor(rewards, dtype=torch.float32),
            group_id=torch.tensor([r.spec[0] for r in rows]), inputs=inputs,
            meta=[{"task_id": r.spec[1], "trial_id": r.spec[2]} for r in rows],
        )  # fmt: skip
        return batch, self._metrics(env_steps, time.perf_counter() - t0)

    def run_episodes(self, policy, queue: list) -> tuple[list[Episode], list[float], int]:
        """Run every (group, task_id, trial_id) in ``queue`` to its end, N envs at a time; an
        episode dropped by an env restart is re-queued. Returns (episodes, successes, env steps)."""
        run, queue = self.runner, list(queue)
        live: list[Episode | None] = [None] * run.n
        rows, rewards, env_steps = [], [], 0
        self._assign(live, queue, np.ones(run.n, bool))
        while any(ep is not None for ep in live):
            active = np.array([ep is not None for ep in live])
            obs = policy.observe(run.batch)
            action, _, _ = policy.act(obs, deterministic=self.deterministic)
            action = action.float().cpu()
            env_a = self._env_actions(action).copy()
            env_a[~active] = run.noop()[~active][:, None, :]  # idle envs wait for the others
            try:
                res = run.step(env_a)
            except EnvRestarted:
                queue = [ep.spec for ep in live if ep is not None] + queue
                live = [None] * run.n
                self._assign(live, queue, np.ones(run.n, bool))
                continue
            env_steps += int(res.env_steps[active].sum())
            ended = np.zeros(run.n, bool)
            for i in np.flatnonzero(active):
                ep = live[i]
                ep.add(obs, i, action[i], float(res.reward[i]), int(res.env_steps[i]))
                if res.terminated[i] or res.truncated[i]:
                    ok = bool(res.success[i]) or bool(res.terminated[i])
                    rows.append(ep)
                    rewards.append(float(ok))
                    self._finish(ep, ok)
                    live[i], ended[i] = None, True
            if ended.any():
                self._assign(live, queue, ended)
        return rows, rewards, env_steps

    def _assign(self, live: list, queue: list, free: np.ndarray) -> None:
        """Give the next queued initial states to the ``free`` envs and reset them."""
        take = np.zeros(len(live), bool)
        task_ids, trial_ids = [0] * len(live), [0] * len(live)
        for i in np.flatnonzero(free):
            if not queue:
                break
            spec = queue.pop(0)
            live[i] = Episode(spec=spec)
            task_ids[i], trial_ids[i] = spec[1], spec[2]
            take[i] = True
        if take.any():
            self.runner.reset(mask=take, options={"task_id": task_ids, "trial_id": trial_ids})
