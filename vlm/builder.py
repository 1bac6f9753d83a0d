"""Builds the VLM side from a recipe: data, policy, rollout source, reward, evaluator, trainer.

This module registers side ``vlm`` (`build_trainer`, `run_sft`, `run_eval`, `run_pass_k`, and
``vlm/rules.py``'s `check_vlm`, its rules across sections; ``vla/builder.py`` registers the VLA
side). A recipe is checked when it loads; each command here resolves it once into a
`VLMRunPlan` (``vlm/run_plan.py``) and builds the components from the plan in a straight line.
The policy holds the plan's prompt and sampling settings; the rollout source and the evaluator
read them from it, so the distribution the trainer scores is the one the rollouts sampled.

What only the run's environment knows is checked here, where it becomes known: the data files
(`load_data`: bad records, images and videos are errors, or skipped and counted with
``data.strict=false``), every prompt's length once the policy's processor exists
(`fit_prompts`), the number of ranks (`data_shard`) and each sample's reference trace (guide
rows, SFT targets). The counts of skipped samples go into the run's metrics as
``data/skipped_<reason>``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..datasets.loader import DataError
from ..registry import GENERATORS, SIDES, Side
from ..trainer.config import ConfigError
from ..trainer.distributed import on_rank0
from ..trainer.engine import build_engine
from ..trainer.loop import Trainer
from ..trainer.runtime import resolve_device, resolve_path
from .config import RolloutConfig
from .prompts import PromptConfig, PromptLengths, SpecialTokenError, too_long_error
from .rules import check_vlm
from .run_plan import DataSource, EnginePlan, EvalPlan, ProcessPlan, VLMRunPlan, resolve
from .tool_env import check_sample_tools
from .video import VideoLoadError

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
    strict: bool = True
    """``data.strict``: a bad or too long sample is an error (False: skipped and counted)"""

    def metrics(self) -> dict[str, float]:
        """``data/skipped_<reason>`` of each reason that skipped samples."""
        return {f"data/skipped_{k}": float(v) for k, v in self.skipped.items() if v}


def load_data(source: DataSource, run_dir: Path) -> Data:
    """Each split from the user's file (``data.train``, ``data.val``: strict or lenient, as
    ``data.strict`` says) or, when the recipe names none for it, from the ``data.generator``
    set generated into ``run_dir/data`` (deterministic in ``data.seed``). The two splits are
    independent: a user's validation file beside synthetic training questions is fine."""
    from ..datasets.loader import load_samples

    data = Data(strict=source.strict)
    given = {"train": source.train, "val": source.val}
    wanted = {"train": source.n_train, "val": source.n_val}
    wanted = {k: n for k, n in wanted.items() if not given[k]}
    made = _generate(source, run_dir, wanted) if any(wanted.values()) else {}
    files = {k: given[k] or made.get(k) for k in given}
    for split, file in files.items():
        data.where[split] = (
            f"data.{split}={file}" if given[split]
            else f"the synthetic {split} set ({source.generator}: {file})"
        )  # fmt: skip
        if not file:
            continue
        strict = source.strict or not given[split]  # our own generator's files must be right
        try:
            got, stats = load_samples(
                resolve_path(file), strict=strict, media=data.media,
                layout=source.format if given[split] else "perceptrl",
                media_dir=run_dir / "data" / f"{split}_images",
            )  # fmt: skip
        except FileNotFoundError as e:  # the run's files: known only where it runs
            raise ConfigError(
                f"data.{split}={file}: {e}; give the path of a JSONL/Parquet file or a "
                "benchmark file (docs/evaluation.md)"
            ) from e
        setattr(data, split, got)
        _report_skips(data, split, {k[8:]: v for k, v in stats.items() if k.startswith("skipped_")})
        try:
            check_sample_tools(got, source.tools, data.where[split])
        except ValueError as e:
            raise DataError(f"{e}. Enable it there or remove it from the sample.") from e
    return data


