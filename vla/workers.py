"""The VLA side's rollout workers for ``train.pipeline = one_step_off | async``.

Each Ray worker (trainer/pipeline.py) runs its own vector env with a policy copy and the
recipe's collector: ``ceil(env.num_envs / rollout.workers)`` envs, PPO segments or
``ceil(rollout.prompts_per_step / rollout.workers)`` GRPO groups per chunk, its own seeds. The
PPO collector's acting log-probs and values become behaviour log-probs on the trainer when the
chunk is a version old (the trainer scores the proximal log-probs and values itself); GAE's
bootstrap values at a horizon come from the worker's copy of the critic.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..trainer.config import ConfigError


def pipeline_source(cfg, run_dir: Path):
    """A `PipelineSource` whose ``rollout.workers`` build `rollout_worker`."""
    from ..trainer.pipeline import PipelineSource

    r, t = cfg.rollout, cfg.train
    if cfg.env.num_envs < r.workers:
        raise ConfigError(
            f"rollout.workers={r.workers} needs env.num_envs >= {r.workers} (each worker runs "
            f"its share of the {cfg.env.num_envs} envs)"
        )
    return PipelineSource(
        t.pipeline, rollout_worker, (cfg, str(run_dir)), workers=r.workers, cpus=r.worker_cpus,
        gpus=r.worker_gpus, max_staleness=t.max_staleness, buffer_chunks=t.pipeline_buffer,
        worker_timeout_s=r.worker_timeout_s, timeout_s=t.pipeline_timeout_s,
        address=t.ray_address,
    )  # fmt: skip


def rollout_worker(cfg, run_dir: str, index: int):
    """What a pipeline worker runs (in its own process): its share of the envs, a policy copy
    (its weights come from the trainer before the first chunk) and the recipe's collector."""
    from .envs import VecRunner
    from .run import build_policy, build_source

    w = cfg.rollout.workers
    cfg = dataclasses.replace(
        cfg,
        env=dataclasses.replace(cfg.env, num_envs=-(-cfg.env.num_envs // w)),
        rollout=dataclasses.replace(cfg.rollout, prompts_per_step=-(-cfg.rollout.prompts_per_step // w)),
        train=dataclasses.replace(
            cfg.train, seed=cfg.train.seed + 7919 * (index + 1),
            device="cuda" if cfg.rollout.worker_gpus else "cpu",
        ),
    )  # fmt: skip
    runner = VecRunner(cfg.env, seed=cfg.train.seed)
    policy = build_policy(cfg, runner, Path(run_dir) / f"worker_{index}")
    return policy, build_source(cfg, runner)
