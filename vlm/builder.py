"""Builds the VLM side from a recipe: data, policy, rollout source, reward, evaluator, trainer.

This module registers side ``vlm`` (`build_trainer`, `run_sft`, `run_eval`, `run_pass_k`;
``vla/builder.py`` registers the VLA side). The prompt settings (`prompt_config`) and the
sampling settings (`sampling_params`) are built once, here, and handed to the policy; the rollout
source and ``evaluate`` both read them from it, so the distribution the trainer scores is the
one the rollouts sampled.

Data is checked before a run starts: `load_data` reads the files (bad records, images and videos
are errors, or skipped and counted with ``data.strict=false``) and, once the policy's processor
exists, `fit_prompts` measures every prompt against ``rollout.max_prompt_length``. The counts of
skipped samples go into the run's metrics as ``data/skipped_<reason>``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..datasets.loader import DataError
from ..registry import EPISODE_ENVS, GENERATORS, SIDES, Entry, Side, UnknownName
from ..trainer.config import ConfigError
from ..trainer.distributed import on_rank0
from ..trainer.engine import build_engine
from ..trainer.loop import Trainer
from ..trainer.runtime import resolve_device, resolve_path
from .episode import EpisodeSettings
from .kv_sampler import TreeShape
from .prompts import PromptConfig, PromptLengths, too_long_error
from .rollout import SamplingParams
from .tool_env import check_sample_tools, resolve_tools
from .video import VideoLoadError

EVAL_REWARD = {"accuracy": 1.0}
"""Held-out accuracy: the correctness reward alone (no format bonus)."""


# ---------------------------------------------------------------------------------------------
# settings built once
# ---------------------------------------------------------------------------------------------


def prompt_config(cfg) -> PromptConfig:
    """How samples become prompts: ``rollout.system_prompt``/``max_prompt_length``, the
    ``model`` pixel bounds, the ``video`` section and the usage of ``rollout.episode.tools``."""
    tools = {name: t.usage for name, t in _tools(cfg).items()}
    return PromptConfig(
        system_prompt=cfg.rollout.system_prompt, max_prompt_length=cfg.rollout.max_prompt_length,
        min_pixels=cfg.model.min_pixels or None, max_pixels=cfg.model.max_pixels or None,
        video=cfg.video, tools=tools,
    )  # fmt: skip


def _tools(cfg) -> dict:
    try:
        return resolve_tools(cfg.rollout.episode.tools)
    except ValueError as e:
        raise ConfigError(f"rollout.episode.tools: {e}") from e


def episode_settings(cfg) -> EpisodeSettings | None:
    """Multi-turn settings from ``rollout.episode`` (None without tools or another environment:
    one turn per rollout); the environment is the registered ``rollout.episode.env`` (``tools``:
    a `ToolEnv` of the recipe's tools)."""
    e, m = cfg.rollout.episode, cfg.model
    if not e.tools and e.env == "tools":
        return None
    for name in ("max_turns", "max_tokens", "max_images", "max_vision_tokens"):
        if getattr(e, name) < (0 if name in ("max_images", "max_vision_tokens") else 1):
            raise ConfigError(f"rollout.episode.{name}={getattr(e, name)} is out of range")
    if any(not isinstance(x, str) or not x for x in e.stop):
        raise ConfigError(f"rollout.episode.stop={e.stop!r}: stop strings must be non-empty text")
    env = episode_env(cfg).obj(cfg)
    return EpisodeSettings(
        env=env, max_turns=e.max_turns, max_tokens=e.max_tokens, max_images=e.max_images,
        max_vision_tokens=e.max_vision_tokens, observation_role=e.observation_role,
        min_pixels=e.min_pixels or m.min_pixels or None,
        max_pixels=e.max_pixels or m.max_pixels or None, tool_names=tuple(e.tools),
        stop=tuple(e.stop),
    )  # fmt: skip


def multi_turn(cfg) -> bool:
    """Rollouts are multi-turn episodes: the recipe enables tools or names another
    environment."""
    e = cfg.rollout.episode
    return bool(e.tools) or e.env != "tools"


def completion_length(cfg) -> int:
    """Most tokens after a prompt: one completion, or a whole episode (turns and observations)."""
    return cfg.rollout.episode.max_tokens if multi_turn(cfg) else cfg.rollout.max_new_tokens


def episode_env(cfg) -> Entry:
    """The registered ``rollout.episode.env``: ``build(cfg) -> factory`` and its declared
    ``eval_reward``."""
    try:
        return EPISODE_ENVS.entry(cfg.rollout.episode.env)
    except UnknownName as e:
        raise ConfigError(str(e)) from None


def tree_shape(cfg) -> TreeShape | None:
    """The tree of ``rollout.tree`` (None: flat groups), checked against the rest of the recipe."""
    t, r = cfg.rollout.tree, cfg.rollout
    if not t.branches:
        return None
    where = f"rollout.tree.branches={t.branches}"
    if r.engine == "hf" and r.sampler != "fork":
        raise ConfigError(f"{where} needs rollout.sampler=fork on the HF engine")
    if r.engine == "vllm" and (multi_turn(cfg) or t.allocate != "uniform"):
        raise ConfigError(
            f"{where} on rollout.engine=vllm grows single-turn trees with "
            "rollout.tree.allocate=uniform (entropy needs the next-token distribution, which vLLM "
            "does not return; episode trees fork the HF cache); use rollout.engine=hf"
        )
    if multi_turn(cfg) and len(t.branches) > r.episode.max_turns:
        raise ConfigError(
            f"{where}: an episode tree forks after a turn; {len(t.branches)} levels need "
            f"rollout.episode.max_turns >= {len(t.branches)}"
        )
    try:
        shape = TreeShape(tuple(t.branches), t.segment_tokens, t.allocate)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if shape.leaves != r.group_size:
        raise ConfigError(
            f"{where} has {shape.leaves} leaves per prompt; set rollout.group_size={shape.leaves}"
        )
    if (not multi_turn(cfg) and len(shape.branches) > 1
            and (len(shape.branches) - 1) * t.segment_tokens >= r.max_new_tokens):  # fmt: skip
        raise ConfigError(
            f"{where}: {len(shape.branches) - 1} segments of {t.segment_tokens} tokens leave "
            f"nothing of rollout.max_new_tokens={r.max_new_tokens} for the last segment"
        )
    return shape


def sampling_params(cfg) -> SamplingParams:
    """How the rollouts sample (``rollout`` section); the engine's own log-probs are kept when
    truncated importance sampling needs them (``algo.tis_cap``)."""
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
        token_budget=r.token_budget, return_logprobs=cfg.algo.tis_cap > 0,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------


@dataclass
class Data:
    """A run's samples and what loading them found."""

    train: list[dict] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    """samples skipped (``data.strict=false``) by reason: malformed, images, videos, too_long"""
    media: dict[str, tuple] = field(default_factory=dict)
    """path -> size (and frames, fps) of each checked image and video (see ``load_samples``)"""
    where: dict[str, str] = field(default_factory=dict)
    """split -> how messages name its data (``data.train=<file>``, or the synthetic set)"""

    def metrics(self) -> dict[str, float]:
        """``data/skipped_<reason>`` of each reason that skipped samples."""
        return {f"data/skipped_{k}": float(v) for k, v in self.skipped.items() if v}


def load_data(cfg, run_dir: Path) -> Data:
    """The user's ``data.train``/``data.val`` files (strict or lenient: ``data.strict``), or the
    ``data.generator`` set generated into ``run_dir/data`` (deterministic in ``data.seed``)."""
    from ..datasets.loader import load_samples

    d, data = cfg.data, Data()
    if d.train:
        files = {"train": d.train, "val": d.val}
        data.where = {k: f"data.{k}={v}" for k, v in files.items()}
    else:
        files = _generate(cfg, run_dir)
        data.where = {k: f"the synthetic {k} set ({d.generator}: {v})" for k, v in files.items()}
    for split, file in files.items():
        if not file:
            continue
        try:
            got, stats = load_samples(
                resolve_path(file), strict=d.strict or not d.train, media=data.media
            )
        except FileNotFoundError as e:
            raise ConfigError(
                f"data.{split}={file}: {e}; give the path of a JSONL/Parquet file"
            ) from e
        setattr(data, split, got)
        _report_skips(data, split, {k[8:]: v for k, v in stats.items() if k.startswith("skipped_")})
        try:
            check_sample_tools(got, _tools(cfg), data.where[split])
        except ValueError as e:
            raise DataError(f"{e}. Enable it there or remove it from the sample.") from e
    return data


def _generate(
    cfg, run_dir: Path, sizes: dict[str, int] | None = None, seed: int | None = None
) -> dict[str, Path | None]:
    """split -> file of the generated synthetic set (None for a split of no samples); by
    default the ``data.n_train``/``data.n_val`` splits at ``data.seed``."""
    d = cfg.data
    sizes = sizes or {"train": d.n_train, "val": d.n_val}
    try:
        paths = GENERATORS.get(d.generator).generate(
            run_dir / "data", sizes, d.families, seed=d.seed if seed is None else seed,
            image_size=d.image_size, seconds=d.video_seconds, fps=d.video_fps,
        )  # fmt: skip
    except (KeyError, ValueError) as e:
        raise ConfigError(f"data.generator={d.generator!r}, data.families: {e}") from e
    return {k: paths[k] if n > 0 else None for k, n in sizes.items()}


def samples(cfg, run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train, val) samples of `load_data` (prompt lengths unchecked: that needs the policy's
    processor, see `fit_prompts`)."""
    data = load_data(cfg, run_dir)
    return data.train, data.val


def fit_prompts(cfg, processor, data: Data, splits: Sequence[str] = ("train", "val")) -> Data:
    """Every prompt of ``splits`` measured against ``rollout.max_prompt_length`` before the run
    starts, not when it is first drawn: strict, one `PromptTooLongError` lists them and says
    per cause (text or vision tokens) which setting helps; lenient, they are dropped and counted
    as ``too_long``. The lengths come without pixel processing (`PromptLengths`: one encoding
    per distinct image size or video shape; about 1 ms a sample)."""
    prompt = prompt_config(cfg)
    if not prompt.max_prompt_length:
        return data
    lengths = PromptLengths(processor, prompt, media=data.media)
    for split in splits:
        keep, rows, bad = _measure(getattr(data, split), lengths, prompt.max_prompt_length, cfg)
        if rows and cfg.data.strict:
            raise too_long_error(rows, prompt, processor, where=data.where[split])
        before = len(getattr(data, split))
        setattr(data, split, keep)
        _report_skips(data, split, {**bad, "too_long": len(rows)})
        if before and not keep:
            raise DataError(
                f"no sample of {data.where[split]} is left (skipped: {data.skipped}); see the "
                "messages above, or set data.strict=true to stop at the first bad sample"
            )
    return data


def _measure(items: list[dict], lengths: PromptLengths, limit: int, cfg):
    """(samples that fit, ``(sample, index, tokens, vision tokens)`` of those too long,
    {"images", "videos": count of samples whose files failed now, lenient})."""
    keep, rows, bad = [], [], {"images": 0, "videos": 0}
    for i, s in enumerate(items):
        try:
            n, v = lengths(s, index=i)
        except DataError as e:  # a file that changed since the loader checked it
            if cfg.data.strict:
                raise
            bad["videos" if isinstance(e, VideoLoadError) else "images"] += 1
            continue
        if n > limit:
            rows.append((s, i, n, v))
        else:
            keep.append(s)
    return keep, rows, bad


def _report_skips(data: Data, split: str, skipped: dict[str, int]) -> None:
    """Count lenient skips into ``data.skipped`` and say so on stdout."""
    skipped = {k: v for k, v in skipped.items() if v}
    for k, v in skipped.items():
        data.skipped[k] = data.skipped.get(k, 0) + v
    if skipped:
        print(f"perceptrl: lenient data mode skipped samples of {data.where[split]}: {skipped}")


def data_shard(cfg, train: list[dict], rank: int, world: int):
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


# ---------------------------------------------------------------------------------------------
# policy, evaluator, trainer
# ---------------------------------------------------------------------------------------------


def build_policy(cfg, run_dir: Path):
    """The policy from ``model.path`` (a local HF directory), or a freshly built tiny model,
    with the recipe's prompt and sampling settings (and LoRA adapters if asked)."""
    from .policy import VLMPolicy
    from .tiny import build_tiny

    m = cfg.model
    if m.path:
        path = resolve_path(m.path)
    else:
        # written once (by rank 0 under torchrun: ranks writing one directory at once raced)
        make = functools.partial(
            build_tiny, m.tiny_arch, run_dir / "init_model", seed=cfg.train.seed
        )
        path = on_rank0(make)
    policy = VLMPolicy.from_pretrained(
        path, prompt=prompt_config(cfg), sampling=sampling_params(cfg), dtype=m.dtype,
        device=resolve_device(cfg.train.device), gradient_checkpointing=m.gradient_checkpointing,
        trust_remote_code=m.trust_remote_code, share_prefix=m.share_prefix,
        episode=episode_settings(cfg), tree=tree_shape(cfg), fork=cfg.rollout.sampler == "fork",
    )  # fmt: skip
    if m.lora_rank > 0:
        from .lora import apply_lora

        policy = apply_lora(
            policy, rank=m.lora_rank, alpha=m.lora_alpha, dropout=m.lora_dropout,
            targets=m.lora_target_modules, vision=m.lora_vision,
        )  # fmt: skip
    return policy


def eval_reward(cfg) -> dict[str, float]:
    """The held-out score of the recipe: `EVAL_REWARD`, or its episode environment's own (the
    planner's task success for ``rollout.episode.env=plan``)."""
    return episode_env(cfg).meta["eval_reward"] or EVAL_REWARD


def build_evaluator(cfg, val: list[dict]):
    """Greedy held-out accuracy per question family, or None without validation data."""
    if not val or cfg.train.eval_samples <= 0:
        return None
    from ..rewards import build_reward
    from .source import evaluate_accuracy

    return functools.partial(
        evaluate_accuracy, samples=val[: cfg.train.eval_samples],
        reward=build_reward(eval_reward(cfg), timeout_s=cfg.rollout.reward_timeout_s),
        batch_size=max(cfg.rollout.prompts_per_step * cfg.rollout.group_size, 16),
        max_new_tokens=cfg.rollout.max_new_tokens, strict=cfg.data.strict,
        token_budget=cfg.rollout.token_budget,
    )  # fmt: skip


def vllm_policy(cfg, policy, run_dir: Path):
    """The policy with its rollouts on a colocated vLLM engine (``rollout.engine=vllm``); the
    engine starts from the policy's weights, written to ``run_dir/rollout_init``, and receives the
    trainer's weights before every rollout."""
    from .vllm_policy import VLLMRolloutPolicy
    from .vllm_rollout import VLLMEngine

    if cfg.model.lora_rank:
        raise ConfigError(
            "rollout.engine=vllm does not sync LoRA adapters yet; use model.lora_rank=0"
        )
    if cfg.train.backend == "deepspeed" and cfg.train.zero_stage == 3:
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
        max_model_len=r.vllm.max_model_len or r.max_prompt_length + completion_length(cfg),
        mm_processor_kwargs={k: v for k, v in pixels.items() if v} or None,
    )  # fmt: skip
    return VLLMRolloutPolicy.colocate(policy, engine)


