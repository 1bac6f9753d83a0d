"""Supervised warm-start batches for a VLM: (sample, target text) pairs -> `RolloutBatch`."""

from __future__ import annotations

import numpy as np

from ..trainer.batch import RolloutBatch


class VLMSFTSource:
    """Yields ``batch_size`` (prompt, target) pairs per step, in a seeded shuffled order.

    Args:
        policy: the `VLMPolicy` whose processor encodes prompts and targets.
        samples: samples in the data schema (images, question ...).
        targets: one target completion per sample (e.g. a reasoning trace ending in an answer).
    """

    def __init__(
        self, policy, samples: list[dict], targets: list[str], batch_size: int, seed: int = 0
    ):
        if len(samples) != len(targets) or not samples:
            raise ValueError(
                f"need one target per sample, got {len(samples)} samples and {len(targets)} targets"
            )
        self.policy, self.samples, self.targets = policy, samples, targets
        self.batch_size, self.seed = batch_size, seed
        self._perm: tuple[int, np.ndarray] = (-1, np.arange(0))

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm[0] != epoch:
            self._perm = (
                epoch,
                np.random.default_rng([self.seed, epoch]).permutation(len(self.samples)),
            )
        return self._perm[1]

    def next_batch(self, step: int) -> RolloutBatch:
        """Batch ``step`` is a pure function of ``(seed, step)``, so a resumed run sees the same data."""
        n = len(self.samples)
        idx = []
        for k in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, pos = divmod(k, n)
            idx.append(int(self._order(epoch)[pos]))
        return self.policy.completions_batch(
            [self.samples[i] for i in idx], [self.targets[i] for i in idx]
        )