def _generate(
    source: DataSource, run_dir: Path, sizes: dict[str, int] | None = None, seed: int | None = None
) -> dict[str, Path | None]:
    """split -> file of the generated synthetic set (None for a split of no samples); by
    default the ``data.n_train``/``data.n_val`` splits at ``data.seed``."""
    sizes = {"train": source.n_train, "val": source.n_val} if sizes is None else sizes
    try:
        paths = GENERATORS.get(source.generator).generate(
            run_dir / "data", sizes, source.families,
            seed=source.seed if seed is None else seed, **source.options,
        )  # fmt: skip
    except (KeyError, ValueError) as e:  # the generator's own options, checked as it writes
        raise ConfigError(
            f"data.generator={source.generator!r} cannot write its set with this data section "
            f"({e}); change the data.* option it names"
        ) from e
    return {k: paths[k] if n > 0 else None for k, n in sizes.items()}


def samples(source: DataSource, run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train, val) samples of `load_data` (prompt lengths unchecked: that needs the policy's
    processor, see `fit_prompts`)."""
    data = load_data(source, run_dir)
    return data.train, data.val


def fit_prompts(
    prompt: PromptConfig, processor, data: Data, splits: Sequence[str] = ("train", "val")
) -> Data:
    """Every prompt of ``splits`` measured against ``prompt.max_prompt_length`` before the run
    starts, not when it is first drawn: strict, one `PromptTooLongError` lists them and says
    per cause (text or vision tokens) which setting helps; lenient, they are dropped and counted
    as ``too_long``. The lengths come without pixel processing (`PromptLengths`: one encoding
    per distinct image size or video shape; about 1 ms a sample)."""
    if not prompt.max_prompt_length:
        return data
    lengths = PromptLengths(processor, prompt, media=data.media)
    for split in splits:
        keep, rows, bad = _measure(getattr(data, split), lengths, prompt.max_prompt_length, data)
        if rows and data.strict:
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


def _measure(items: list[dict], lengths: PromptLengths, limit: int, data: Data):
    """(samples that fit, ``(sample, index, tokens, vision tokens)`` of those too long,
    {"images", "videos": count of samples whose files failed now, lenient})."""
    keep, rows, bad = [], [], {"images": 0, "videos": 0}
    for i, s in enumerate(items):
        try:
            n, v = lengths(s, index=i)
        except DataError as e:  # a file changed since the loader checked it, or the model's own
            if data.strict:  # special tokens (only its processor knows them) in the text
                raise
            reason = getattr(e, "reason", "images")
            if isinstance(e, VideoLoadError):
                reason = "videos"
            elif isinstance(e, SpecialTokenError):
                reason = "special_tokens"
            bad[reason] = bad.get(reason, 0) + 1
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


def data_shard(train: list[dict], rollout: RolloutConfig, seed: int, rank: int, world: int):
    """This rank's (samples, rollout section, seed) under data parallelism: samples
    ``rank::world``, ``prompts_per_step / world`` prompts a step (the global batch stays
    ``rollout.prompts_per_step`` prompts) and its own sampling seed. Identity in one process.
    The number of ranks comes from the launch, so these rules are checked here."""
    if world == 1:
        return train, rollout, seed
    if rollout.prompts_per_step % world:
        raise ConfigError(
            f"rollout.prompts_per_step={rollout.prompts_per_step} does not split over {world} "
            "ranks; make it a multiple of the number of processes"
        )
    if len(train) < world:
        raise ConfigError(f"{len(train)} training samples cannot be split over {world} ranks")
    per_rank = dataclasses.replace(rollout, prompts_per_step=rollout.prompts_per_step // world)
    return train[rank::world], per_rank, seed + 1_000_003 * rank


def reference_traces(
    trace: Callable[[dict], str | list[str]], samples: list[dict], who: str
) -> list[str | list[str]]:
    """``trace`` (the plan's ``reference_trace``) of each sample; ``who`` opens the error when a
    sample lacks the generator's scene metadata (the samples' content: known once read)."""
    try:
        return [trace(s) for s in samples]
    except (KeyError, ValueError) as e:
        raise ConfigError(
            f"{who} from the synthetic generator's scene metadata; sample lacks it ({e}). Use "
            "data.train= empty (synthetic) or samples written by `perceptrl data generate`."
        ) from e


def guide_trace(plan: VLMRunPlan, train: list[dict]) -> Callable[[dict], str | list[str]] | None:
    """``rollout.guide``'s reference trace of a training sample (None when the recipe has no
    guide rows), first taken of every sample of ``train``, so that one without the generator's
    metadata fails at start-up rather than when it is drawn."""
    if not plan.guide:
        return None
    reference_traces(
        plan.reference_trace, train, f"rollout.guide={plan.guide} takes each sample's trace"
    )
    return plan.reference_trace


# ---------------------------------------------------------------------------------------------
# policy, engines, evaluator, trainer
# ---------------------------------------------------------------------------------------------


def build_policy(plan: VLMRunPlan, run_dir: Path):
    """The policy from ``model.path`` (a local HF directory), or a freshly built tiny model,
    with the plan's prompt, sampling, episode and tree settings (and LoRA adapters if asked)."""
    from .policy import VLMPolicy
    from .tiny import build_tiny

    m = plan.model
    if m.path:
        path = resolve_path(m.path)
    else:
        # written once (by rank 0 under torchrun: ranks writing one directory at once raced)
        path = on_rank0(
            functools.partial(build_tiny, m.tiny_arch, run_dir / "init_model", seed=plan.seed)
        )
    policy = VLMPolicy.from_pretrained(
        path, prompt=plan.prompt, sampling=plan.sampling, dtype=m.dtype,
        device=resolve_device(plan.device), gradient_checkpointing=m.gradient_checkpointing,
        trust_remote_code=m.trust_remote_code, share_prefix=m.share_prefix,
        episode=plan.episode.settings() if plan.episode else None, tree=plan.tree,
    )  # fmt: skip
    if m.lora_rank > 0:
        from .lora import apply_lora

        policy = apply_lora(
            policy, rank=m.lora_rank, alpha=m.lora_alpha, dropout=m.lora_dropout,
            targets=m.lora_target_modules, vision=m.lora_vision,
        )  # fmt: skip
    return policy


