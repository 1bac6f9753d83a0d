"""The `Policy` protocol: all the trainer ever calls on a model, and what ``evaluate`` returns.

VLM policies (token sequences) and VLA policies (action sequences) both implement it; a VLA adds
``act(obs)`` and a VLM adds ``generate(prompts)`` for their own rollout code, which the trainer
never calls. A policy declares whether it has a critic (``has_critic``); the loop decides from
that, not from what a first forward happened to return, where the behaviour values come from.
A policy whose imitation objective is not the likelihood of its targets (a flow-matching action
head) adds ``sft_loss(batch) -> (per-token loss [B, T], aux losses)``, which the SFT objective
then minimises instead of ``-evaluate(batch).logp``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from torch import Tensor, nn

from .batch import RolloutBatch


@dataclass
class Evaluation:
    """A policy's re-scoring of a batch: every tensor is [B, T] and 0 where ``mask`` is 0."""

    logp: Tensor
    """log-probability of each token/action taken (with gradients)"""
    entropy: Tensor
    """entropy of the policy's distribution at each position"""
    value: Tensor | None = None
    """critic estimate, for policies with ``has_critic``"""
    aux: dict[str, Tensor] = field(default_factory=dict)
    """auxiliary losses the policy asks the trainer to add: name -> [B, T] weighted per-step
    loss, aggregated like the other terms and logged as ``aux/<name>``"""


@runtime_checkable
class Policy(Protocol):
    has_critic: bool
    """whether ``evaluate`` returns values (GAE, value loss)"""

    def evaluate(self, batch: RolloutBatch) -> Evaluation:
        """Re-score ``batch`` under the current weights, with gradients."""
        ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> object:
        """Set the weights from ``state_dict()``'s output (pipeline workers receive the
        trainer's weights this way)."""
        ...

    def save(self, path: str | Path) -> None:
        """Write the weights (safetensors / HF format) and whatever is needed to reload them."""
        ...

    def load(self, path: str | Path) -> None:
        """Restore in place the weights that ``save(path)`` wrote (used by ``--resume``)."""
        ...


@runtime_checkable
class RolloutSource(Protocol):
    """What the RL objective is handed to produce experience: a dataset + sampler (VLM) or a
    vector env + collector (VLA). The trainer knows nothing else about where a batch came from."""

    def collect(self, policy: Policy, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """One batch of scored experience (``rewards`` filled in) and its metrics."""
        ...


@runtime_checkable
class SFTSource(Protocol):
    """What the SFT objective is handed: batches whose ``tokens`` are the targets."""

    def next_batch(self, step: int) -> RolloutBatch:
        """Targets in ``tokens`` (with ``mask``) and the policy's forward inputs; a pure
        function of ``step`` or restored by ``state_dict``/``load_state_dict``, so a resumed
        run sees the same data."""
        ...
