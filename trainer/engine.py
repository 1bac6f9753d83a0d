"""Optimisation engines behind the loop: gradients in, a parameter update out.

`TorchEngine` is the single-process engine (AdamW, warm-up and `lr_factor`'s schedule,
global-norm clipping).
`DeepSpeedEngine` (deepspeed_engine.py, ZeRO-2/3, data parallel) exposes the same methods, so
the loop never knows which one it drives: ``backward``, ``step``, ``zero_grad``, ``lr``,
``state_dict``/``restore``, plus the data-parallel seam (``world_size``, ``is_main``,
``all_reduce_sum``, ``all_true``, ``barrier``, ``rollout_context``) and the checkpoint seam
(``save_sharded``, ``export``), which are identities in a single process.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

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


class TorchEngine:
    rank, world_size, is_main = 0, 1, True

    def __init__(self, params, cfg: TrainConfig):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the policy has no trainable parameters (all requires_grad=False)")
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(cfg))

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

    def restore(self, ckpt_dir: Path, state: dict, policy) -> None:
        """Resume from checkpoint ``ckpt_dir``: the policy's weights in place (``model/``), then
        the optimizer and scheduler from ``state`` (what ``state_dict`` wrote)."""
        if "optimizer" not in state:
            raise ValueError(
                f"this checkpoint was written by the {state.get('backend', '?')} backend; resume "
                "it with the same train.backend and launch, or start a new run from its model/ "
                "directory (model.path=<checkpoint>/model)"
            )
        policy.load(Path(ckpt_dir) / "model")  # same parameter tensors: the optimizer stays valid
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    # ---- data-parallel and checkpoint seam (single process: identities) ----------------------

    def all_reduce_sum(self, x: Tensor | float) -> Tensor:
        return torch.as_tensor(x)

    def all_true(self, flag: bool) -> bool:
        return flag

    def barrier(self) -> None:
        pass

    def rollout_context(self):
        return contextlib.nullcontext()

    def gathered_params(self):
        return contextlib.nullcontext()

    def save_sharded(self, ckpt_dir: Path) -> None:
        pass  # everything is in state_dict()

    def export(self, policy, path: Path) -> None:
        policy.save(path)


def policy_module(policy) -> nn.Module:
    """The ``nn.Module`` that holds a policy's weights: ``policy.model`` (VLM) or the policy."""
    module = getattr(policy, "model", policy)
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{type(policy).__name__} exposes no nn.Module (neither a .model attribute nor a "
            "module itself); the DeepSpeed backend needs one to partition"
        )
    return module


def build_engine(policy, cfg: TrainConfig):
    """``train.backend``: ``torch`` (one process) or ``deepspeed`` (ZeRO ``train.zero_stage``)."""
    if cfg.backend == "torch":
        return TorchEngine(policy.parameters(), cfg)
    if cfg.backend == "deepspeed":
        from .deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(policy_module(policy), cfg)
    raise ValueError(f"unknown train.backend {cfg.backend!r}; valid: torch, deepspeed")
