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

Both configure the one episode loop, `vla.episode_runner.EpisodeRunner` (fixed [T, N] buffers and masks,
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

import dataclasses
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from ..sim.vector import VecEnv
from ..trainer.batch import RolloutBatch
from ..trainer.segments import POLICY, Segments
from .config import EnvConfig
from .envs import make_envs
from .episode_runner import END_NAMES, Actor, EpisodeRunner, Episodes, EpisodeSpecs
from .records import describe_group

log = logging.getLogger(__name__)

SIM_UNSTABLE_WARN = 0.05
"""share of a collection's ended episodes cut by physics blow-ups above which it warns"""


class _Base:
    """Shared bookkeeping: runner, episode stats, counters, resume state."""

    def __init__(self, env_cfg: EnvConfig, seed: int = 0, runner: VecEnv | None = None):
        self.env_cfg = env_cfg
        self.seed = seed
        self.runner = runner or make_envs(env_cfg, seed=seed)
        self.loop = EpisodeRunner(self.runner, chunk=env_cfg.action_chunk)
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

    def describe_group(self, policy, batch: RolloutBatch, rows: list[int]):
        """The rollout record's fields of one group (vla/records.py)."""
        return describe_group(self.env_cfg.id, batch, rows)

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
        runner: VecEnv | None = None, deterministic: bool = False,
        branches: list[int] | None = None, segment_steps: int = 8,
    ):  # fmt: skip
        branches = list(branches or [])
        if branches and (any(b < 1 for b in branches) or math.prod(branches) != group_size):
            raise ValueError(
                f"rollout.tree.branches={branches} must be positive with product "
                f"rollout.group_size={group_size}"
            )
        super().__init__(env_cfg, seed, runner)
        if groups < 1 or group_size < 1:
            raise ValueError(
                f"GRPOCollector needs groups >= 1 and group_size >= 1; got {groups} x "
                f"{group_size} (rollout.prompts_per_step x rollout.group_size)"
            )
        self.groups, self.group_size = groups, group_size
        self.deterministic = deterministic
        self.branches, self.segment_steps = branches, segment_steps
        if self.branches:
            if segment_steps < 1:
                raise ValueError(f"rollout.tree.segment_tokens={segment_steps}: a VLA tree's "
                                 "segments are policy steps; need >= 1")  # fmt: skip

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
        if self.branches:
            return self._collect_tree(policy, step)
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
            meta=[{"task_id": int(specs.task_id[j]), "trial_id": int(specs.trial_id[j]),
                   "end": END_NAMES[e]} for j, e in zip(rows.spec, rows.end)],
        )  # fmt: skip
        self._record(res.episodes)
        return batch, self._metrics(res.env_steps, time.perf_counter() - t0)

    # ------------------------------------------------------------------ trees
    def _collect_tree(self, policy, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Each group is a tree of episodes from its indexed initial state: a node runs
        ``segment_steps`` policy steps, then its simulator state is snapshotted and continued by
        ``branches[d]`` children (one env each; the last depth runs to the episode's end). A
        node whose episode ends early is a leaf, and the leaves it would have had go to the
        group's nodes still running (TreePO's fallback), so a group keeps ``group_size`` leaves
        while any branch runs. Every leaf is a row: its ancestors' steps then its own, with
        ``segments`` [B, T] naming each step's node (the tree estimators read it; shared steps
        sum their leaves' gradients). Reward: the leaf's success."""
        t0 = time.perf_counter()
        act = lambda obs: policy.act(obs, deterministic=self.deterministic)  # noqa: E731
        actor = Actor.of(policy, act)
        roots = self.next_specs(step)
        keep = np.arange(0, len(roots), self.group_size)  # one root per group
        specs = EpisodeSpecs.indexed(roots.group[keep], roots.task_id[keep], roots.trial_id[keep])
        # node bookkeeping: parent, group, leaf budget, and its segment (level, row)
        nodes = [_Node(None, int(g), self.group_size, meta={"task_id": int(a), "trial_id": int(b)})
                 for g, a, b in zip(specs.group, specs.task_id, specs.trial_id)]  # fmt: skip
        level_nodes = list(range(len(nodes)))
        levels: list = []
        env_steps, episodes = 0, []
        for depth in range(len(self.branches) + 1):
            last = depth == len(self.branches)  # the leaves' segments run to the episode's end
            res = self.loop.episodes(actor, specs, max_steps=0 if last else self.segment_steps)
            env_steps += res.env_steps
            episodes.append(res.episodes)
            levels.append(res.rows)
            for r, (j, ok) in enumerate(zip(res.rows.spec.tolist(), res.rows.success.tolist())):
                nodes[level_nodes[j]].segment, nodes[level_nodes[j]].success = (depth, r), ok
            if last:
                break
            stopped = dict(res.cut)  # spec index -> snapshot at the branch point
            ended = [level_nodes[j] for j in res.episodes.spec.tolist()]
            _give_back(nodes, ended, [level_nodes[j] for j in stopped])
            children, states, groups = [], [], []
            for j, snap in stopped.items():
                parent = nodes[level_nodes[j]]
                # the last fork turns the whole budget into leaves (G leaves per group)
                k = parent.budget if depth == len(self.branches) - 1 else self.branches[depth]
                for share in _split(parent.budget, min(k, parent.budget)):
                    nodes.append(_Node(level_nodes[j], parent.group, share, meta=parent.meta))
                    children.append(len(nodes) - 1)
                    states.append(snap)
                    groups.append(parent.group)
            if not children:
                break
            specs = EpisodeSpecs.branched(groups, states)
            level_nodes = children
        self._record(_concat_episodes(episodes))
        batch = self._tree_batch(nodes, levels)
        return batch, self._metrics(env_steps, time.perf_counter() - t0)

    def _tree_batch(self, nodes: list[_Node], levels: list) -> RolloutBatch:
        """One row per leaf: its path's segments concatenated (see `_collect_tree`)."""
        parents = {n.parent for n in nodes if n.parent is not None}
        leaves = [i for i, n in enumerate(nodes) if i not in parents and n.segment is not None]
        leaves.sort(key=lambda i: (nodes[i].group, i))
        tokens, seg_ids, inputs = [], [], {}
        for i in leaves:
            path, j = [], i
            while j is not None:
                path.append(j)
                j = nodes[j].parent
            parts = []  # (node, its depth's Rows, row, valid steps), root first
            for j in reversed(path):
                depth, r = nodes[j].segment
                parts.append((j, levels[depth], r, int(levels[depth].mask[r].sum())))
            tokens.append(torch.cat([R.actions[r, :n] for _, R, r, n in parts]))
            seg_ids.append(torch.cat([torch.full((n,), j + 1) for j, _, _, n in parts]))
            for key in levels[0].inputs:
                inputs.setdefault(key, []).append(
                    torch.cat([R.inputs[key][r] for _, R, r, _ in parts])
                )
        lens = torch.tensor([len(t) for t in tokens])
        mask = (torch.arange(int(lens.max()))[None] < lens[:, None]).float()
        group = torch.tensor([nodes[i].group for i in leaves])
        return RolloutBatch(
            tokens=pad_sequence(tokens, batch_first=True), mask=mask, inputs=inputs,
            rewards=torch.tensor([float(nodes[i].success) for i in leaves]), group_id=group,
            segments=Segments.from_tokens(
                pad_sequence(seg_ids, batch_first=True), mask.long() * POLICY, group, True
            ),
            meta=[dict(nodes[i].meta) for i in leaves],
        )  # fmt: skip


@dataclass
class _Node:
    """A node of a VLA tree: one segment of policy steps (see `GRPOCollector._collect_tree`)."""

    parent: int | None
    group: int
    budget: int
    """leaves this node's subtree must produce"""
    meta: dict = field(default_factory=dict)
    segment: tuple[int, int] | None = None
    """(depth, row of that depth's `Rows`)"""
    success: bool = False


def _split(total: int, k: int) -> list[int]:
    """``total`` leaves over ``k`` children as evenly as possible (the first get the extra)."""
    return [total // k + (c < total % k) for c in range(k)]


def _give_back(nodes: list[_Node], ended: list[int], running: list[int]) -> None:
    """Nodes whose episode ended are leaves: the rest of their leaf budget goes to the running
    nodes of the same group, one at a time round-robin (TreePO's fallback)."""
    by_group: dict[int, list[int]] = defaultdict(list)
    for j in running:
        by_group[nodes[j].group].append(j)
    turn: dict[int, int] = defaultdict(int)
    for j in ended:
        extra, g = nodes[j].budget - 1, nodes[j].group
        nodes[j].budget = 1
        live = by_group.get(g)
        for _ in range(extra if live else 0):
            nodes[live[turn[g] % len(live)]].budget += 1
            turn[g] += 1


def _concat_episodes(parts: list[Episodes]) -> Episodes:
    """The episodes that ended in several runs, in order."""
    return Episodes(*(np.concatenate([getattr(p, f.name) for p in parts])
                      for f in dataclasses.fields(Episodes)))  # fmt: skip