def engine_and_reference(plan: VLMRunPlan, policy, objective: str = "rl"):
    """(the optimisation engine over ``policy``'s weights, the reference policy an RL run's KL
    reads or None): the one place a VLM run builds them. With LoRA the reference is the base
    with its adapters disabled (no copy); with full fine-tuning a frozen copy, taken before a
    DeepSpeed engine partitions the weights."""
    ref = policy.reference() if objective == "rl" and plan.kl_reference else None
    return build_engine(policy, plan.train), ref


def build_evaluator(evaluation: EvalPlan, val: list[dict]):
    """Greedy held-out accuracy per question family, or None without validation data."""
    if not val or evaluation.samples <= 0:
        return None
    from ..rewards import build_reward
    from .source import evaluate_accuracy

    return functools.partial(
        evaluate_accuracy, samples=val[: evaluation.samples],
        reward=build_reward(evaluation.reward, timeout_s=evaluation.reward_timeout_s),
        batch_size=evaluation.batch_size, max_new_tokens=evaluation.max_new_tokens,
        strict=evaluation.strict, token_budget=evaluation.token_budget,
    )  # fmt: skip


def rollout_engine(engine: EnginePlan, policy, run_dir: Path):
    """The rollout engine of ``rollout.engine``: None for the HF engine (the sampler builds it on
    the policy's model), or a colocated vLLM engine, which starts from the policy's weights,
    written to ``run_dir/rollout_init``, and receives the trainer's weights before every
    rollout (``VLLMEngine.session``)."""
    if engine.name != "vllm":
        return None
    from .vllm_rollout import VLLMEngine

    init = run_dir / "rollout_init"
    policy.save(init)
    vllm = VLLMEngine(
        init, policy.processor, engine.vllm, dtype=engine.dtype, stop_ids=policy.stop_ids,
        max_model_len=engine.max_model_len, mm_processor_kwargs=engine.mm_processor_kwargs,
    )  # fmt: skip
    return vllm


