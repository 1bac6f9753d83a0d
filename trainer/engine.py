"""Optimisation engines behind the loop: gradients in, a parameter update out.

An engine is built from the policy and ``train.*`` by the builder registered under its
``train.backend`` name in ``perceptrl.registry.ENGINES`` (`build_engine`): ``torch`` here
(`TorchEngine`: one process, AdamW, the schedule of trainer/optim.py, global-norm clipping) and
``deepspeed`` in deepspeed_engine.py (ZeRO-2/3, data parallel). Every engine has the methods of
`Engine`, so the loop never knows which one it drives. The side's builder builds the engine and
hands it to `Trainer` (see docs/architecture.md, "Decisions").
"""

from __future__ import annotations

import contextlib
import math
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from ..registry import ENGINES
from .config import TrainConfig
from .optim import adamw


class Engine(Protocol):
    """The seam between the loop and an optimisation engine. The data-parallel methods
    (``all_reduce_sum`` ... ``gathered_params``) and the checkpoint ones (``save_sharded``,
    ``export``) are identities in a single process."""

    rank: int
    world_size: int
    is_main: bool

    def backward(self, loss: Tensor) -> None:
        """Accumulate the gradient of ``loss`` (this rank's share of the minibatch loss)."""

    def step(self) -> tuple[float, bool]:
        """Apply the accumulated gradients: (pre-clip grad norm, whether the update happened)."""

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""

    @property
    def lr(self) -> float:
        """The current learning rate."""

    def state_dict(self) -> dict:
        """What the checkpoint's trainer state holds of the engine."""

    def restore(self, ckpt_dir: Path, state: dict, policy) -> None:
        """Resume weights, optimizer and schedule from checkpoint ``ckpt_dir``."""

    def all_reduce_sum(self, x: Tensor | float) -> Tensor:
        """Sum of ``x`` over ranks."""

    def all_true(self, flag: bool) -> bool:
        """True only when ``flag`` holds on every rank."""

    def barrier(self) -> None:
        """Wait for every rank."""

    def rollout_context(self) -> AbstractContextManager:
        """Weights ready for sampling and evaluation (ZeRO-3 gathers them)."""

    def gathered_params(self) -> AbstractContextManager:
        """Every parameter whole on every rank."""

    def save_sharded(self, ckpt_dir: Path) -> None:
        """Write what the engine keeps outside ``state_dict`` (per-rank partitions)."""

    def export(self, policy, path: Path) -> None:
        """Write the consolidated weights of ``policy`` to ``path``."""


def build_engine(policy, cfg: TrainConfig) -> Engine:
    """The engine of ``cfg.backend`` (``train.backend``) for ``policy``'s trainable weights."""
    return ENGINES.get(cfg.backend)(policy, cfg)


class TorchEngine:
    """One process: AdamW over the trainable ``params``, `lr_factor`'s schedule, clipping."""

    rank, world_size, is_main = 0, 1, True

    def __init__(self, params, cfg: TrainConfig):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the policy has no trainable parameters (all requires_grad=False)")
        self.cfg = cfg
        self.optimizer, self.scheduler = adamw(self.params, cfg)

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


@ENGINES.register("torch")
def torch_engine(policy, cfg: TrainConfig) -> TorchEngine:
    """``train.backend=torch``: a `TorchEngine` over the policy's parameters."""
    return TorchEngine(policy.parameters(), cfg)
