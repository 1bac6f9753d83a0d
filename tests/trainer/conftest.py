"""A tiny but real policy and rollout source for exercising the loop without a big model.

`ToySeqPolicy` is a factorised categorical policy over ``T`` positions × ``V`` choices (with an
optional value head); `ToySource` samples ``G`` sequences per group from it and rewards the
fraction of positions that hit a target token. GRPO/PPO should drive the reward to ~1.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from perceptrl.trainer.batch import RolloutBatch
from perceptrl.trainer.policy import Evaluation
from perceptrl.wiring import Config


class ToySeqPolicy(nn.Module):
    def __init__(self, T: int = 4, V: int = 5, value_head: bool = False):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(T, V))
        self.value = nn.Parameter(torch.zeros(T)) if value_head else None
        self.has_critic = value_head

    def evaluate(self, batch: RolloutBatch) -> Evaluation:
        B, T = batch.tokens.shape
        lp = torch.log_softmax(self.logits[:T], dim=-1)  # (T, V)
        logp = lp.unsqueeze(0).expand(B, T, -1).gather(-1, batch.tokens.unsqueeze(-1)).squeeze(-1)
        entropy = -(lp.exp() * lp).sum(-1).unsqueeze(0).expand(B, T)
        value = self.value[:T].unsqueeze(0).expand(B, T) if self.value is not None else None
        return Evaluation(logp, entropy, value)

    def save(self, path):
        path.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().contiguous() for k, v in self.state_dict().items()},
            path / "model.safetensors",
        )

    def load(self, path):
        self.load_state_dict(load_file(path / "model.safetensors"))


class ToySource:
    """Samples with the global torch RNG (so checkpoints must restore it to resume exactly)."""

    def __init__(self, groups: int = 4, group_size: int = 4, target: int = 2, ragged: bool = True):
        self.groups, self.group_size, self.target, self.ragged = groups, group_size, target, ragged
        self.calls = 0

    def collect(self, policy, step):
        self.calls += 1
        B = self.groups * self.group_size
        T = policy.logits.shape[0]
        probs = torch.softmax(policy.logits.detach(), -1)  # (T, V)
        tokens = torch.multinomial(probs.repeat(B, 1), 1).view(B, T)
        lengths = torch.randint(1, T + 1, (B,)) if self.ragged else torch.full((B,), T)
        mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
        hits = ((tokens == self.target).float() * mask).sum(1)
        rewards = hits / lengths.float()
        group_id = torch.arange(self.groups).repeat_interleave(self.group_size)
        batch = RolloutBatch(tokens=tokens, mask=mask, group_id=group_id, rewards=rewards)
        return batch, {"reward/hit": float(rewards.mean())}

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def toy_config(**train) -> Config:
    cfg = Config()
    cfg.train.lr = 0.1
    cfg.train.steps = 5
    cfg.train.micro_batch_size = 4
    cfg.log.progress = False
    cfg.log.tensorboard = False
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


@pytest.fixture
def toy():
    """(ToySeqPolicy, ToySource, toy_config) constructors."""
    return ToySeqPolicy, ToySource, toy_config
