"""Builds the VLA side from a `Config`: env runner, policy, rollout source, evaluator, trainer.

This module registers side ``vla`` (`build_trainer`, `run_sft`, `run_eval`, `run_compare`).
``algo.adv_estimator=gae`` trains with per-step PPO experience (`PPOCollector`); any group
estimator (grpo, rloo, ...) with whole-episode groups (`GRPOCollector`).

Both builders seed the process's generators with ``train.seed`` before they build anything, so a
fresh policy's initial weights (and everything else drawn before `Trainer.fit` seeds again) are
the same in every run with that seed.

With ``train.pipeline = one_step_off | async`` the envs run on Ray workers (`pipeline_source`):
each builds its share of the envs, a policy copy and the recipe's collector (`rollout_worker`):
``ceil(env.num_envs / rollout.workers)`` envs, PPO segments or ``ceil(rollout.prompts_per_step /
rollout.workers)`` GRPO groups per chunk, its own seeds. The PPO collector's acting log-probs
and values become behaviour log-probs on the trainer when the chunk is a version old (the
trainer scores the proximal log-probs and values itself); GAE's bootstrap values at a horizon
come from the worker's copy of the critic.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from ..registry import ADVANTAGES, SIDES, Side
from ..sim.vector import VecEnv
from ..trainer.config import ConfigError
from ..trainer.engine import build_engine
from ..trainer.loop import Trainer
from ..trainer.runtime import resolve_device, resolve_path, seed_everything
from .collect import GRPOCollector, PPOCollector
from .compact import CompactVLA, build_compact, spec_from_config
from .envs import make_envs
from .evaluate import evaluate_policy


def build_policy(cfg, runner: VecEnv, run_dir: str | Path | None = None):
    """``model.path`` (a saved CompactVLA, e.g. a BC warm start) or a fresh policy sized from
    the env's spaces, on ``train.device``; ``vla.policy=token``: see `build_token_policy`."""
    device = resolve_device(cfg.train.device)
    if cfg.vla.policy == "token":
        return build_token_policy(cfg, runner, device, run_dir)
    if cfg.vla.policy != "compact":
        raise ConfigError(f"vla.policy={cfg.vla.policy!r}; valid: compact | token")
    if cfg.model.path:
        policy = CompactVLA.from_pretrained(Path(cfg.model.path).expanduser(), device=device)
        _check_entities(policy.spec.vla.encoder, cfg.env.entity_features)
        if policy.spec.chunk != cfg.env.action_chunk:
            raise ConfigError(
                f"model.path holds a policy with action chunk {policy.spec.chunk}; the recipe "
                f"has env.action_chunk={cfg.env.action_chunk}"
            )
        return policy
    _check_entities(cfg.vla.encoder, cfg.env.entity_features)
    spaces = {"action": runner.action_space, "observation": runner.observation_space}
    spec = spec_from_config(cfg.vla, spaces, cfg.env.action_chunk, cfg.env.image_size)
    return build_compact(spec).to(device)


def _check_entities(encoder: str, entity_features: bool) -> None:
    """The entity encoder reads kinds and colours that only ``env.entity_features`` gives, and
    every other encoder reads seven numbers per entity."""
    if (encoder == "entities") != entity_features:
        raise ConfigError(
            f"vla.encoder={encoder} with env.entity_features={str(entity_features).lower()}: "
            "the entities encoder needs env.entity_features=true and no other encoder reads it"
        )


