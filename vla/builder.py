"""Builds the VLA side from its run plan: env runner, policy, rollout source, evaluator, trainer.

This module registers side ``vla`` (`build_trainer`, `run_sft`, `run_eval`, `run_compare`, and
``check``: the rules across sections, `vla.config.check_vla`, which run when a recipe loads). A
run resolves its checked recipe once (`vla.run_plan.resolve`) and builds from that plan in a
straight line; what is checked here is only what the plan cannot know: a saved policy's contents
(``model.path``), the command's arguments, the run directory.
``algo.adv_estimator=gae`` (an estimator that declares ``per_step``) trains with per-step PPO
experience (`PPOCollector`); any group estimator (grpo, rloo, ...) with whole-episode groups
(`GRPOCollector`).

Both builders seed the process's generators with ``train.seed`` before they build anything, so a
fresh policy's initial weights (and everything else drawn before `Trainer.fit` seeds again) are
the same in every run with that seed.

With ``train.pipeline = one_step_off | async`` the envs run on Ray workers (`pipeline_source`):
each builds its share of the envs, a policy copy and the recipe's collector (`rollout_worker`,
from `VLARunPlan.worker`): ``ceil(env.num_envs / rollout.workers)`` envs, PPO segments or
``ceil(rollout.prompts_per_step / rollout.workers)`` GRPO groups per chunk, its own seeds. The
PPO collector's acting log-probs and values become behaviour log-probs on the trainer when the
chunk is a version old (the trainer scores the proximal log-probs and values itself); GAE's
bootstrap values at a horizon come from the worker's copy of the critic.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path

from ..registry import SIDES, Side
from ..sim.vector import VecEnv
from ..trainer.config import ConfigError
from ..trainer.engine import build_engine
from ..trainer.loop import Trainer
from ..trainer.runtime import resolve_device, resolve_path, seed_everything
from .collect import GRPOCollector, PPOCollector
from .compact import CompactVLA, build_compact, spec_from_config
from .config import EnvConfig, check_vla
from .envs import make_envs
from .evaluate import evaluate_policy
from .hub import TOKEN_TYPE, check_env, read_manifest
from .model_card import run_origin
from .run_plan import CollectPlan, PolicyPlan, VLARunPlan, resolve


def build_policy(plan: PolicyPlan, runner: VecEnv, run_dir: str | Path | None = None):
    """The saved policy at ``plan.path`` (a CompactVLA, e.g. a BC warm start) or a fresh one
    sized from the env's spaces, on ``plan.device``; a token policy: see `build_token_policy`."""
    device = resolve_device(plan.device)
    if plan.kind == "token":
        return build_token_policy(plan, runner, device, run_dir)
    if plan.head == "dsrl":  # the shipped recipe names no checkpoint: the command line does
        from .sac import steering

        if plan.path is None:
            raise ConfigError(
                "vla.head=dsrl steers a behaviour-cloned flow policy: set model.path to the "
                "model folder of a vla.head=flow checkpoint (`perceptrl sft vla_bc_flow`)"
            )
        return steering(plan.path, plan.vla, plan.chunk).to(device)
    if plan.path is not None:
        policy = CompactVLA.from_pretrained(plan.path, device=device)
        # a saved policy's encoder and chunk are known only once it is read
        _check_entities(policy.spec.vla.encoder, plan.entity_features)
        if policy.spec.chunk != plan.chunk:
            raise ConfigError(
                f"model.path holds a policy with action chunk {policy.spec.chunk}; the recipe "
                f"has env.action_chunk={plan.chunk}"
            )
        return policy
    spaces = {"action": runner.action_space, "observation": runner.observation_space}
    spec = spec_from_config(plan.vla, spaces, plan.chunk, plan.image_size)
    return build_compact(spec).to(device)


def _check_entities(encoder: str, entity_features: bool) -> None:
    """The entity encoder reads kinds and colours that only ``env.entity_features`` gives, and
    every other encoder reads seven numbers per entity (a fresh policy's encoder is checked when
    the recipe loads)."""
    if (encoder == "entities") != entity_features:
        raise ConfigError(
            f"model.path holds a policy with vla.encoder={encoder}; the recipe has "
            f"env.entity_features={str(entity_features).lower()}: the entities encoder needs "
            "env.entity_features=true and no other encoder reads it"
        )


def build_token_policy(plan: PolicyPlan, runner: VecEnv, device, run_dir=None):
    """A `TokenVLA` on the local VLM directory ``plan.path``, or on a tiny random-initialised
    ``plan.tiny_arch`` built under ``run_dir/init_model`` when there is none."""
    from ..vlm.tiny import build_tiny
    from .token_vla import TokenSpec, TokenVLA

    if plan.path is not None:
        path = plan.path
    elif run_dir is not None:
        path = build_tiny(plan.tiny_arch, Path(run_dir) / "init_model", seed=plan.seed)
    else:  # the caller's choice, not the recipe's: a fresh VLM is built under a run directory
        raise ConfigError("vla.policy=token needs model.path (a local image-text-to-text model)")
    spec = TokenSpec(action_dim=runner.action_dim, chunk=plan.chunk, bins=plan.bins)
    policy = TokenVLA.from_pretrained(path, spec, device=device, **dataclasses.asdict(plan.load))
    # a saved token policy keeps its own chunk and bins (token_vla.json), known once it is read
    if policy.spec.chunk != plan.chunk:
        raise ConfigError(
            f"model.path holds a TokenVLA with action chunk {policy.spec.chunk}; the recipe has "
            f"env.action_chunk={plan.chunk}"
        )
    if policy.spec.bins != plan.bins:
        raise ConfigError(
            f"model.path holds a TokenVLA with {policy.spec.bins} action bins; the recipe has "
            f"vla.action_bins={plan.bins}"
        )
    return policy


