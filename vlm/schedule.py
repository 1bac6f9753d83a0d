"""The schedule of a rollout: how a prompt's completions branch (`TreeShape`) and which live rows
get how many children at a fork (`fork_plan`; TreePO's fallback: a stopped branch's leaves go to
the live ones). The sampler driver (``vlm/sampler.py``) reads it on every engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

ALLOCATIONS = ("uniform", "entropy")
"""how a depth's forks are spread over its live branches (`TreeShape.allocate`)"""


@dataclass(frozen=True)
class TreeShape:
    """How a prompt's completions branch: a flat group is the tree of depth one; for episodes a
    segment is a turn (forks come after a turn's observation)."""

    branches: tuple[int, ...]
    """children per node at each depth; branches[0] rows start from the prompt; the product is
    the prompt's leaves (the group size)"""
    segment_tokens: int = 0
    """tokens of every segment but the last (unused for a tree of depth one)"""
    allocate: str = "uniform"
    """uniform | entropy: how a depth's forks are spread over its live branches"""

    def __post_init__(self):
        if not self.branches or any(b < 1 for b in self.branches):
            raise ValueError(f"tree branches must be positive integers, got {self.branches}")
        if len(self.branches) > 1 and self.segment_tokens < 1:
            raise ValueError("a tree deeper than one segment needs segment_tokens >= 1")
        if self.allocate not in ALLOCATIONS:
            raise ValueError(f"tree allocate {self.allocate!r}: use one of {ALLOCATIONS}")

    @property
    def leaves(self) -> int:
        return math.prod(self.branches)

    @classmethod
    def flat(cls, n: int) -> TreeShape:
        return cls((n,))


def fork_plan(live_prompt: Tensor, done_prompt: Tensor, U: int, shape: TreeShape, depth: int,
              logits: Tensor) -> Tensor:  # fmt: skip
    """Which live rows to keep, repeated by their number of children, at fork ``depth``: each
    prompt's finished leaves (``done_prompt``: the prompt of every finished row) plus its live
    rows' children make ``prod(branches[:depth + 1])`` (at least one child each; spread as
    ``shape.allocate`` says, entropy read from the next-token ``logits`` [L, V]).
    Returns idx [L'] into the live rows, sorted (a row's children adjacent)."""
    target = math.prod(shape.branches[: depth + 1])
    finished = torch.bincount(done_prompt, minlength=U)
    entropy = None
    if shape.allocate == "entropy":
        logp = logits.float().log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1).cpu()
    counts = torch.zeros(len(live_prompt), dtype=torch.long)
    for u in live_prompt.unique().tolist():
        mine = (live_prompt == u).nonzero().squeeze(1)
        ent = None if entropy is None else entropy[mine]
        counts[mine] = _allocate(int(min(target, shape.leaves) - finished[u]), len(mine), ent)
    return torch.arange(len(live_prompt)).repeat_interleave(counts)


def rank_within(keys: Tensor) -> Tensor:
    """[N] position of each element among the earlier elements with the same key."""
    same = keys[:, None] == keys[None, :]
    return torch.tril(same, diagonal=-1).sum(1)


def _allocate(want: int, n: int, entropy: Tensor | None = None) -> Tensor:
    """Children of each of a prompt's ``n`` live branches, ``max(want, n)`` in all, each >= 1:
    even shares with the remainder to random branches, or (``entropy`` [n] given) one each and
    every further child to the branch with the highest entropy per child so far."""
    counts = torch.ones(n, dtype=torch.long)
    extra = want - n
    if extra <= 0:
        return counts
    if entropy is None:
        counts += extra // n
        counts[torch.randperm(n)[: extra % n]] += 1
        return counts
    for _ in range(extra):
        counts[int(torch.argmax(entropy / counts))] += 1
    return counts


def forked_rows(rows: Tensor, idx: Tensor, clone) -> Tensor:
    """Storage rows of the children ``rows[idx]`` (``idx`` sorted, a row's children adjacent):
    a row's first child keeps its parent's storage row, each further child gets the row
    ``clone(parent rows [M])`` returns ([M]: fresh rows holding copies of the parents')."""
    first = torch.ones(len(idx), dtype=torch.bool)
    first[1:] = idx[1:] != idx[:-1]
    out = rows[idx].clone()
    if not first.all():
        out[~first] = clone(out[~first])
    return out


END_STOP, END_LENGTH, END_STOP_STRING, END_FULL = 0, 1, 2, 3
"""Why a segment ended, as the engines report it (``Engine.decode``): the stop token; the
segment's token limit; one of the stop strings (episodes); the engine's context (vLLM's
``max_model_len``) before either."""
