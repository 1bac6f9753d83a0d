"""Optimisation engines behind the loop: gradients in, a parameter update out.

`TorchEngine` is the single-process engine (AdamW, warm-up, global-norm clipping). A DeepSpeed
ZeRO engine exposes the same five methods, so the loop never knows which one it drives.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .config import TrainConfig


class TorchEngine:
    def __init__(self, params, cfg: TrainConfig):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the policy has no trainable parameters (all requires_grad=False)")
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        warmup = max(cfg.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> tuple[float, bool]:
        """Clip and apply the accumulated gradients.

        Returns:
            (grad_norm, stepped): the pre-clip global norm, and False when the norm was not
            finite, in which case the gradients are dropped and the weights are left untouched.
        """
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = float(nn.utils.clip_grad_norm_(self.params, max_norm))
        if not math.isfinite(norm):
            self.zero_grad()
            return norm, False
        self.optimizer.step()
        self.scheduler.step()
        self.zero_grad()
        return norm, True

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
