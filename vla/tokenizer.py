"""Uniform action tokenizer (the OpenVLA convention).

Each action dimension in [-1, 1] is cut into ``bins`` equal-width bins; bin ``b`` is the token
id ``first_id + b`` of a block of ``bins`` reserved vocabulary ids (by default the last ``bins``
ids of the vocabulary). A chunk of K steps of D dims is the token sequence
``a[0,0], a[0,1], ..., a[0,D-1], a[1,0], ...`` (K*D tokens, step-major). Decoding maps a token to
its bin centre; a token outside the action block decodes to NaN, which the collector counts and
replaces by a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ActionTokenizer:
    """``bins`` uniform bins per dim on [low, high], mapped to ids ``first_id .. first_id+bins-1``."""

    first_id: int
    """vocabulary id of bin 0"""
    bins: int = 256
    """bins per action dimension"""
    low: float = -1.0
    high: float = 1.0

    @classmethod
    def last_ids(cls, vocab_size: int, bins: int = 256) -> ActionTokenizer:
        """Reserve the last ``bins`` ids of a vocabulary of ``vocab_size`` (OpenVLA)."""
        if vocab_size < bins:
            raise ValueError(f"a vocabulary of {vocab_size} ids cannot hold {bins} action bins")
        return cls(first_id=vocab_size - bins, bins=bins)

    @property
    def ids(self) -> range:
        return range(self.first_id, self.first_id + self.bins)

    def encode(self, actions: Tensor) -> Tensor:
        """actions [..., K, D] (clipped to [low, high]) -> token ids [..., K*D] long."""
        x = actions.float().clamp(self.low, self.high)
        frac = (x - self.low) / (self.high - self.low)  # [..., K, D] in [0, 1]
        b = (frac * self.bins).floor().clamp(max=self.bins - 1).long()
        return (b + self.first_id).flatten(-2)

    def decode(self, tokens: Tensor, dim: int) -> Tensor:
        """token ids [..., K*D] -> actions [..., K, D] float (bin centres; NaN for ids outside
        the action block)."""
        b = tokens.long() - self.first_id
        valid = (b >= 0) & (b < self.bins)
        width = (self.high - self.low) / self.bins
        x = self.low + (b.clamp(0, self.bins - 1).float() + 0.5) * width
        x = torch.where(valid, x, torch.full_like(x, float("nan")))
        return x.unflatten(-1, (-1, dim))

    def is_action(self, tokens: Tensor) -> Tensor:
        """bool mask: the id is an action token."""
        b = tokens.long() - self.first_id
        return (b >= 0) & (b < self.bins)