def process_reward(cfg, policy):
    """The process reward of ``rollout.process_reward`` (None: outcome only)."""
    name, params = cfg.rollout.process_reward, dict(cfg.rollout.process_params)
    if not name:
        return None
    from .process import IMPLICIT, ImplicitPRM, RuleSteps

    where = f"rollout.process_reward={name}"
    if name == IMPLICIT:
        if multi_turn(cfg):
            raise ConfigError(
                f"{where}: the implicit PRM of multi-turn episodes is not supported yet (a "
                "rule-based step reward is: e.g. plan_turns on the plan side)"
            )
        unknown = sorted(set(params) - {"beta", "lr"})
        if unknown:
            raise ConfigError(f"rollout.process_params {unknown}: implicit_prm takes beta, lr")
        return ImplicitPRM(policy, micro_batch_size=cfg.train.micro_batch_size, **params)
    try:  # what the step reward declares to prepare runs here (judge_steps: its worker loads)
        return RuleSteps(
            name, policy.processor.tokenizer, params, timeout_s=cfg.rollout.reward_timeout_s
        )
    except (ValueError, RuntimeError) as e:  # RuntimeError: the judge's worker did not start
        raise ConfigError(f"rollout.process_reward: {e}") from e


def build_trainer(cfg, run_dir: Path, worker: Callable | None = None) -> Trainer:
    """GRPO (or any registered estimator/loss) on the VLM side. ``worker``: what a pipeline
    worker runs (default `rollout_worker`; a side that registers its own episode environment
    passes a function of its module, so that the worker process imports it)."""
    from ..rewards import build_reward
    from .source import VLMRolloutSource

    data = on_rank0(load_data, cfg, run_dir)
    policy = build_policy(cfg, run_dir)
    data = on_rank0(fit_prompts, cfg, policy.processor, data)
    if cfg.rollout.engine == "vllm":
        policy = vllm_policy(cfg, policy, run_dir)
    reward = build_reward(cfg.rollout.reward, timeout_s=cfg.rollout.reward_timeout_s)
    # LoRA: the base with adapters disabled (no copy); full fine-tuning: a frozen copy, taken
    # before a DeepSpeed engine partitions the weights
    ref = policy.reference() if cfg.algo.kl_coef > 0 else None
    engine = build_engine(policy, cfg.train)
    train, rollout_cfg, seed = data_shard(cfg, data.train, engine.rank, engine.world_size)
    if cfg.train.pipeline != "sync":
        guide_traces(cfg, [])  # refused with a pipeline
        if cfg.rollout.process_reward:
            raise ConfigError(
                "rollout.process_reward runs in the trainer's process; use train.pipeline=sync"
            )
        # every sample: the workers split them, and rank 0 the step's groups over the ranks
        source = pipeline_source(cfg, run_dir, data.train, engine.rank, engine.world_size, worker)
    else:
        source = VLMRolloutSource(
            train, reward, rollout_cfg, seed=seed, strict=cfg.data.strict,
            data_skipped=data.skipped, process=process_reward(cfg, policy),
            guide=guide_traces(cfg, train),
        )  # fmt: skip
    return Trainer(
        cfg, policy, source, run_dir, ref_policy=ref, evaluator=build_evaluator(cfg, data.val),
        engine=engine,
    )  # fmt: skip