def process_reward(process: ProcessPlan | None, policy):
    """The process reward of ``rollout.process_reward`` (None: outcome only)."""
    if process is None:
        return None
    from .process import IMPLICIT, ImplicitPRM, RuleSteps

    if process.name == IMPLICIT:
        return ImplicitPRM(policy, micro_batch_size=process.micro_batch_size, **process.params)
    try:  # what the step reward declares to prepare runs here (judge_steps: its worker loads)
        return RuleSteps(
            process.name, policy.processor.tokenizer, dict(process.params),
            timeout_s=process.timeout_s,
        )  # fmt: skip
    except (ValueError, RuntimeError) as e:  # RuntimeError: the judge's worker did not start
        raise ConfigError(f"rollout.process_reward: {e}") from e


def build_trainer(cfg, run_dir: Path, worker: Callable | None = None) -> Trainer:
    """GRPO (or any registered estimator/loss) on the VLM side. ``worker``: what a pipeline
    worker runs (default `rollout_worker`; a side that registers its own episode environment
    passes a function of its module, so that the worker process imports it)."""
    from ..rewards import build_reward
    from .source import VLMRolloutSource

    plan = resolve(cfg)
    data = on_rank0(load_data, plan.data, run_dir)
    policy = build_policy(plan, run_dir)
    data = on_rank0(fit_prompts, plan.prompt, policy.processor, data)
    sync = plan.train.pipeline == "sync"
    rollout_eng = rollout_engine(plan.engine, policy, run_dir) if sync else None
    reward = build_reward(plan.reward, timeout_s=plan.reward_timeout_s)
    engine, ref = engine_and_reference(plan, policy)
    train, rollout, seed = data_shard(
        data.train, plan.rollout, plan.seed, engine.rank, engine.world_size
    )
    if not sync:
        # every sample: the workers split them, and rank 0 the step's groups over the ranks
        source = pipeline_source(cfg, run_dir, data.train, engine.rank, engine.world_size, worker)
    else:
        source = VLMRolloutSource(
            train, reward, rollout, seed=seed, strict=data.strict, data_skipped=data.skipped,
            process=process_reward(plan.process, policy), guide=guide_trace(plan, train),
            engine=rollout_eng, fork=plan.fork,
        )  # fmt: skip
    return Trainer(
        cfg, policy, source, run_dir, ref_policy=ref,
        evaluator=build_evaluator(plan.evaluation, data.val), engine=engine,
    )  # fmt: skip


def pipeline_source(
    cfg, run_dir: Path, train: list[dict], rank: int = 0, world_size: int = 1,
    worker: Callable | None = None,
):  # fmt: skip
    """``train.pipeline = one_step_off | async``: rollouts on ``rollout.workers`` Ray actors,
    each with a policy copy and its shard of the samples ``train`` (all of them; see
    trainer/pipeline.py), built by ``worker`` (default `rollout_worker`) from the recipe, which
    travels to the worker processes. With several ranks, rank 0 drives the workers and scatters
    each step's groups to the ranks (`RankShards`)."""
    from ..trainer.pipeline import PipelineSource, RankShards
    from .source import describe_rollouts

    if rank != 0:
        return RankShards(None, rank, world_size)
    model = cfg.model.path or str(run_dir / "init_model")  # built once, by the trainer
    r, t = cfg.rollout, cfg.train
    source = PipelineSource(
        t.pipeline, worker or rollout_worker, (cfg, str(run_dir), model, train),
        workers=r.workers, cpus=r.worker_cpus,
        gpus=r.worker_gpus, max_staleness=t.max_staleness, buffer_chunks=t.pipeline_buffer,
        worker_timeout_s=r.worker_timeout_s, timeout_s=t.pipeline_timeout_s,
        address=t.ray_address, imports=tuple(cfg.imports), describe=describe_rollouts,
    )  # fmt: skip
    return source if world_size == 1 else RankShards(source, rank, world_size)


