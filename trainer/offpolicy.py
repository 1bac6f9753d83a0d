"""The off-policy objective of the trainer: collect -> store -> several updates from replay.

``objective="offpolicy"`` (`Trainer.train_step`): each step the source acts in its envs and
stores what happened in its replay buffer (`OffPolicySource.collect`), then hands out the
step's minibatches of `trainer.replay.Transitions` (`OffPolicySource.minibatches`: how many
is the source's update-to-data ratio); the policy turns each into one loss
(`OffPolicyPolicy.offpolicy_loss`: SAC's critic, actor and temperature terms, for instance)
and one optimizer step, then moves its target networks (`after_update`). Evaluation,
checkpoints (the buffer is the source's state), metrics and resume are the loop's, as for the
other objectives.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from torch import Tensor

from .replay import Transitions


@runtime_checkable
class OffPolicySource(Protocol):
    def collect(self, policy, step: int) -> dict[str, float]:
        """Act for one step's worth of env steps and store them; returns metrics."""
        ...

    def minibatches(self, step: int) -> Iterator[Transitions]:
        """This step's minibatches (none before enough transitions are stored)."""
        ...


@runtime_checkable
class OffPolicyPolicy(Protocol):
    def offpolicy_loss(self, batch: Transitions) -> tuple[Tensor, dict[str, float]]:
        """One minibatch -> (the loss of every trained part, metrics)."""
        ...

    def after_update(self) -> None:
        """After each optimizer step (target networks follow the trained ones)."""
        ...


def offpolicy_step(trainer) -> dict[str, float]:
    """One step of the off-policy objective for ``trainer`` (a `Trainer`); its metrics."""
    t0 = time.perf_counter()
    with trainer.engine.rollout_context():
        metrics = dict(trainer.source.collect(trainer.policy, trainer.step))
    t1 = time.perf_counter()
    sums: dict[str, float] = defaultdict(float)
    updates = skipped = 0
    for batch in trainer.source.minibatches(trainer.step):
        loss, m = trainer.policy.offpolicy_loss(batch.to(trainer.device))
        if not loss.isfinite():
            trainer.counters["nonfinite_loss"] += 1
            trainer.engine.zero_grad()
            skipped += 1
            continue
        trainer.engine.backward(loss)
        m["grad_norm"], finite = trainer.engine.step()
        if not finite:
            skipped += 1
            continue
        trainer.policy.after_update()
        updates += 1
        for k, v in m.items():
            sums[k] += float(v)
    metrics.update({k: v / max(updates, 1) for k, v in sums.items()})
    metrics["offpolicy/updates"] = float(updates)
    metrics["nonfinite/skipped_updates"] = float(skipped)
    trainer._track_bad_step(skipped > 0 and updates == 0)
    t2 = time.perf_counter()
    metrics.update({"time/collect": t1 - t0, "time/update": t2 - t1, "time/step": t2 - t0})
    metrics["lr"] = trainer.engine.lr
    return metrics