def pipeline_source(
    cfg, run_dir: Path, train: list[dict], rank: int = 0, world_size: int = 1,
    worker: Callable | None = None,
):  # fmt: skip
    """``train.pipeline = one_step_off | async``: rollouts on ``rollout.workers`` Ray actors,
    each with a policy copy and its shard of the samples ``train`` (all of them; see
    trainer/pipeline.py), built by ``worker`` (default `rollout_worker`). With several ranks,
    rank 0 drives the workers and scatters each step's groups to the ranks (`RankShards`)."""
    from ..trainer.pipeline import PipelineSource, RankShards

    if cfg.rollout.engine == "vllm" and cfg.rollout.workers > 1 and not cfg.rollout.worker_gpus:
        raise ConfigError("rollout.engine=vllm workers need rollout.worker_gpus > 0")
    if rank != 0:
        return RankShards(None, rank, world_size)
    model = cfg.model.path or str(run_dir / "init_model")  # built once, by the trainer
    r, t = cfg.rollout, cfg.train
    source = PipelineSource(
        t.pipeline, worker or rollout_worker, (cfg, str(run_dir), model, train),
        workers=r.workers, cpus=r.worker_cpus,
        gpus=r.worker_gpus, max_staleness=t.max_staleness, buffer_chunks=t.pipeline_buffer,
        worker_timeout_s=r.worker_timeout_s, timeout_s=t.pipeline_timeout_s,
        address=t.ray_address,
    )  # fmt: skip
    return source if world_size == 1 else RankShards(source, rank, world_size)


