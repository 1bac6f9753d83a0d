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

`GRPOCollector` runs ``groups`` groups of ``group_size`` whole episodes;
the episodes of a group start from the same indexed initial state (reset options ``task_id`` /
``trial_id``) and share a ``group_id``; the sequence reward is success (0/1), so the trainer's
``algo.dynamic_sampling`` drops groups that all succeed or all fail.

Both configure the one episode loop, `vla.runner.EpisodeRunner` (fixed [T, N] buffers and masks,
the success rule, initial-state ids); this module only turns its rows into `RolloutBatch`es and
keeps the metrics and resume state.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import torch

from ..trainer.batch import RolloutBatch
from .config import EnvConfig
from .envs import VecRunner
from .runner import END_NAMES, Actor, EpisodeRunner, Episodes, EpisodeSpecs


class _Base:
    """Shared bookkeeping: runner, episode stats, counters, resume state."""

    def __init__(self, env_cfg: EnvConfig, seed: int = 0, runner: VecRunner | None = None):
        self.env_cfg = env_cfg
        self.seed = seed
        self.runner = runner or VecRunner(env_cfg, seed=seed)
        self.loop = EpisodeRunner(self.runner)
        self.rng = np.random.default_rng(seed)
        self.stats: dict[str, list] = defaultdict(list)
        self.episodes_done = 0

    def _record(self, ep: Episodes) -> None:
        """Add the episodes that ended to this collection's metrics."""
        self.stats["success"] += ep.success.astype(float).tolist()
        self.stats["return"] += ep.ret.tolist()
        self.stats["length"] += ep.length.tolist()
        self.episodes_done += len(ep.success)

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

    def collect(self, policy, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """``env.steps_per_rollout`` policy steps of every env -> (batch, metrics)."""
        t0 = time.perf_counter()
        if not callable(getattr(policy, "value", None)):
            raise TypeError(
                f"PPO collection bootstraps from the critic through policy.value(obs) -> [N]; "
                f"{type(policy).__name__} has none. Use a group estimator (grpo, rloo, ...) for "
                "a policy without a critic"
            )
        actor = Actor(policy.observe, lambda obs: _checked(policy.act(obs)), policy.value)
        res = self.loop.horizon(actor, self.env_cfg.steps_per_rollout)
        rows = res.rows
        batch = RolloutBatch(
            tokens=rows.actions, mask=rows.mask, group_id=torch.arange(len(rows)),
            rewards=rows.rewards, logp_old=rows.logp, values_old=rows.value,
            bootstrap_value=rows.bootstrap, inputs=rows.inputs,
            meta=[{"length": n, "end": END_NAMES[e]} for n, e in zip(rows.lengths(), rows.end)],
        )  # fmt: skip
        self._record(res.episodes)
        return batch, self._metrics(res.env_steps, time.perf_counter() - t0)


def _checked(out: tuple) -> tuple:
    """``policy.act``'s (action, logp, value), stopped when the critic is not finite."""
    if not torch.isfinite(out[2]).all():
        raise ValueError(
            "the policy's critic returned NaN/inf values while collecting PPO "
            "experience. With vla.critic=state the env must give the true poses: set "
            "env.privileged_state=true; otherwise the critic diverged (lower train.lr, "
            "or resume from an earlier checkpoint)"
        )
    return out


class GRPOCollector(_Base):
    """Groups of whole episodes from shared indexed initial states; see the module docstring.

    Args:
        groups: groups (distinct initial states) per collection.
        group_size: episodes per group (G).
        deterministic: act with the policy's mean / greedy actions instead of sampling.
    """

    def __init__(
        self, env_cfg: EnvConfig, groups: int, group_size: int, seed: int = 0,
        runner: VecRunner | None = None, deterministic: bool = False,
    ):  # fmt: skip
        super().__init__(env_cfg, seed, runner)
        if groups < 1 or group_size < 1:
            raise ValueError(
                f"GRPOCollector needs groups >= 1 and group_size >= 1; got {groups} x "
                f"{group_size} (rollout.prompts_per_step x rollout.group_size)"
            )
        self.groups, self.group_size = groups, group_size
        self.deterministic = deterministic

    def next_specs(self, step: int) -> EpisodeSpecs:
        """The initial states of this step's ``groups x group_size`` episodes, G per group;
        group ids ``step * groups + g``."""
        draws = [self.rng.integers(0, 10**6, size=2) for _ in range(self.groups)]
        ids = np.asarray(draws, np.int64).reshape(self.groups, 2)  # (groups, [task, trial])
        rep = lambda x: np.repeat(x, self.group_size)  # noqa: E731
        gids = step * self.groups + np.arange(self.groups)
        return EpisodeSpecs.indexed(rep(gids), rep(ids[:, 0]), rep(ids[:, 1]))

    def collect(self, policy, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """``groups x group_size`` episodes -> (batch with [B] success rewards, metrics)."""
        t0 = time.perf_counter()
        specs = self.next_specs(step)
        act = lambda obs: policy.act(obs, deterministic=self.deterministic)  # noqa: E731
        res = self.loop.episodes(Actor(policy.observe, act), specs)
        rows = res.rows
        rows = rows.select(np.argsort(specs.group[rows.spec], kind="stable"))  # groups contiguous
        batch = RolloutBatch(
            tokens=rows.actions, mask=rows.mask, inputs=rows.inputs,
            rewards=torch.from_numpy(rows.success.astype(np.float32)),
            group_id=torch.from_numpy(specs.group[rows.spec]),
            meta=[{"task_id": int(specs.task_id[j]), "trial_id": int(specs.trial_id[j])}
                  for j in rows.spec],
        )  # fmt: skip
        self._record(res.episodes)
        return batch, self._metrics(res.env_steps, time.perf_counter() - t0)
