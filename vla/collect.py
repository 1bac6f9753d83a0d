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

Physics blow-ups: an episode the simulator cut with ``info["sim_unstable"]`` is not a time limit.
Its segment ends before the step that blew up (end ``"unstable"``), bootstrapped with the value
of the observation that step acted on, never from the env's restored initial state; the episode
counts in the episode metrics with what it achieved, in ``rollout/sim_unstable`` (run total) and
``rollout/sim_unstable_frac`` (this collection's share of ended episodes), and a collection where
more than `SIM_UNSTABLE_WARN` of the episodes blew up logs a warning naming the settings.

Resume: ``state_dict()`` holds the collector's RNG, the runner's counters and the episodes in
flight (every env's physics, layout, controller, RNG and time-limit count, the last
observations, and each episode's return, length and success so far), as tensors and plain
values (``torch.load(weights_only=True)`` reads them); ``load_state_dict`` continues those
episodes, so a resumed run collects exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import numpy as np
import torch

from ..trainer.batch import RolloutBatch
from .config import EnvConfig
from .envs import VecRunner
from .runner import END_NAMES, Actor, EpisodeRunner, Episodes, EpisodeSpecs

log = logging.getLogger(__name__)

SIM_UNSTABLE_WARN = 0.05
"""share of a collection's ended episodes cut by physics blow-ups above which it warns"""


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
        self.runner.counters.setdefault("sim_unstable", 0)

    def _record(self, ep: Episodes) -> None:
        """Add the episodes that ended to this collection's metrics."""
        self.stats["success"] += ep.success.astype(float).tolist()
        self.stats["return"] += ep.ret.tolist()
        self.stats["length"] += ep.length.tolist()
        self.stats["unstable"] += ep.unstable.astype(float).tolist()
        self.runner.counters["sim_unstable"] += int(ep.unstable.sum())
        self.episodes_done += len(ep.success)
        frac = float(ep.unstable.mean()) if len(ep.unstable) else 0.0
        if frac > SIM_UNSTABLE_WARN:
            cfg = self.env_cfg
            log.warning(
                "%d of %d episodes of %s ended in a physics blow-up (joint velocities above the "
                "env's max_qvel or MuJoCo's bad qpos/qvel/qacc warnings): they are cut without "
                "bootstrapping, but the policy is driving the simulation out of its stable range "
                "(env.control=%s, env.action_chunk=%d; check for actions saturated at +-1, or "
                "lower train.lr)", int(ep.unstable.sum()), len(ep.unstable), cfg.id, cfg.control,
                cfg.action_chunk,
            )  # fmt: skip

    def _metrics(self, env_steps: int, seconds: float) -> dict[str, float]:
        m = {
            "rollout/episodes": float(len(self.stats["success"])),
            "rollout/env_steps": float(env_steps),
            "rollout/env_steps_per_s": env_steps / max(seconds, 1e-9),
            **{f"rollout/{k}": float(v) for k, v in self.runner.counters.items()},
        }
        if self.stats["unstable"]:
            m["rollout/sim_unstable_frac"] = float(np.mean(self.stats["unstable"]))
        for key, name in (("success", "success_rate"), ("return", "episode_return")):
            if self.stats[key]:
                m[f"rollout/{name}"] = float(np.mean(self.stats[key]))
        if self.stats["length"]:
            m["rollout/episode_length"] = float(np.mean(self.stats["length"]))
        self.stats.clear()
        return m

    def state_dict(self) -> dict:
        """Resume state: RNG, counters and the episodes in flight (see the module docstring)."""
        return {
            "rng": self.rng.bit_generator.state,
            "counters": dict(self.runner.counters),
            "episodes_done": self.episodes_done,
            "in_flight": to_checkpoint(
                {"envs": self.runner.get_state(), "loop": self.loop.state_dict()}
            ),
        }

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.rng.bit_generator.state = state["rng"]
        self.runner.counters.update(state["counters"])
        self.episodes_done = state["episodes_done"]
        if "in_flight" not in state:  # written before episodes were checkpointed
            log.warning("the checkpoint holds no episodes in flight: they restart from resets")
            return
        flight = from_checkpoint(state["in_flight"])
        self.runner.set_state(flight["envs"])
        self.loop.load_state_dict(flight["loop"])

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
        actor = Actor.of(policy, lambda obs: _checked(policy.act(obs)), policy.value)
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


def to_checkpoint(x):
    """Numpy arrays -> tensors (and numpy scalars -> Python numbers, tuples -> lists), through
    dicts and lists: what ``torch.load(weights_only=True)`` reads back."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.array(x))
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {k: to_checkpoint(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_checkpoint(v) for v in x]
    return x


def from_checkpoint(x):
    """The inverse of `to_checkpoint` (tensors -> numpy arrays)."""
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, dict):
        return {k: from_checkpoint(v) for k, v in x.items()}
    if isinstance(x, list):
        return [from_checkpoint(v) for v in x]
    return x


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
        res = self.loop.episodes(Actor.of(policy, act), specs)
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