def rollout_worker(cfg, run_dir: str, model: str, train: list[dict], index: int):
    """What a pipeline worker runs (in its own process): the recipe's policy on ``model`` with
    the engine's behaviour log-probs kept, and a rollout source over its shard of the samples
    producing ``ceil(prompts_per_step / workers)`` groups per call."""
    from ..rewards import build_reward
    from .source import VLMRolloutSource

    workers = cfg.rollout.workers
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=model),
        train=dataclasses.replace(cfg.train, device="cuda" if cfg.rollout.worker_gpus else "cpu"),
    )  # fmt: skip
    worker_dir = Path(run_dir) / f"worker_{index}"
    policy = build_policy(cfg, worker_dir)
    policy.sampling = dataclasses.replace(policy.sampling, return_logprobs=True)
    if cfg.rollout.engine == "vllm":
        policy = vllm_policy(cfg, policy, worker_dir)
    rollout_cfg = dataclasses.replace(
        cfg.rollout, prompts_per_step=-(-cfg.rollout.prompts_per_step // workers)
    )
    reward = build_reward(cfg.rollout.reward, timeout_s=cfg.rollout.reward_timeout_s)
    source = VLMRolloutSource(
        train[index::workers], reward, rollout_cfg, seed=cfg.train.seed + 7919 * (index + 1),
        strict=cfg.data.strict,
    )  # fmt: skip
    return policy, source


# ---------------------------------------------------------------------------------------------
# SFT and evaluation runs
# ---------------------------------------------------------------------------------------------


def run_sft(
    cfg, run_dir: Path, teacher: Callable[[dict, str], str] | None = None
) -> dict[str, float]:
    """Supervised warm start on the generator's templated reasoning traces; ``teacher(sample,
    trace)``, when given, rewrites each target (e.g. an imperfect teacher's traces)."""
    from .sft import VLMSFTSource

    data = load_data(cfg, run_dir)
    policy = build_policy(cfg, run_dir)
    data = fit_prompts(cfg, policy.processor, data)
    train = data.train
    targets = reference_traces(cfg, train, "perceptrl sft builds targets")
    if teacher is not None:
        targets = [teacher(s, t) for s, t in zip(train, targets)]
    source = VLMSFTSource(
        policy, train, targets, batch_size=cfg.rollout.prompts_per_step, seed=cfg.train.seed
    )
    trainer = Trainer(
        cfg, policy, source, run_dir, engine=build_engine(policy, cfg.train),
        evaluator=build_evaluator(cfg, data.val), objective="sft",
    )  # fmt: skip
    if data.metrics():  # once, at step 0 (an SFT run is never resumed)
        trainer.logger.log(0, data.metrics())
    return trainer.fit()


def reference_trace(cfg) -> Callable[[dict], str | list[str]]:
    """The recipe's generator's reference trace of a sample (a text, or an episode's turns):
    the SFT target, and the guide rows of ``rollout.guide``."""
    gen = GENERATORS.get(cfg.data.generator)
    return functools.partial(gen.reasoning_trace, tools=cfg.rollout.episode.tools)


def reference_traces(cfg, samples: list[dict], who: str) -> list[str | list[str]]:
    """`reference_trace` of each sample; ``who`` opens the error when a sample lacks the
    generator's scene metadata."""
    try:
        trace = reference_trace(cfg)
        return [trace(s) for s in samples]
    except (KeyError, ValueError) as e:
        raise ConfigError(
            f"{who} from the synthetic generator's scene metadata; sample lacks it ({e}). Use "
            "data.train= empty (synthetic) or samples written by `perceptrl data generate`."
        ) from e


def guide_traces(cfg, train: list[dict]) -> Callable[[dict], str | list[str]] | None:
    """``rollout.guide``'s reference trace of a training sample (None when the recipe has no
    guide rows), checked against the rest of the recipe and on every sample of ``train``."""
    r = cfg.rollout
    if not r.guide:
        return None
    where = f"rollout.guide={r.guide}"
    if not 0 < r.guide < r.group_size:
        raise ConfigError(
            f"{where}: a group needs at least one sample; set 0 < rollout.guide < "
            f"rollout.group_size ({r.group_size})"
        )
    if r.tree.branches:
        raise ConfigError(f"{where} with rollout.tree.branches: a trace is no branch of a tree")
    if cfg.algo.tis_cap > 0:
        raise ConfigError(
            f"{where} with algo.tis_cap > 0: guide rows have no sampling log-probs to correct"
        )
    if cfg.train.pipeline != "sync":
        raise ConfigError(f"{where} runs in the trainer's process; use train.pipeline=sync")
    reference_traces(cfg, train, f"{where} takes each sample's trace")  # fails at start-up
    return reference_trace(cfg)


def run_eval(cfg, out_dir: Path, more: Sequence = ()) -> dict:
    """Greedy held-out accuracy of ``model.path`` per question family, grouped by modality
    (image, video, 3D), on the recipe's task set and on each of ``more`` (other recipes, each with
    its own data and prompt settings; the model is the first recipe's). Writes ``eval.json``,
    ``eval.md`` and the bar chart ``eval.png`` into ``out_dir`` (see vlm/report.py)."""
    from .report import family_rows, write_report

    policy, rows, sets = None, [], []
    for i, c in enumerate([cfg, *more]):
        data = eval_data(c, out_dir if i == 0 else out_dir / f"taskset_{i}")
        policy = policy or build_policy(cfg, out_dir)
        val = fit_prompts(c, policy.processor, data, splits=("val",)).val
        metrics = build_evaluator(c, val)(policy, prompt=prompt_config(c))
        rows += family_rows(metrics, val[: c.train.eval_samples])
        sets.append({"data": c.data.val or f"synthetic {c.data.generator}", "metrics": metrics})
        if data.skipped:
            sets[-1]["skipped"] = dict(data.skipped)
    return write_report(rows, out_dir, model=cfg.model.path, extra={"task_sets": sets})


TEST_SEED_OFFSET = 1000
"""`held_out_gain`'s test questions come from the generator at ``data.seed`` + this: scenes that
neither the run's training nor its validation split (which chose the recipe) contains."""


def held_out_gain(cfg, before, after, out_dir: Path, n: int) -> dict:
    """Greedy accuracy of two policies (e.g. a run's base and its trained policy) on the same
    ``n`` fresh synthetic test questions of the recipe's generator and families, and the paired
    gain with its standard error (``report.paired_gain``). Writes the questions under
    ``out_dir/data``.

    Returns:
        ``paired_gain``'s keys plus ``families``: family -> {"questions", "before", "after"}.
    """
    from ..datasets.loader import load_samples
    from .report import paired_gain

    test = _generate(cfg, out_dir, {"test": n}, cfg.data.seed + TEST_SEED_OFFSET)["test"]
    samples = load_samples(test)[0]
    test_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_samples=n))
    evaluate = build_evaluator(test_cfg, samples)
    scores = {"before": {}, "after": {}}
    metrics = {
        name: evaluate(policy, prompt=prompt_config(cfg), scores=scores[name])
        for name, policy in (("before", before), ("after", after))
    }
    out = paired_gain(scores["before"], scores["after"])
    fams = sorted(k[9:] for k in metrics["after"] if k.startswith("accuracy/"))
    out["families"] = {
        f: {"questions": metrics["after"][f"count/{f}"],
            **{name: metrics[name][f"accuracy/{f}"] for name in metrics}}
        for f in fams
    }  # fmt: skip
    return out


