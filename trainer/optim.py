"""The optimizer and learning-rate schedule every engine uses (one definition, so the torch and
DeepSpeed engines step the same AdamW along the same schedule)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from .config import TrainConfig


def lr_factor(cfg: TrainConfig) -> Callable[[int], float]:
    """The learning-rate multiplier at optimizer step ``s`` (``LambdaLR``): a linear warm-up over
    ``warmup_steps``, then constant or a cosine decay to ``min_lr_ratio`` at ``steps``."""
    warmup, total, floor = max(cfg.warmup_steps, 0), max(cfg.steps, 1), cfg.min_lr_ratio

    def factor(s: int) -> float:
        if warmup and s < warmup:
            return (s + 1) / warmup
        if cfg.lr_schedule != "cosine":
            return 1.0
        done = min(1.0, (s - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * done))

    return factor


def adamw(
    params: Iterable[torch.nn.Parameter], cfg: TrainConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` (``train.lr``, ``train.weight_decay``) and its `lr_factor` schedule."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
