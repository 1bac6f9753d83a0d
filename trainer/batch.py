"""`RolloutBatch`: the one container that flows from a rollout source through the trainer.

Both sides fill it. For a VLM, ``T`` is completion tokens and ``tokens`` holds their ids; for a
VLA, ``T`` is policy steps (or action tokens) and ``tokens`` holds the actions. Whatever a policy
needs to re-run its forward pass lives in ``inputs`` (per row) or ``prompts`` (shared):

* ``inputs``: each value is a batch-first tensor or a list with one entry per row (VLA
  observations), so that slicing a minibatch never needs to know the model;
* ``prompts`` + ``prompt_index``: what several rows share, stored once (VLM prompt ids, pixel
  values, grid sizes). ``prompts[k]`` holds one entry per distinct prompt and
  ``prompt_index[b]`` names row b's; rows with the same index share the prompt's tensors. This is
  the batch's group structure as data: a policy reads it to run each prompt (vision tower, prefix
  keys/values) once, and ``select``/``to``/``concat`` keep it, moving each prompt tensor once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .segments import Segments

SAMPLED, GUIDE = 0, 1
"""``RolloutBatch.origin``: a row the policy sampled; a reference trace it scores (guide rows)"""


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
    is_weight: Tensor | None = None
    """[B, T] filled in by the trainer: the rollout correction's importance weights."""
    policy_version: Tensor | None = None
    """[B] long: the version of the weights (optimizer updates applied) that produced each row,
    filled by an asynchronous pipeline (trainer/pipeline.py); rows never span a weight change."""
    segments: Segments | None = None
    """The rows' structure as data (``trainer/segments.py``): the segment of every token (policy
    or observation), each segment's parent, first column and length. Every VLM batch has one
    (a flat group: one policy segment per row); a VLA tree's too; None: every row one segment.
    Kept on the host."""
    origin: Tensor | None = None
    """[B] long: how each row was made, `SAMPLED` by the policy or `GUIDE` (a reference trace
    the policy scores, ``rollout.guide``); None: every row sampled."""
    step_rewards: Tensor | None = None
    """[B, T] process rewards (a score per reasoning step, on the step's last token), next to the
    outcome ``rewards``; estimators that take them keep the two apart (``prime``), the others
    get their sum (see ``trainer/advantages.py``)."""
    inputs: dict[str, Any] = field(default_factory=dict)
    """Policy-specific forward inputs: batch-first tensors or per-sample lists."""
    prompts: dict[str, list] = field(default_factory=dict)
    """Forward inputs shared by rows, stored once: key -> one entry (tensor or None) per
    distinct prompt."""
    prompt_index: Tensor | None = None
    """[B] long, on the host: row b's entry in ``prompts`` (rows with the same index share a
    prompt)."""
    meta: list[dict] = field(default_factory=list)
    """Per-sample metadata (answers, task ids, completion text ...), never sent to a device."""

    def __len__(self) -> int:
        return int(self.group_id.shape[0])

    def _map(self, fn_tensor, fn_list) -> RolloutBatch:
        """Apply ``fn_tensor`` to every row-aligned tensor and ``fn_list`` to every per-row list;
        ``prompts`` and ``prompt_index`` are the caller's to set."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("prompts", "prompt_index", "segments"):
                out[f.name] = v
            elif f.name == "inputs":
                out["inputs"] = {
                    k: fn_tensor(x) if isinstance(x, Tensor) else fn_list(x) for k, x in v.items()
                }
            elif f.name == "meta":
                out["meta"] = fn_list(v) if v else []
            else:
                out[f.name] = fn_tensor(v) if isinstance(v, Tensor) else v
        return RolloutBatch(**out)

    def select(self, idx: Tensor | list[int]) -> RolloutBatch:
        """Rows ``idx`` of every batch-first field (tensors and per-sample lists); only the
        prompts those rows use are kept (in index order), still one entry per prompt."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        idx_l = idx_t.tolist()
        out = self._map(
            lambda t: t[idx_t.to(t.device)],
            lambda xs: [xs[i] for i in idx_l],
        )
        if self.segments is not None:
            out.segments = self.segments.select(idx_t)
        if self.prompt_index is not None:
            used, out.prompt_index = torch.unique(self.prompt_index[idx_t], return_inverse=True)
            keep = used.tolist()
            out.prompts = {k: [v[u] for u in keep] for k, v in self.prompts.items()}
        return out

    def to(self, device: torch.device | str) -> RolloutBatch:
        """Move tensors (including tensors inside per-sample lists of ``inputs``) to ``device``;
        each shared prompt tensor moves once, so its rows still share one copy."""

        def move_list(xs):
            return [x.to(device) if isinstance(x, Tensor) else x for x in xs]

        moved = self._map(lambda t: t.to(device), move_list)
        moved.prompts = {k: move_list(v) for k, v in self.prompts.items()}
        moved.meta = self.meta  # metadata, prompt_index and segments (structure) stay on the host
        return moved

    def num_prompts(self) -> int:
        """Distinct prompts the rows were sampled from (0 without ``prompts``)."""
        return len(next(iter(self.prompts.values()), []))

    def row_prompts(self) -> dict[str, list]:
        """``prompts`` expanded to one entry per row (the same objects, not copies)."""
        if self.prompt_index is None:
            return {}
        rows = self.prompt_index.tolist()
        return {k: [v[u] for u in rows] for k, v in self.prompts.items()}

    def tree_ids(self) -> Tensor | None:
        """[B, T] the segment ids of a tree's policy tokens (0 elsewhere; rows holding one id
        share that segment), on ``mask``'s device, as the tree estimators read them; None
        unless the rows branch."""
        if self.segments is None or not self.segments.branches:
            return None
        return self.segments.token_ids().to(self.mask.device)

    def row_origin(self) -> Tensor:
        """[B] `origin`, `SAMPLED` where the batch has none."""
        if self.origin is not None:
            return self.origin
        return torch.full((len(self),), SAMPLED, dtype=torch.long, device=self.group_id.device)

    def split(self, size: int) -> list[RolloutBatch]:
        """Consecutive chunks of at most ``size`` rows."""
        n = len(self)
        return [self.select(list(range(i, min(i + size, n)))) for i in range(0, n, size)]

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Stack batches row-wise; tensors along dim 0 (right-padded to the longest ``T``);
        the prompts of each batch follow the previous batch's (indices shifted)."""
        if len(batches) == 1:
            return batches[0]
        out = {}
        for f in dataclasses.fields(RolloutBatch):
            vals = [getattr(b, f.name) for b in batches]
            if f.name == "prompt_index":
                out[f.name] = _concat_index(batches)
            elif f.name in ("inputs", "prompts"):
                keys = vals[0].keys()
                out[f.name] = {k: _cat([v[k] for v in vals]) for k in keys}
            elif f.name == "meta":
                out["meta"] = [m for v in vals for m in v]
            elif f.name == "segments" and any(v is not None for v in vals):
                out[f.name] = Segments.concat(
                    [Segments.flat(b.mask) if v is None else v for b, v in zip(batches, vals)]
                )
            elif f.name == "origin" and any(v is not None for v in vals):
                out[f.name] = torch.cat([b.row_origin() for b in batches])
            elif vals[0] is None:
                out[f.name] = None
            else:
                out[f.name] = _cat(vals)
        return RolloutBatch(**out)