def eval_data(c, out_dir: Path):
    """The recipe's data for an evaluation (only the validation split is generated)."""
    if not c.data.train:
        c.data.n_train = 1
    data = load_data(c, out_dir)
    if not data.val or c.train.eval_samples <= 0:
        raise ConfigError(
            "nothing to evaluate: set data.val (or leave it empty for synthetic) and "
            "train.eval_samples > 0"
        )
    return data


def run_pass_k(cfgs: dict, out_dir: Path, ks: Sequence[int], n: int) -> dict:
    """pass@k (``vlm/passk.py``) of each named model (``cfgs``: name -> its recipe, which sets
    ``model.path``) on the recipe's held-out data: ``n`` sampled answers per question at the
    rollout temperature. Writes ``passk.json``, ``passk.md`` and ``passk.png`` (one line per
    model) into ``out_dir``."""
    from ..rewards import build_reward
    from .passk import evaluate_pass_k, write_pass_k

    results = {}
    for name, c in cfgs.items():
        data = eval_data(c, out_dir)
        policy = build_policy(c, out_dir / f"model_{len(results)}")
        val = fit_prompts(c, policy.processor, data, splits=("val",)).val[: c.train.eval_samples]
        reward = build_reward(eval_reward(c), timeout_s=c.rollout.reward_timeout_s)
        try:
            results[name] = evaluate_pass_k(
                policy, val, reward, ks, n, batch_size=max(1, c.rollout.prompts_per_step),
                max_new_tokens=c.rollout.max_new_tokens, prompt=prompt_config(c),
                strict=c.data.strict, token_budget=c.rollout.token_budget,
            )  # fmt: skip
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return write_pass_k(results, out_dir)


SIDES.register("vlm", Side(build_trainer, run_eval, run_sft=run_sft, run_pass_k=run_pass_k))