def load_policy(path: str | Path, device: str = "cpu", env: EnvConfig | None = None):
    """A VLA policy folder written by ``policy.save`` (`vla.hub`): a `TokenVLA` or a
    `CompactVLA` of any head, as its model_type says, after checking the folder (a `ModelError`
    names what is missing or inconsistent); with ``env``, one it acts in (`hub.check_env`)."""
    path = Path(path).expanduser()
    if read_manifest(path).model_type == TOKEN_TYPE:
        from .token_vla import TokenVLA

        policy = TokenVLA.from_pretrained(path, device=device)
    else:
        policy = CompactVLA.from_pretrained(path, device=device)
    if env is not None:
        check_env(policy.describe(), env)
    return policy


def _adopt(policy, cfg, plan: VLARunPlan, run_dir: str | Path, objective: str) -> None:
    """A saved policy (``model.path``) must fit the recipe's env (`hub.check_env`, beside
    `build_policy`'s chunk and encoder checks); from now on its folders record this run: its
    env, recipe and evaluations (`model_card.run_origin`)."""
    if plan.policy.path is not None:
        check_env(policy.describe(), plan.env, training=True)
    policy.origin = run_origin(cfg, run_dir, objective, warm_start=policy.origin)


def build_source(plan: CollectPlan, runner: VecEnv):
    """The collector ``plan`` names, on ``runner``'s envs."""
    if plan.replay is not None:
        from .offpolicy import ReplaySource

        return ReplaySource(plan.env, plan.replay, plan.gamma, seed=plan.seed, runner=runner)
    if plan.per_step:
        return PPOCollector(plan.env, seed=plan.seed, runner=runner)
    return GRPOCollector(
        plan.env, groups=plan.groups, group_size=plan.group_size, seed=plan.seed, runner=runner,
        branches=list(plan.branches), segment_steps=plan.segment_steps,
    )  # fmt: skip


def build_evaluator(env: EnvConfig):
    """Deterministic success on ``env.eval_episodes`` held-out seeds (a run evaluates when its
    plan says so: `VLARunPlan.evaluate`)."""
    return functools.partial(evaluate_policy, env_cfg=env)


def build_trainer(cfg, run_dir: str | Path) -> Trainer:
    """PPO (GAE) or GRPO-family training of a VLA policy on ``env.id``."""
    plan = resolve(cfg)
    seed_everything(plan.seed)
    if plan.pipeline is not None:  # envs live on the Ray workers; one here for the spaces
        spaces = make_envs(dataclasses.replace(plan.env, num_envs=1), seed=plan.seed)
        policy = build_policy(plan.policy, spaces, run_dir)
        spaces.close()
        source = pipeline_source(plan, Path(run_dir))
    else:
        runner = make_envs(plan.env, seed=plan.seed)
        policy = build_policy(plan.policy, runner, run_dir)
        source = build_source(plan.collect, runner)
    ref = copy.deepcopy(policy).requires_grad_(False) if plan.reference else None
    trainer = Trainer(
        cfg, policy, source, run_dir, engine=build_engine(policy, cfg.train), ref_policy=ref,
        evaluator=build_evaluator(plan.env) if plan.evaluate else None,
        objective="rl" if plan.collect.replay is None else "offpolicy",
    )  # fmt: skip
    _adopt(policy, cfg, plan, run_dir, trainer.objective)
    return trainer


def pipeline_source(plan: VLARunPlan, run_dir: Path):
    """A `PipelineSource` whose ``rollout.workers`` build `rollout_worker` from ``plan``."""
    from ..trainer.pipeline import PipelineSource
    from .records import describe_group

    p = plan.pipeline
    assert p is not None, "a run without train.pipeline collects in its own process"

    def describe(policy, batch, rows):  # the records' fields, as the collector gives them
        return describe_group(plan.env.id, batch, rows)

    return PipelineSource(
        p.mode, rollout_worker, (plan, str(run_dir)), workers=p.workers, cpus=p.cpus,
        gpus=p.gpus, max_staleness=p.max_staleness, buffer_chunks=p.buffer_chunks,
        worker_timeout_s=p.worker_timeout_s, timeout_s=p.timeout_s, address=p.address,
        imports=p.imports, describe=describe,
    )  # fmt: skip


