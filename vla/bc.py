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
from .collect import Episode, make_rows
from .envs import VecRunner


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
        self.experts: list[ScriptedExpert] = []
        self.live: list[Episode] = []
        self.successes: list[float] = []

    def _start(self) -> None:
        self.runner.reset()
        self.experts = [ScriptedExpert(e) for e in self.runner.env.env.envs]
        self.live = [Episode() for _ in self.experts]

    def next_batch(self, step: int) -> RolloutBatch:
        """Expert demonstrations -> batch with the expert actions as targets."""
        if not self.live:
            self._start()
        run, rows = self.runner, []
        for _ in range(self.batch_steps):
            obs = self.policy.observe(run.batch)
            actions = np.stack([ex.act() for ex in self.experts])  # (N, A)
            res = run.step(actions[:, None, :])
            for i, ep in enumerate(self.live):
                ep.add(obs, i, torch.from_numpy(actions[i]), float(res.reward[i]), 1)
            ended = res.terminated | res.truncated
            for i in np.flatnonzero(ended):
                rows.append(self.live[i])
                self.successes.append(float(res.success[i] or res.terminated[i]))
                self.live[i] = Episode()
            if ended.any():
                run.reset(mask=ended)
                for i in np.flatnonzero(ended):
                    self.experts[i].reset()
        for i, ep in enumerate(self.live):
            if ep.actions:
                rows.append(ep)
                self.live[i] = ep.cut()
        tokens, mask, rewards, inputs = make_rows(rows)
        return RolloutBatch(
            tokens=tokens, mask=mask, group_id=torch.arange(len(rows)), rewards=rewards,
            inputs=inputs,
        )  # fmt: skip
