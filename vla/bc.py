"""Behaviour cloning from the sim's scripted experts, as an SFT source for ``trainer.sft``.

`ExpertSource` drives the runner's envs with ``sim.expert.ScriptedExpert`` (privileged state,
closed loop) and yields `RolloutBatch`es laid out as the PPO collector's: ``tokens`` are the
expert's actions [B, T, A], ``inputs`` the policy's observations. For a Gaussian policy the SFT
loss (token-mean ``-logp``) is the behaviour-cloning negative log-likelihood. Demonstrations are
generated fresh for every batch (an unlimited stream, no dataset on disk).
"""

from __future__ import annotations

import numpy as np
import torch

from ..sim.expert import ScriptedExpert
from ..trainer.batch import RolloutBatch
from .envs import VecRunner
from .runner import Actor, EpisodeRunner


class ExpertSource:
    """``next_batch(step)``: ``batch_steps`` expert steps of every env of ``runner``.

    Args:
        policy: provides ``observe(sim_batch) -> obs tensors`` (its input layout).
        runner: a synchronous `VecRunner` with ``control="ee"`` (the experts' action space).
        batch_steps: env steps per env per batch.
    """

    def __init__(self, policy, runner: VecRunner, batch_steps: int = 64):
        if runner.cfg.async_envs:
            raise ValueError(
                "behaviour cloning reads the envs' privileged state in-process; set "
                "env.async_envs=false for `perceptrl sft` on the VLA side"
            )
        if runner.cfg.action_chunk != 1:
            raise ValueError(
                "behaviour cloning from the closed-loop experts needs env.action_chunk=1"
            )
        self.policy, self.runner, self.batch_steps = policy, runner, batch_steps
        self.experts: list[ScriptedExpert | None] = [None] * runner.n
        self.loop = EpisodeRunner(runner, on_reset=self._reset_experts)

    def _reset_experts(self, mask: np.ndarray) -> None:
        """The envs in ``mask`` [N] started an episode: a fresh expert phase (a new expert
        when the env itself is new, after a restart)."""
        envs = self.runner.envs
        for i in np.flatnonzero(mask):
            ex = self.experts[i]
            if ex is None or ex.env is not envs[i].unwrapped:
                self.experts[i] = ScriptedExpert(envs[i])
            else:
                ex.reset()

    def _act(self, obs: dict) -> tuple[torch.Tensor, None, None]:
        """The experts' actions [N, A] (they read the envs' state, not ``obs``)."""
        return torch.from_numpy(np.stack([ex.act() for ex in self.experts])), None, None

    def next_batch(self, step: int) -> RolloutBatch:
        """Expert demonstrations -> batch with the expert actions as targets."""
        rows = self.loop.horizon(Actor(self.policy.observe, self._act), self.batch_steps).rows
        return RolloutBatch(
            tokens=rows.actions, mask=rows.mask, group_id=torch.arange(len(rows)),
            rewards=rows.rewards, inputs=rows.inputs,
        )  # fmt: skip
