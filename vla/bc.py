"""Behaviour cloning from the sim's scripted experts, as an SFT source for ``trainer.sft``.

`ExpertSource` drives the runner's envs with ``sim.expert.ScriptedExpert`` (privileged state,
closed loop) and yields `RolloutBatch`es laid out as the PPO collector's: ``tokens`` are the
expert's actions [B, T, K*A], ``inputs`` the policy's observations. For a Gaussian policy the SFT
loss (token-mean ``-logp``) is the behaviour-cloning negative log-likelihood; a flow head
minimises its flow-matching loss on the same targets. Demonstrations are generated fresh for
every batch (an unlimited stream, no dataset on disk).

Chunked policies (K actions per policy step): the expert still acts every env step (the runner
steps with ``action_chunk=1``); the target at step t is the expert's next K actions t .. t+K-1
of the same episode, the last action repeated past an episode's end. Steps whose chunk would
run past the batch's horizon (the episode goes on in the next batch) are dropped.
"""

from __future__ import annotations

import numpy as np
import torch

from ..sim.expert import ScriptedExpert
from ..sim.vector import VecEnv
from ..trainer.batch import RolloutBatch
from .episode_runner import CUT, Actor, EpisodeRunner, Rows


class Experts:
    """One ``sim.expert.ScriptedExpert`` per env of ``runner`` (in-process envs: the experts
    read their privileged state); `reset` is an `EpisodeRunner`'s ``on_reset``, `act` an
    `Actor`'s ``act`` (the experts act every env step, in ``control="ee"``)."""

    def __init__(self, runner: VecEnv):
        if runner.async_:
            raise ValueError(
                "the scripted experts read the envs' privileged state in-process; set "
                "env.async_envs=false for `perceptrl sft` on the VLA side"
            )
        self.runner = runner
        self.experts: list[ScriptedExpert | None] = [None] * runner.n

    def reset(self, mask: np.ndarray) -> None:
        """The envs in ``mask`` [N] started an episode: a fresh expert phase (a new expert
        when the env itself is new, after a restart)."""
        envs = self.runner.envs
        for i in np.flatnonzero(mask):
            ex = self.experts[i]
            if ex is None or ex.env is not envs[i].unwrapped:
                self.experts[i] = ScriptedExpert(envs[i])
            else:
                ex.reset()

    def act(self, obs: dict) -> tuple[torch.Tensor, None, None]:
        """The experts' actions [N, A] (they read the envs' state, not ``obs``)."""
        return torch.from_numpy(np.stack([ex.act() for ex in self.experts])), None, None


class ExpertSource:
    """``next_batch(step)``: ``batch_steps`` expert steps of every env of ``runner``.

    Args:
        policy: provides ``observe(sim_batch) -> obs tensors`` (its input layout).
        runner: in-process envs (`sim.vector.VecEnv`) with ``control="ee"`` (the experts'
            action space); the experts act every env step (one action per step, whatever the
            policy's chunk: targets of K actions come from ``chunk``).
        batch_steps: env steps per env per batch.
        chunk: K, actions per target (the policy's action chunk).
    """

    def __init__(self, policy, runner: VecEnv, batch_steps: int = 64, chunk: int = 1):
        if chunk < 1 or batch_steps < chunk:
            raise ValueError(
                f"BC targets of chunk={chunk} need 1 <= chunk <= batch_steps={batch_steps}"
            )
        self.experts = Experts(runner)
        self.policy, self.runner, self.batch_steps, self.chunk = policy, runner, batch_steps, chunk
        self.loop = EpisodeRunner(runner, on_reset=self.experts.reset)

    def next_batch(self, step: int) -> RolloutBatch:
        """Expert demonstrations -> batch with the expert actions as targets."""
        rows = self.loop.horizon(
            Actor(self.policy.observe, self.experts.act), self.batch_steps
        ).rows
        if self.chunk == 1:
            tokens, mask, rewards, inputs = rows.actions, rows.mask, rows.rewards, rows.inputs
        else:
            tokens, mask, rewards, inputs = chunk_targets(rows, self.chunk)
        return RolloutBatch(
            tokens=tokens, mask=mask, group_id=torch.arange(len(rows)), rewards=rewards,
            inputs=inputs,
        )  # fmt: skip


def chunk_targets(rows: Rows, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Per-step expert actions -> targets of the next K actions (see the module docstring):
    (tokens [B, T', K*A], mask [B, T'], rewards [B, T'], inputs cut to the kept steps)."""
    lens = rows.mask.sum(1).long()  # (B,)
    cut = torch.from_numpy(rows.end == CUT)
    keep = torch.where(cut, (lens - K + 1).clamp(min=0), lens)  # (B,) steps with a whole chunk
    T = int(keep.max()) if len(keep) else 0
    t = torch.arange(T)
    idx = (t[None, :, None] + torch.arange(K)[None, None]).minimum(
        (lens - 1).clamp(min=0)[:, None, None]
    )
    B, _, A = rows.actions.shape
    tokens = rows.actions.gather(1, idx.reshape(B, T * K, 1).expand(B, T * K, A)).reshape(
        B, T, K * A
    )
    mask = (t[None] < keep[:, None]).float()
    tokens = tokens * mask[..., None]
    inputs = {k: [x[:n] for x, n in zip(v, keep.tolist())] for k, v in rows.inputs.items()}
    return tokens, mask, rows.rewards[:, :T] * mask, inputs
