"""Builds a side's parts from a `Config`: data, policy, rollout source, reward and evaluator.

Kept beside cli.py (and out of trainer/) because it is the one place that knows datasets/,
vlm/, rewards/ and the trainer together; cli.py only parses arguments and prints.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path

from .trainer.config import Config, ConfigError
from .trainer.engine import build_engine
from .trainer.loop import Trainer
from .trainer.runtime import resolve_device

PACKAGE_ROOT = Path(__file__).resolve().parent
EVAL_REWARD = {"accuracy": 1.0}
"""Held-out accuracy: the correctness reward alone (no format bonus)."""


def resolve_path(path: str | Path) -> Path:
    """A path as given (absolute or relative to the working directory), else relative to the
    package, so recipes can name shipped files such as ``assets/vlm_base``."""
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute():
        return p
    shipped = PACKAGE_ROOT / p
    return shipped if shipped.exists() else p


# ---------------------------------------------------------------------------------------------
# VLM side
# ---------------------------------------------------------------------------------------------


def vlm_samples(cfg: Config, run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train, val) samples: the user's files, or the synthetic CLEVR-like set generated into
    ``run_dir/data`` (deterministic in ``data.seed``)."""
    from .datasets.loader import load_samples

    d = cfg.data
    if d.train:
        train, stats = load_samples(resolve_path(d.train), strict=d.strict)
        _report_skips(d.train, stats)
        val = []
        if d.val:
            val, stats = load_samples(resolve_path(d.val), strict=d.strict)
            _report_skips(d.val, stats)
        return train, val
    if d.generator == "video":
        return _video_samples(cfg, run_dir)
    if d.generator == "spatial":
        from .datasets.spatial import generate
    elif d.generator == "clevr":
        from .datasets.clevr import generate
    else:
        raise ConfigError(
            f"data.generator={d.generator!r} is not a synthetic generator; valid: clevr, video, "
            "spatial (or give data.train for your own JSONL/Parquet)"
        )
    paths = generate(
        run_dir / "data", splits={"train": d.n_train, "val": d.n_val}, families=d.families,
        seed=d.seed, image_size=d.image_size,
    )  # fmt: skip
    return (load_samples(paths["train"])[0], load_samples(paths["val"])[0])