def _concat_index(batches: list[RolloutBatch]) -> Tensor | None:
    """``prompt_index`` of concatenated batches: each batch's shifted past the prompts before it."""
    if batches[0].prompt_index is None:
        return None
    parts, offset = [], 0
    for b in batches:
        parts.append(b.prompt_index + offset)
        offset += b.num_prompts()
    return torch.cat(parts)


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


def substep_tokens(batch: RolloutBatch, S: int) -> RolloutBatch:
    """The policy loss's view of a batch whose policy scores S sub-steps per position (log-probs
    [B, T, S], e.g. a flow head's denoising steps, whose sum is the position's log-prob): each
    sub-step is a token [B, T*S] with its position's mask, advantage and importance weight, and
    its own behaviour / reference log-prob, so ratios are clipped per sub-step (Flow-GRPO)."""
    rep = lambda x: None if x is None else x.repeat_interleave(S, dim=1)  # noqa: E731

    def own(x: Tensor | None) -> Tensor | None:
        if x is not None and x.dim() != 3:
            raise ValueError(
                f"the policy scores {S} sub-steps per position but the batch's behaviour / "
                f"reference log-probs are {tuple(x.shape)}; they must come from the same kind "
                "of policy (e.g. a flow head with the same vla.flow_logp)"
            )
        return None if x is None else x.flatten(1)

    return dataclasses.replace(
        batch, mask=rep(batch.mask), advantages=rep(batch.advantages),
        is_weight=rep(batch.is_weight), logp_old=own(batch.logp_old), logp_ref=own(batch.logp_ref),
    )  # fmt: skip
