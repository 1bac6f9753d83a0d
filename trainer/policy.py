"""The `Policy` protocol: all the trainer ever calls on a model.

VLM policies (token sequences) and VLA policies (action sequences) both implement it; a VLA adds
``act(obs)`` and a VLM adds ``generate(prompts)`` for their own rollout code, which the trainer
never calls. A policy with auxiliary losses may also define ``evaluate_with_aux(batch) ->
(logp, entropy, value, {name: [B, T] weighted per-step loss})``; the loop then calls it instead
of ``evaluate`` for the loss and adds each term (token-mean like the others, logged as
``aux/<name>``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

from torch import Tensor, nn

from .batch import RolloutBatch


@runtime_checkable
class Policy(Protocol):
    def evaluate(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, Tensor | None]:
        """Re-score ``batch`` under the current weights, with gradients.

        Returns:
            logp [B, T]: log-probability of each token/action taken.
            entropy [B, T]: entropy of the policy's distribution at each position.
            value [B, T] or None: critic estimate, for policies with a value head.
        """
        ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def state_dict(self) -> dict: ...

    def save(self, path: str | Path) -> None:
        """Write the weights (safetensors / HF format) and whatever is needed to reload them."""
        ...

    def load(self, path: str | Path) -> None:
        """Restore in place the weights that ``save(path)`` wrote (used by ``--resume``)."""
        ...


@runtime_checkable
class RolloutSource(Protocol):
    """What the loop is handed to produce experience: a dataset + sampler (VLM) or a vector env
    + collector (VLA). The trainer knows nothing else about where a batch came from."""

    def collect(self, policy: Policy, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """One batch of scored experience (``rewards`` filled in) and its metrics."""
        ...
