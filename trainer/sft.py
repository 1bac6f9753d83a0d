"""Supervised warm start through the same `Policy.evaluate` path as RL.

A VLM learns the answer format from templated reasoning traces, a VLA clones scripted
demonstrations: in both cases the source yields `RolloutBatch`es whose ``tokens`` are the
targets, and the loss is the token-mean negative log-likelihood under ``mask``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from .algos import agg_loss
from .batch import RolloutBatch
from .checkpoint import save_checkpoint
from .config import Config
from .engine import TorchEngine
from .loop import TrainingDiverged, peak_rss_mb, progress_bar, resolve_device, seed_everything
from .metrics import MetricsLogger
from .policy import Policy


class SFTSource(Protocol):
    def next_batch(self, step: int) -> RolloutBatch:
        """Targets in ``tokens`` (with ``mask``) and the policy's forward inputs."""
        ...


def sft(
    cfg: Config,
    policy: Policy,
    source: SFTSource,
    run_dir: str | Path,
    *,
    evaluator: Callable[[Policy], dict[str, float]] | None = None,
) -> dict[str, float]:
    """Run ``cfg.train.steps`` SFT steps; log to ``run_dir`` and save a final checkpoint.

    Returns the final evaluation metrics (empty without an evaluator).
    """
    run_dir = Path(run_dir)
    seed_everything(cfg.train.seed)
    device = resolve_device(cfg.train.device)
    engine = TorchEngine(policy.parameters(), cfg.train)
    logger = MetricsLogger(run_dir, tensorboard=cfg.log.tensorboard)
    bar = progress_bar(cfg.train.steps, 0, enabled=cfg.log.progress)
    bad = 0
    last: dict[str, float] = {}
    limit = cfg.train.time_limit_min * 60
    t_start = time.perf_counter()
    done = 0
    try:
        for step in range(cfg.train.steps):
            if limit and time.perf_counter() - t_start > limit:
                break  # out of time: evaluate and save what was trained
            t0 = time.perf_counter()
            batch = source.next_batch(step).to(device)
            num_tokens = batch.mask.sum()
            loss_sum, finite = 0.0, True
            for micro in batch.split(cfg.train.micro_batch_size):
                logp, _, _ = policy.evaluate(micro)
                loss = agg_loss(-logp.float(), micro.mask, "token-mean", num_tokens=num_tokens)
                if not torch.isfinite(loss):
                    finite = False
                    break
                engine.backward(loss)
                loss_sum += float(loss.detach())
            grad_norm, stepped = engine.step() if finite else (float("nan"), False)
            if not stepped:
                engine.zero_grad()
            bad = 0 if stepped else bad + 1
            if bad >= cfg.train.max_bad_steps:
                raise TrainingDiverged(
                    f"SFT loss/gradient was NaN/inf in {bad} consecutive steps (last at step {step}); "
                    "lower train.lr or check the targets"
                )
            metrics = {"sft/loss": loss_sum, "grad_norm": grad_norm, "lr": engine.lr}
            metrics["time/step"] = time.perf_counter() - t0
            metrics["sys/peak_rss_mb"] = peak_rss_mb()
            done = step + 1
            logger.log(step + 1, metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_sum:.3f}")
            every = cfg.train.eval_every
            if evaluator is not None and every and (step + 1) % every == 0:
                last = {f"eval/{k}": v for k, v in evaluator(policy).items()}
                logger.log(step + 1, last)
        if evaluator is not None:
            last = {f"eval/{k}": v for k, v in evaluator(policy).items()}
            logger.log(done, last)
        save_checkpoint(run_dir / "checkpoints", done, policy, {}, {}, cfg.checkpoint.keep_last)
    finally:
        bar.close()
        logger.close()
    return last
