"""`RolloutBatch`: the one container that flows from a rollout source through the trainer.

Both sides fill it. For a VLM, ``T`` is completion tokens and ``tokens`` holds their ids; for a
VLA, ``T`` is policy steps (or action tokens) and ``tokens`` holds the actions. Whatever a policy
needs to re-run its forward pass (prompt ids, pixel values, observations) lives in ``inputs``:
each value is either a batch-first tensor or a list with one entry per sample, so that slicing a
minibatch never needs to know the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    tokens: Tensor
    """[B, T] completion token ids (VLM) or [B, T, ...] actions (VLA)."""
    mask: Tensor
    """[B, T] float, 1 for tokens/steps that count in the loss, 0 for padding."""
    group_id: Tensor
    """[B] long; samples with the same id share a prompt / initial state (GRPO groups)."""
    rewards: Tensor | None = None
    """[B] sequence reward, or [B, T] per-step rewards (VLA PPO)."""
    logp_old: Tensor | None = None
    """[B, T] log-probs of the behaviour policy: from the training-side forward before the update,
    or filled by a source whose policy acted with the current parameters (VLA PPO collector)."""
    logp_ref: Tensor | None = None
    """[B, T] log-probs under the frozen reference policy (KL)."""
    logp_rollout: Tensor | None = None
    """[B, T] log-probs reported by the rollout engine (for truncated importance sampling)."""
    values_old: Tensor | None = None
    """[B, T] critic values at rollout time (GAE, value clipping); set by the trainer, or by the
    source together with ``logp_old``."""
    bootstrap_value: Tensor | None = None
    """[B] value of the state after the last step when an episode was truncated, else 0."""
    advantages: Tensor | None = None
    """[B, T] filled in by the trainer."""
    returns: Tensor | None = None
    """[B, T] filled in by the trainer (value targets)."""
    inputs: dict[str, Any] = field(default_factory=dict)
    """Policy-specific forward inputs: batch-first tensors or per-sample lists."""
    meta: list[dict] = field(default_factory=list)
    """Per-sample metadata (answers, task ids, completion text ...), never sent to a device."""

    def __len__(self) -> int:
        return int(self.group_id.shape[0])

    def _map(self, fn_tensor, fn_list) -> RolloutBatch:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "inputs":
                out["inputs"] = {
                    k: fn_tensor(x) if isinstance(x, Tensor) else fn_list(x) for k, x in v.items()
                }
            elif f.name == "meta":
                out["meta"] = fn_list(v) if v else []
            else:
                out[f.name] = fn_tensor(v) if isinstance(v, Tensor) else v
        return RolloutBatch(**out)

    def select(self, idx: Tensor | list[int]) -> RolloutBatch:
        """Rows ``idx`` of every batch-first field (tensors and per-sample lists)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        idx_l = idx_t.tolist()
        return self._map(
            lambda t: t[idx_t.to(t.device)],
            lambda xs: [xs[i] for i in idx_l],
        )

    def to(self, device: torch.device | str) -> RolloutBatch:
        """Move tensors (including tensors inside per-sample lists of ``inputs``) to ``device``."""

        def move_list(xs):
            return [x.to(device) if isinstance(x, Tensor) else x for x in xs]

        moved = self._map(lambda t: t.to(device), move_list)
        moved.meta = self.meta  # metadata stays on the host untouched
        return moved

    def split(self, size: int) -> list[RolloutBatch]:
        """Consecutive chunks of at most ``size`` rows."""
        n = len(self)
        return [self.select(list(range(i, min(i + size, n)))) for i in range(0, n, size)]

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Stack batches row-wise; tensors along dim 0 (right-padded to the longest ``T``)."""
        if len(batches) == 1:
            return batches[0]
        out = {}
        for f in dataclasses.fields(RolloutBatch):
            vals = [getattr(b, f.name) for b in batches]
            if f.name == "inputs":
                keys = vals[0].keys()
                out["inputs"] = {k: _cat([v[k] for v in vals]) for k in keys}
            elif f.name == "meta":
                out["meta"] = [m for v in vals for m in v]
            elif vals[0] is None:
                out[f.name] = None
            else:
                out[f.name] = _cat(vals)
        return RolloutBatch(**out)


def _cat(vals: list) -> Any:
    if isinstance(vals[0], list):
        return [x for v in vals for x in v]
    if vals[0].dim() >= 2 and len({v.shape[1] for v in vals}) > 1:
        width = max(v.shape[1] for v in vals)
        vals = [torch.nn.functional.pad(v, _pad_spec(v, width)) for v in vals]
    return torch.cat(vals, dim=0)


def _pad_spec(v: Tensor, width: int) -> list[int]:
    """F.pad spec that right-pads dim 1 of ``v`` to ``width`` (dims after 1 untouched)."""
    spec = [0, 0] * (v.dim() - 2)
    return spec + [0, width - v.shape[1]]