def _video_samples(cfg: Config, run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The synthetic moving-shapes video questions (mp4 files under ``run_dir/data``)."""
    from .datasets.loader import load_samples
    from .datasets.video import FAMILIES, generate

    d = cfg.data
    families = [f for f in d.families if f in FAMILIES]
    if not families:
        raise ConfigError(
            f"data.generator=video needs video families in data.families (got {d.families}); "
            f"valid: {list(FAMILIES)}"
        )
    paths = generate(
        run_dir / "data", splits={"train": d.n_train, "val": d.n_val}, families=families,
        seed=d.seed, size=d.image_size, seconds=d.video_seconds, fps=d.video_fps,
    )  # fmt: skip
    return (load_samples(paths["train"])[0], load_samples(paths["val"])[0])


def _report_skips(path: str, stats: dict) -> None:
    skipped = {k: v for k, v in stats.items() if k.startswith("skipped") and v}
    if skipped:
        print(f"perceptrl: lenient data mode skipped samples of {path}: {skipped}")


def vlm_policy(cfg: Config, run_dir: Path):
    """The policy from ``model.path`` (a local HF directory), or a freshly built tiny model."""
    from .vlm.policy import VLMPolicy
    from .vlm.prompts import PromptConfig
    from .vlm.tiny import build_tiny

    m = cfg.model
    if m.path:
        path = resolve_path(m.path)
    else:
        path = build_tiny(m.tiny_arch, run_dir / "init_model", seed=cfg.train.seed)
    prompt = PromptConfig(
        system_prompt=cfg.rollout.system_prompt,
        max_prompt_length=cfg.rollout.max_prompt_length,
        min_pixels=m.min_pixels or None,
        max_pixels=m.max_pixels or None,
        video=cfg.video,
    )
    policy = VLMPolicy.from_pretrained(
        path, prompt=prompt, dtype=m.dtype, device=resolve_device(cfg.train.device),
        gradient_checkpointing=m.gradient_checkpointing, trust_remote_code=m.trust_remote_code,
        share_prefix=m.share_prefix,
    )  # fmt: skip
    if m.lora_rank > 0:
        from .vlm.lora import apply_lora

        policy = apply_lora(
            policy, rank=m.lora_rank, alpha=m.lora_alpha, dropout=m.lora_dropout,
            targets=m.lora_target_modules, vision=m.lora_vision,
        )  # fmt: skip
    return policy


def vlm_evaluator(cfg: Config, val: list[dict]):
    """Greedy held-out accuracy per question family, or None without validation data."""
    if not val or cfg.train.eval_samples <= 0:
        return None
    from .rewards import build_reward
    from .vlm.source import evaluate_accuracy

    return functools.partial(
        evaluate_accuracy, samples=val[: cfg.train.eval_samples],
        reward=build_reward(EVAL_REWARD, timeout_s=cfg.rollout.reward_timeout_s),
        batch_size=max(cfg.rollout.prompts_per_step * cfg.rollout.group_size, 16),
        max_new_tokens=cfg.rollout.max_new_tokens, strict=cfg.data.strict,
        token_budget=cfg.rollout.token_budget,
    )  # fmt: skip


def vllm_policy(cfg: Config, policy, run_dir: Path):
    """The policy with its rollouts on a colocated vLLM engine (``rollout.engine=vllm``); the
    engine starts from the policy's weights, written to ``run_dir/rollout_init``, and receives the
    trainer's weights before every rollout."""
    from .vlm.vllm_rollout import VLLMEngine, VLLMRolloutPolicy

    if getattr(cfg.model, "lora_rank", 0):
        raise ConfigError(
            "rollout.engine=vllm does not sync LoRA adapters yet; use model.lora_rank=0"
        )
    if getattr(cfg.train, "backend", "torch") == "deepspeed" and cfg.train.zero_stage == 3:
        raise ConfigError(
            "rollout.engine=vllm pushes each rank's full weights to its engine, but ZeRO-3 "
            "partitions them; use train.zero_stage=2"
        )
    r, m = cfg.rollout, cfg.model
    init = run_dir / "rollout_init"
    policy.save(init)
    pixels = {"min_pixels": m.min_pixels, "max_pixels": m.max_pixels}
    engine = VLLMEngine(
        init, policy.processor, r.vllm, dtype=m.dtype, stop_ids=policy.stop_ids,
        max_model_len=r.vllm.max_model_len or r.max_prompt_length + r.max_new_tokens,
        mm_processor_kwargs={k: v for k, v in pixels.items() if v} or None,
    )  # fmt: skip
    return VLLMRolloutPolicy.colocate(policy, engine)


def vlm_trainer(cfg: Config, run_dir: Path) -> Trainer:
    """GRPO (or any registered estimator/loss) on the VLM side."""
    from .rewards import build_reward
    from .vlm.source import VLMRolloutSource

    if cfg.rollout.engine not in ("hf", "vllm"):
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r}: valid engines are hf, vllm")
    train, val = on_rank0(vlm_samples, cfg, run_dir)
    policy = vlm_policy(cfg, run_dir)
    policy.temperature = cfg.rollout.temperature  # score the distribution the rollouts sample
    if cfg.rollout.engine == "vllm":
        policy = vllm_policy(cfg, policy, run_dir)
    reward = build_reward(cfg.rollout.reward, timeout_s=cfg.rollout.reward_timeout_s)
    # LoRA: the base with adapters disabled (no copy); full fine-tuning: a frozen copy, taken
    # before a DeepSpeed engine partitions the weights
    ref = policy.reference() if cfg.algo.kl_coef > 0 else None
    engine = build_engine(policy, cfg.train)
    train, rollout_cfg, seed = data_shard(cfg, train, engine.rank, engine.world_size)
    source = VLMRolloutSource(
        train, reward, rollout_cfg, seed=seed, strict=cfg.data.strict,
        min_pixels=cfg.model.min_pixels or None, max_pixels=cfg.model.max_pixels or None,
        video=cfg.video, return_logprobs=cfg.algo.tis_cap > 0,
    )  # fmt: skip
    return Trainer(
        cfg, policy, source, run_dir, ref_policy=ref, evaluator=vlm_evaluator(cfg, val),
        engine=engine,
    )  # fmt: skip


def on_rank0(fn, *args):
    """``fn(*args)`` computed once, by rank 0, and its result sent to every rank (a single
    writer for synthetic data under data parallelism); a plain call in one process."""
    from .trainer.deepspeed_engine import (
        broadcast_object,
        init_distributed,
        launched_distributed,
        rank_and_world,
    )

    if not launched_distributed():
        return fn(*args)
    init_distributed()
    return broadcast_object(fn(*args) if rank_and_world()[0] == 0 else None)