def build_token_policy(cfg, runner: VecEnv, device, run_dir=None):
    """A `TokenVLA` on the local VLM directory ``model.path``, or on a tiny random-initialised
    ``model.tiny_arch`` built under ``run_dir/init_model`` when the path is empty."""
    from ..vlm.tiny import build_tiny
    from .token_vla import TokenSpec, TokenVLA

    if "values" in ADVANTAGES.meta(cfg.algo.adv_estimator)["needs"]:
        raise ConfigError(
            f"vla.policy=token has no value head; algo.adv_estimator={cfg.algo.adv_estimator!r} "
            "needs one. Use a group estimator (grpo, rloo, ...)"
        )
    if cfg.vla.action_bins < 2:
        raise ConfigError(f"vla.action_bins={cfg.vla.action_bins}; a token policy needs >= 2 bins")
    m = cfg.model
    if m.path:
        path = Path(m.path).expanduser()
    elif run_dir is not None:
        path = build_tiny(m.tiny_arch, Path(run_dir) / "init_model", seed=cfg.train.seed)
    else:
        raise ConfigError("vla.policy=token needs model.path (a local image-text-to-text model)")
    spec = TokenSpec(
        action_dim=runner.action_dim, chunk=cfg.env.action_chunk, bins=cfg.vla.action_bins
    )
    policy = TokenVLA.from_pretrained(
        path, spec, dtype=m.dtype, device=device, gradient_checkpointing=m.gradient_checkpointing,
        trust_remote_code=m.trust_remote_code, min_pixels=m.min_pixels or None,
        max_pixels=m.max_pixels or None,
    )  # fmt: skip
    if policy.spec.chunk != cfg.env.action_chunk:
        raise ConfigError(
            f"model.path holds a TokenVLA with action chunk {policy.spec.chunk}; the recipe has "
            f"env.action_chunk={cfg.env.action_chunk}"
        )
    if policy.spec.bins != cfg.vla.action_bins:
        raise ConfigError(
            f"model.path holds a TokenVLA with {policy.spec.bins} action bins; the recipe has "
            f"vla.action_bins={cfg.vla.action_bins}"
        )
    return policy


def load_policy(path: str | Path, device: str = "cpu"):
    """A VLA policy written by ``policy.save``: a `TokenVLA` directory (``token_vla.json``) or
    a `CompactVLA` one (``config.json`` + ``model.safetensors``)."""
    from .token_vla import SPEC

    path = Path(path).expanduser()
    if (path / SPEC).exists():
        from .token_vla import TokenVLA

        return TokenVLA.from_pretrained(path, device=device)
    return CompactVLA.from_pretrained(path, device=device)


def build_source(cfg, runner: VecEnv):
    if ADVANTAGES.meta(cfg.algo.adv_estimator)["per_step"]:
        return PPOCollector(cfg.env, seed=cfg.train.seed, runner=runner)
    return GRPOCollector(
        cfg.env, groups=cfg.rollout.prompts_per_step, group_size=cfg.rollout.group_size,
        seed=cfg.train.seed, runner=runner, branches=cfg.rollout.tree.branches,
        segment_steps=cfg.rollout.tree.segment_tokens,
    )  # fmt: skip


def build_evaluator(cfg):
    """Deterministic success on ``env.eval_episodes`` held-out seeds, or None when 0."""
    if cfg.env.eval_episodes <= 0:
        return None
    return functools.partial(evaluate_policy, env_cfg=cfg.env)


def build_trainer(cfg, run_dir: str | Path) -> Trainer:
    """PPO (GAE) or GRPO-family training of a VLA policy on ``env.id``."""
    seed_everything(cfg.train.seed)
    if cfg.train.pipeline != "sync":  # envs live on the Ray workers; one here for the spaces
        spaces = make_envs(dataclasses.replace(cfg.env, num_envs=1), seed=cfg.train.seed)
        policy = build_policy(cfg, spaces, run_dir)
        spaces.close()
        source = pipeline_source(cfg, Path(run_dir))
    else:
        runner = make_envs(cfg.env, seed=cfg.train.seed)
        policy = build_policy(cfg, runner, run_dir)
        source = build_source(cfg, runner)
    ref = None
    if cfg.algo.kl_coef > 0:
        import copy

        ref = copy.deepcopy(policy).requires_grad_(False)
    return Trainer(
        cfg, policy, source, run_dir, engine=build_engine(policy, cfg.train), ref_policy=ref,
        evaluator=build_evaluator(cfg),
    )  # fmt: skip


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
    runner = make_envs(cfg.env, seed=cfg.train.seed)
    policy = build_policy(cfg, runner, Path(run_dir) / f"worker_{index}")
    return policy, build_source(cfg, runner)