def rollout_worker(cfg, run_dir: str, model: str, train: list[dict], index: int):
    """What a pipeline worker runs (in its own process): the recipe's policy on ``model`` with
    the engine's behaviour log-probs kept, and a rollout source over its shard of the samples
    producing ``ceil(prompts_per_step / workers)`` groups per call."""
    from ..rewards import build_reward
    from .source import VLMRolloutSource

    device = "cuda" if cfg.rollout.worker_gpus else "cpu"
    cfg = dataclasses.replace(  # this worker's recipe (its episode environment reads it too)
        cfg, model=dataclasses.replace(cfg.model, path=model),
        train=dataclasses.replace(cfg.train, device=device),
    )  # fmt: skip
    plan = resolve(cfg)
    plan = dataclasses.replace(
        plan, sampling=dataclasses.replace(plan.sampling, return_logprobs=True)
    )
    r = plan.rollout
    worker_dir = Path(run_dir) / f"worker_{index}"
    policy = build_policy(plan, worker_dir)
    rollout = dataclasses.replace(r, prompts_per_step=-(-r.prompts_per_step // r.workers))
    reward = build_reward(plan.reward, timeout_s=plan.reward_timeout_s)
    source = VLMRolloutSource(
        train[index :: r.workers], reward, rollout, seed=plan.seed + 7919 * (index + 1),
        strict=plan.data.strict, engine=rollout_engine(plan.engine, policy, worker_dir),
        fork=plan.fork,
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

    plan = resolve(cfg)
    data = load_data(plan.data, run_dir)
    policy = build_policy(plan, run_dir)
    data = fit_prompts(plan.prompt, policy.processor, data)
    train = data.train
    targets = reference_traces(plan.reference_trace, train, "perceptrl sft builds targets")
    if teacher is not None:
        targets = [teacher(s, t) for s, t in zip(train, targets)]
    source = VLMSFTSource(
        policy, train, targets, batch_size=plan.rollout.prompts_per_step, seed=plan.seed
    )
    engine, _ = engine_and_reference(plan, policy, objective="sft")
    trainer = Trainer(
        cfg, policy, source, run_dir, engine=engine,
        evaluator=build_evaluator(plan.evaluation, data.val), objective="sft",
    )  # fmt: skip
    if data.metrics():  # once, at step 0 (an SFT run is never resumed)
        trainer.logger.log(0, data.metrics())
    return trainer.fit()


def run_eval(cfg, out_dir: Path, more: Sequence = ()) -> dict:
    """Greedy held-out accuracy of ``model.path`` per question family, grouped by modality
    (image, video, 3D), on the recipe's task set and on each of ``more`` (other recipes, each with
    its own data and prompt settings; the model is the first recipe's). Writes ``eval.json``,
    ``eval.md`` and the bar chart ``eval.png`` into ``out_dir`` (see vlm/report.py)."""
    from ..trainer.trackers import log_eval_files
    from .report import family_rows, write_report

    policy, rows, sets = None, [], []
    for i, c in enumerate([cfg, *more]):
        plan = resolve(c)
        data = eval_data(plan, out_dir if i == 0 else out_dir / f"taskset_{i}")
        policy = policy or build_policy(plan, out_dir)  # the first recipe's model
        val = fit_prompts(plan.prompt, policy.processor, data, splits=("val",)).val
        metrics = build_evaluator(plan.evaluation, val)(policy, prompt=plan.prompt)
        rows += family_rows(metrics, val[: plan.evaluation.samples])
        sets.append({"data": plan.data.val or f"synthetic {plan.data.generator}",
                     "metrics": metrics})  # fmt: skip
        if data.skipped:
            sets[-1]["skipped"] = dict(data.skipped)
    report = write_report(rows, out_dir, model=cfg.model.path, extra={"task_sets": sets})
    log_eval_files([resolve_path(cfg.model.path)], report["files"])  # its run's trackers, if any
    return report


TEST_SEED_OFFSET = 1000
"""`held_out_gain`'s test questions come from the generator at ``data.seed`` + this: scenes that
neither the run's training nor its validation split (which chose the recipe) contains."""


def held_out_gain(plan: VLMRunPlan, before, after, out_dir: Path, n: int) -> dict:
    """Greedy accuracy of two policies (e.g. a run's base and its trained policy) on the same
    ``n`` fresh synthetic test questions of the plan's generator and families, and the paired
    gain with its standard error (``report.paired_gain``). Writes the questions under
    ``out_dir/data``.

    Returns:
        ``paired_gain``'s keys plus ``families``: family -> {"questions", "before", "after"}.
    """
    from ..datasets.loader import load_samples
    from .report import paired_gain

    test = _generate(plan.data, out_dir, {"test": n}, plan.data.seed + TEST_SEED_OFFSET)["test"]
    evaluate = build_evaluator(
        dataclasses.replace(plan.evaluation, samples=n), load_samples(test)[0]
    )
    scores = {"before": {}, "after": {}}
    metrics = {
        name: evaluate(policy, prompt=plan.prompt, scores=scores[name])
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


def eval_data(plan: VLMRunPlan, out_dir: Path) -> Data:
    """The plan's data for an evaluation (of a synthetic set, only the validation split is
    generated)."""
    data = load_data(plan.data.for_evaluation(), out_dir)
    if not data.val or plan.evaluation.samples <= 0:  # the command's need, not the recipe's
        raise ConfigError(
            "nothing to evaluate: set data.val (or leave it empty for synthetic) and "
            "train.eval_samples > 0"
        )
    n = min(len(data.val), plan.evaluation.samples)
    print(f"perceptrl eval: {n} of the {len(data.val)} samples of {data.where['val']}")
    return data


def run_pass_k(cfgs: dict, out_dir: Path, ks: Sequence[int], n: int) -> dict:
    """pass@k (``vlm/passk.py``) of each named model (``cfgs``: name -> its recipe, which sets
    ``model.path``) on the recipe's held-out data: ``n`` sampled answers per question at the
    rollout temperature. Writes ``passk.json``, ``passk.md`` and ``passk.png`` (one line per
    model) into ``out_dir``."""
    from ..rewards import build_reward
    from ..trainer.trackers import log_eval_files
    from .passk import evaluate_pass_k, write_pass_k

    results = {}
    for name, c in cfgs.items():
        plan = resolve(c)
        data = eval_data(plan, out_dir)
        policy = build_policy(plan, out_dir / f"model_{len(results)}")
        val = fit_prompts(plan.prompt, policy.processor, data, splits=("val",)).val
        ev = plan.evaluation
        reward = build_reward(ev.reward, timeout_s=ev.reward_timeout_s)
        try:
            results[name] = evaluate_pass_k(
                policy, val[: ev.samples], reward, ks, n,
                batch_size=max(1, plan.rollout.prompts_per_step),
                max_new_tokens=plan.sampling.max_new_tokens, prompt=plan.prompt,
                strict=plan.data.strict, token_budget=plan.sampling.token_budget,
            )  # fmt: skip
        except ValueError as e:  # ks and n are the command's
            raise ConfigError(str(e)) from e
    report = write_pass_k(results, out_dir)
    log_eval_files([resolve_path(c.model.path) for c in cfgs.values()], report["files"])
    return report


SIDES.register(
    "vlm",
    Side(build_trainer, run_eval, run_sft=run_sft, run_pass_k=run_pass_k, check=check_vlm),
)