def data_shard(cfg: Config, train: list[dict], rank: int, world: int):
    """This rank's (samples, rollout config, seed) under data parallelism: samples
    ``rank::world``, ``prompts_per_step / world`` prompts a step (the global batch stays
    ``rollout.prompts_per_step`` prompts) and its own sampling seed. Identity in one process."""
    if world == 1:
        return train, cfg.rollout, cfg.train.seed
    if cfg.rollout.prompts_per_step % world:
        raise ConfigError(
            f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} does not split over {world} "
            "ranks; make it a multiple of the number of processes"
        )
    if len(train) < world:
        raise ConfigError(f"{len(train)} training samples cannot be split over {world} ranks")
    per_rank = dataclasses.replace(
        cfg.rollout, prompts_per_step=cfg.rollout.prompts_per_step // world
    )
    return train[rank::world], per_rank, cfg.train.seed + 1_000_003 * rank


def vlm_sft(cfg: Config, run_dir: Path) -> dict[str, float]:
    """Supervised warm start on templated reasoning traces of the synthetic tasks."""
    from .datasets.clevr import reasoning_trace

    if cfg.data.generator == "spatial":
        from .datasets.spatial import reasoning_trace
    if cfg.data.generator == "video":
        from .datasets.video import reasoning_trace
    from .vlm.sft import VLMSFTSource

    train, val = vlm_samples(cfg, run_dir)
    policy = vlm_policy(cfg, run_dir)
    try:
        targets = [reasoning_trace(s) for s in train]
    except (KeyError, ValueError) as e:
        raise ConfigError(
            f"perceptrl sft builds targets from the synthetic generator's scene metadata; sample "
            f"lacks it ({e}). Use data.train= empty (synthetic) or samples written by "
            "`perceptrl data generate`."
        ) from e
    source = VLMSFTSource(
        policy, train, targets, batch_size=cfg.rollout.prompts_per_step, seed=cfg.train.seed
    )
    trainer = Trainer(
        cfg, policy, source, run_dir, evaluator=vlm_evaluator(cfg, val), objective="sft"
    )
    return trainer.fit()


def vlm_eval(cfg: Config, out_dir: Path, more: Sequence[Config] = ()) -> dict:
    """Greedy held-out accuracy of ``model.path`` per question family, grouped by modality
    (image, video, 3D), on the recipe's task set and on each of ``more`` (other recipes, each with
    its own data and prompt settings; the model is the first recipe's). Writes ``eval.json``,
    ``eval.md`` and the bar chart ``eval.png`` into ``out_dir`` (see vlm/report.py)."""
    from .vlm.report import family_rows, write_report

    policy, rows, sets = None, [], []
    for i, c in enumerate([cfg, *more]):
        if not c.data.train:
            c.data.n_train = 1  # only the validation split is needed
        _, val = vlm_samples(c, out_dir if i == 0 else out_dir / f"taskset_{i}")
        evaluator = vlm_evaluator(c, val)
        if evaluator is None:
            raise ConfigError(
                "nothing to evaluate: set data.val (or leave it empty for synthetic) and "
                "train.eval_samples > 0"
            )
        policy = policy or vlm_policy(cfg, out_dir)
        prompt = dataclasses.replace(
            policy.prompt, system_prompt=c.rollout.system_prompt,
            max_prompt_length=c.rollout.max_prompt_length,
            min_pixels=c.model.min_pixels or None, max_pixels=c.model.max_pixels or None,
            video=c.video,
        )  # fmt: skip
        metrics = evaluator(policy, prompt=prompt)
        rows += family_rows(metrics, val[: c.train.eval_samples])
        sets.append({"data": c.data.val or f"synthetic {c.data.generator}", "metrics": metrics})
    return write_report(rows, out_dir, model=cfg.model.path, extra={"task_sets": sets})


def vla_eval(cfg: Config, out_dir: Path) -> dict:
    """Deterministic success per task over ``env.eval_episodes`` fixed seeds, with a table and an
    mp4 per task (``env.eval_videos`` episodes)."""
    from .vla.evaluate import write_report
    from .vla.run import load_policy

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


TRAINERS = {"vlm": vlm_trainer}
SFT = {"vlm": vlm_sft}
EVALS = {"vlm": vlm_eval, "vla": vla_eval}


def side(table: dict, cfg: Config, what: str):
    if cfg.side not in table:
        raise ConfigError(
            f"side={cfg.side!r} has no {what} yet (available: {', '.join(sorted(table))})"
        )
    return table[cfg.side]


def _vla_trainer(cfg: Config, run_dir: Path) -> Trainer:
    from .vla.run import build_trainer

    return build_trainer(cfg, run_dir)


def _vla_sft(cfg: Config, run_dir: Path) -> dict[str, float]:
    from .vla.run import run_sft

    return run_sft(cfg, run_dir)


TRAINERS["vla"] = _vla_trainer
SFT["vla"] = _vla_sft