def run_sft(cfg, run_dir: str | Path) -> dict[str, float]:
    """Behaviour cloning from the scripted expert: the trainer's SFT objective (targets of
    ``env.action_chunk`` expert actions; the experts step the envs one action at a time)."""
    from .bc import ExpertSource

    seed_everything(cfg.train.seed)
    runner = make_envs(cfg.env, seed=cfg.train.seed)  # the experts act every env step
    policy = build_policy(cfg, runner, run_dir)
    source = ExpertSource(
        policy, runner, batch_steps=cfg.env.steps_per_rollout, chunk=cfg.env.action_chunk
    )
    try:
        trainer = Trainer(
            cfg, policy, source, run_dir, engine=build_engine(policy, cfg.train),
            evaluator=build_evaluator(cfg), objective="sft",
        )  # fmt: skip
        return trainer.fit()
    finally:
        runner.close()


def run_eval(cfg, out_dir: Path, more=()) -> dict:
    """Deterministic success per task over ``env.eval_episodes`` fixed seeds, with a table and an
    mp4 per task (``env.eval_videos`` episodes). Returns ``{"table", "files"}``."""
    from .evaluate import write_report

    if more:
        raise ConfigError("several recipes evaluate together only on side vlm")
    if not cfg.model.path:
        raise ConfigError(
            "perceptrl eval needs --model (a saved VLA, e.g. <run>/checkpoints/step_N/model)"
        )
    policy = load_policy(resolve_path(cfg.model.path), resolve_device(cfg.train.device))
    report = write_report(policy, cfg.env, out_dir)
    table = (out_dir / "eval.md").read_text().rstrip()
    return {
        "table": table,
        "files": [out_dir / "eval.json", out_dir / "eval.md", *report["videos"].values()],
    }


def run_compare(cfgs: dict, out_dir: Path) -> dict:
    """Several saved VLAs (name -> config whose ``model.path`` is one of them) on the same
    held-out seeds: success per task and model in ``compare.md``/``compare.json``, and per task
    one mp4 with the models side by side (``env.eval_videos`` episodes). Returns
    ``{"table", "files"}``."""
    import json

    from .evaluate import compare_video, evaluate_policy, task_name

    out_dir.mkdir(parents=True, exist_ok=True)
    first = next(iter(cfgs.values()))
    policies = {
        name: load_policy(resolve_path(c.model.path), resolve_device(c.train.device))
        for name, c in cfgs.items()
    }
    metrics = {name: evaluate_policy(p, first.env) for name, p in policies.items()}
    tasks = [task_name(t) for t in first.env.eval_tasks or [first.env.id]]
    lines = ["| model | " + " | ".join(tasks) + " | mean |", "|---" * (len(tasks) + 2) + "|"]
    for name, m in metrics.items():
        cells = [f"{m[f'success/{t}']:.3f}" for t in tasks] + [f"{m['success_rate']:.3f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    files = [out_dir / "compare.json", out_dir / "compare.md"]
    record = {"episodes": first.env.eval_episodes, "eval_seed": first.env.eval_seed,
              "models": {n: str(c.model.path) for n, c in cfgs.items()}, "metrics": metrics}  # fmt: skip
    files[0].write_text(json.dumps(record, indent=1))
    files[1].write_text(table + "\n")
    if first.env.eval_videos > 0:
        seeds = [first.env.eval_seed + j for j in range(first.env.eval_videos)]
        for env_id in first.env.eval_tasks or [first.env.id]:
            path = out_dir / f"{task_name(env_id)}_compare.mp4"
            files.append(compare_video(policies, first.env, env_id, seeds, path))
    return {"table": table, "files": files}


SIDES.register("vla", Side(build_trainer, run_eval, run_sft=run_sft, run_compare=run_compare))