def rollout_worker(plan: VLARunPlan, run_dir: str, index: int):
    """What a pipeline worker runs (in its own process): its share of the envs, a policy copy
    (its weights come from the trainer before the first chunk) and the recipe's collector."""
    mine = plan.worker(index)
    runner = make_envs(mine.env, seed=mine.seed)
    policy = build_policy(mine.policy, runner, Path(run_dir) / f"worker_{index}")
    return policy, build_source(mine.collect, runner)


def run_sft(cfg, run_dir: str | Path) -> dict[str, float]:
    """Behaviour cloning, the trainer's SFT objective (targets of ``env.action_chunk``
    actions): from the dataset ``bc.dataset`` names, else from the scripted experts (they step
    the envs one action at a time)."""
    plan = resolve(cfg)
    seed_everything(plan.seed)
    env = plan.env if plan.bc is None else dataclasses.replace(plan.env, num_envs=1)
    runner = make_envs(env, seed=plan.seed)  # the experts act every env step; else the spaces
    policy = build_policy(plan.policy, runner, run_dir)
    source = bc_source(plan, policy, runner)
    try:
        trainer = Trainer(
            cfg, policy, source, run_dir, engine=build_engine(policy, cfg.train),
            evaluator=build_evaluator(plan.env) if plan.evaluate else None, objective="sft",
        )  # fmt: skip
        _adopt(policy, cfg, plan, run_dir, "sft")
        return trainer.fit()
    finally:
        runner.close()


def bc_source(plan: VLARunPlan, policy, runner: VecEnv):
    """Behaviour cloning's source: `DatasetSource` on ``plan.bc``'s dataset (checked against
    ``runner``'s spaces), else `ExpertSource` driving ``runner``'s envs."""
    env = plan.env
    if plan.bc is None:
        from .bc import ExpertSource

        return ExpertSource(
            policy, runner, batch_steps=env.steps_per_rollout, chunk=env.action_chunk
        )
    from .bc_dataset import DatasetSource

    return DatasetSource(
        policy, plan.bc.dataset, {"observation": runner.observation_space,
                                  "action": runner.action_space},
        dict(plan.bc.features), rows=env.num_envs, steps=env.steps_per_rollout,
        chunk=env.action_chunk, seed=plan.seed,
        fps=getattr(runner.env, "metadata", {}).get("render_fps"),
    )  # fmt: skip


def run_eval(cfg, out_dir: Path, more=()) -> dict:
    """Deterministic success per task over ``env.eval_episodes`` fixed seeds, with a table and an
    mp4 per task (``env.eval_videos`` episodes). Returns ``{"table", "files"}``."""
    from ..trainer.trackers import log_eval_files
    from .evaluate import write_report

    # the command's arguments, which loading a recipe cannot know (training needs no model.path)
    if more:
        raise ConfigError("several recipes evaluate together only on side vlm")
    if not cfg.model.path:
        raise ConfigError(
            "perceptrl eval needs --model (a saved VLA, e.g. <run>/checkpoints/step_N/model)"
        )
    policy = load_policy(resolve_path(cfg.model.path), resolve_device(cfg.train.device), cfg.env)
    report = write_report(policy, _with_held_out_wordings(cfg.env), out_dir)
    files = [out_dir / "eval.json", out_dir / "eval.md", *map(Path, report["videos"].values())]
    log_eval_files([resolve_path(cfg.model.path)], files)  # its run's trackers, if any
    files += map(Path, report["datasets"].values())  # env.eval_dataset: LeRobot dataset folders
    return {"table": (out_dir / "eval.md").read_text().rstrip(), "files": files}


def _with_held_out_wordings(env: EnvConfig) -> EnvConfig:
    """``env`` evaluating every held-out wording when it names none and every evaluated task has
    them (a long-horizon task's composed instruction has none)."""
    from ..sim import task_of
    from ..sim.tasks import has_held_out
    from ..sim.wording import HELD_OUT

    tasks = [task_of(e) for e in env.eval_tasks or [env.id]]
    if env.eval_wordings or env.wording != "train" or not all(map(has_held_out, tasks)):
        return env
    return dataclasses.replace(env, eval_wordings=list(HELD_OUT))


def run_compare(cfgs: dict, out_dir: Path) -> dict:
    """Several saved VLAs (name -> config whose ``model.path`` is one of them) on the same
    held-out seeds: success per task and model in ``compare.md``/``compare.json``, and per task
    one mp4 with the models side by side (``env.eval_videos`` episodes). Returns
    ``{"table", "files"}``."""
    import json

    from ..trainer.trackers import log_eval_files
    from .evaluate import compare_video, evaluate_policy, task_name

    out_dir.mkdir(parents=True, exist_ok=True)
    first = next(iter(cfgs.values()))
    policies = {
        name: load_policy(resolve_path(c.model.path), resolve_device(c.train.device), c.env)
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
    log_eval_files([resolve_path(c.model.path) for c in cfgs.values()], files)
    return {"table": table, "files": files}


SIDES.register(
    "vla",
    Side(build_trainer, run_eval, run_sft=run_sft, run_compare=run_compare, check=check_vla),
)
