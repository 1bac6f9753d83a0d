"""What rollout and training throughput (MFU, memory) does Qwen2.5-VL-3B reach on one GPU?

Real-size rollout and training throughput: a random-initialised Qwen2.5-VL with the
Qwen2.5-VL-3B-Instruct configuration, through the HF rollout engine and our GRPO Trainer step.

Nothing is downloaded: the architecture is written out below (values from the public
``Qwen/Qwen2.5-VL-3B-Instruct`` ``config.json``, key names those of transformers'
``Qwen2_5_VLConfig`` / ``Qwen2_5_VLTextConfig`` / ``Qwen2_5_VLVisionConfig``), the weights are
random, and the processor/tokenizer is the shipped tiny base's (``assets/vlm_base``, ~700 ids, all
inside the 151936-row vocabulary; its special-token ids are written into the model config). The
policy is ``VLMPolicy``, the rollout source ``VLMRolloutSource`` and the step ``Trainer.train_step``
with the ``configs/vlm_clevr.yaml`` recipe (dynamic sampling off, sizes from the flags), on one
synthetic CLEVR-like image per prompt.

Measured per gradient-checkpointing setting (``--gc off,on``), after ``--warmup`` steps:

* rollout tokens/s: generated completion tokens / ``time/rollout`` (HF ``generate``, sampling at
  T=1, ``--max-new-tokens``; random weights almost never emit a stop token, so lengths are about
  fixed). Generation FLOPs = 2 x language-model params x generated tokens (the prompt's prefill,
  the vision tower and attention not counted).
* training step: wall time of ``train_step`` minus its collection (old log-probs, advantages,
  forward + backward over all micro-batches, optimizer), CUDA-synchronised. Training FLOPs =
  6 x (language-model params x tokens through the language model + vision params x patches
  through the vision tower); with the shared prefix (on by default) the language-model tokens are
  the distinct prompts once plus every row's completion. Not counted (model FLOPs, useful work
  only): recomputation under gradient checkpointing, and a prompt's prefix run again in each
  micro-batch that holds one of its rows (rows are shuffled across micro-batches). MFU = FLOPs /
  wall / ``--peak-tflops`` (default 989: H200 bf16 dense).
* peak GPU memory (``torch.cuda.max_memory_allocated``) and peak host RSS.

    python bench/bench_gpu_scale.py [--steps 2] [--warmup 1] [--gc off,on]   # bf16, cuda
    python bench/bench_gpu_scale.py --tiny --device cpu --steps 1            # tiny, fp32, CPU

Defaults fit about 3-4 minutes on one H200 (6 train steps of 16 x 8 rows x 256 new tokens);
``--time-limit`` (240 s) stops starting timed steps or settings once passed, and the results are
written after each setting, so a slow machine still leaves figures.

Writes bench/results/gpu_scale.{json,md}; ``--tiny`` writes gpu_scale_tiny_<device>.{json,md}
(a check that the script runs, not a measurement) unless ``--name``/``--out`` say otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import machine, peak_rss_mb, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "assets" / "vlm_base"

QWEN25_VL_3B = {
    "text": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, hidden_act="silu",
        max_position_embeddings=128000, rms_norm_eps=1e-6, initializer_range=0.02,
        use_sliding_window=False, max_window_layers=70,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    ),
    "vision": dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, hidden_act="silu",
        in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        window_size=112, fullatt_block_indexes=[7, 15, 23, 31], out_hidden_size=2048,
        tokens_per_second=2,
    ),
}  # fmt: skip
"""Qwen2.5-VL-3B-Instruct from its public config.json. That file's older names map as: top-level
``rope_theta`` + ``rope_scaling.mrope_section`` -> ``rope_parameters``; vision ``in_chans`` ->
``in_channels``; ``tie_word_embeddings: true`` is the top-level argument below."""

TINY = {
    "text": {**QWEN25_VL_3B["text"], **dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
    )},
    "vision": {**QWEN25_VL_3B["vision"], **dict(
        depth=2, hidden_size=64, intermediate_size=128, num_heads=2, fullatt_block_indexes=[1],
        out_hidden_size=128,
    )},
}  # fmt: skip
"""The same code path at CPU size (full vocabulary, so out-of-tokenizer ids are exercised)."""

SIZES = {"qwen2.5-vl-3b": QWEN25_VL_3B, "tiny": TINY}


def model_config(size: dict, tokenizer):
    """A ``Qwen2_5_VLConfig`` of ``size`` whose special-token ids are ``tokenizer``'s."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (
        "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_end|>",
        "<|endoftext|>",
    )}  # fmt: skip
    if max(ids.values()) >= size["text"]["vocab_size"]:
        raise ValueError(f"tokenizer ids {ids} do not fit the vocabulary of {size['text']}")
    text = {**size["text"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
            "bos_token_id": ids["<|endoftext|>"]}  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(size["vision"]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )  # fmt: skip


def build_model(config, dtype: torch.dtype, device: str | torch.device):
    """Random-initialised ``Qwen2_5_VLForConditionalGeneration``, built directly on ``device``
    (``"meta"`` for a shape-only model)."""
    from transformers import AutoModelForImageTextToText

    with torch.device(device):
        return AutoModelForImageTextToText.from_config(config, dtype=dtype)


def param_counts(model) -> dict[str, int]:
    """Parameters by part (shared tensors once): total, vision tower, language model + head."""
    seen, out = set(), {"total": 0, "visual": 0, "language": 0, "trainable": 0}
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        out["total"] += p.numel()
        out["trainable"] += p.numel() if p.requires_grad else 0
        out["visual" if ".visual." in f".{name}" else "language"] += p.numel()
    return out


def recipe(args, run_dir: Path):
    """configs/vlm_clevr.yaml with the benchmark's sizes."""
    from perceptrl.cli import CONFIGS
    from perceptrl.wiring import load_config

    px = args.image_size * args.image_size
    return load_config(
        CONFIGS / "vlm_clevr.yaml",
        [
            f"model.path={BASE}", f"model.dtype={args.dtype}", f"model.max_pixels={px}",
            f"data.n_train={args.prompts * (args.warmup + args.steps) * len(args.gc)}",
            "data.n_val=0", f"data.image_size={args.image_size}",
            "algo.dynamic_sampling=false", f"rollout.prompts_per_step={args.prompts}",
            f"rollout.group_size={args.group}", f"rollout.max_new_tokens={args.max_new_tokens}",
            f"rollout.token_budget={args.token_budget}", f"train.micro_batch_size={args.micro}",
            f"train.device={args.device}", "train.eval_every=0", "train.eval_samples=0",
            "checkpoint.every=0", "log.tensorboard=false", "log.progress=false",
        ],
    )  # fmt: skip


def build_trainer(args, run_dir: Path):
    """The pieces ``wiring.vlm_trainer`` assembles, with the policy built in memory from the
    configuration instead of loaded from ``model.path`` (7 GB of random weights never hit disk)."""
    from transformers import AutoProcessor

    from perceptrl.rewards import build_reward
    from perceptrl.trainer.engine import build_engine
    from perceptrl.trainer.loop import Trainer
    from perceptrl.vlm.builder import samples as vlm_samples
    from perceptrl.vlm.model import resolve_dtype, set_pixel_bounds
    from perceptrl.vlm.policy import VLMPolicy
    from perceptrl.vlm.run_plan import resolve
    from perceptrl.vlm.source import VLMRolloutSource

    cfg = recipe(args, run_dir)
    plan = resolve(cfg)
    train, _ = vlm_samples(plan.data, run_dir)
    processor = AutoProcessor.from_pretrained(BASE)
    set_pixel_bounds(processor, cfg.model.min_pixels or None, cfg.model.max_pixels or None)
    torch.manual_seed(cfg.train.seed)
    config = model_config(SIZES["tiny" if args.tiny else "qwen2.5-vl-3b"], processor.tokenizer)
    model = build_model(config, resolve_dtype(cfg.model.dtype), cfg.train.device)
    policy = VLMPolicy(
        model, processor, plan.prompt, plan.sampling, share_prefix=cfg.model.share_prefix
    )
    reward = build_reward(cfg.rollout.reward, timeout_s=cfg.rollout.reward_timeout_s)
    source = VLMRolloutSource(train, reward, cfg.rollout, seed=cfg.train.seed, strict=True)
    return Trainer(cfg, policy, source, run_dir, engine=build_engine(policy, cfg.train))


def step_flops(batch, counts: dict[str, int]) -> dict[str, float]:
    """Model FLOPs of one collected batch: generation 2ND, training 6ND (see the docstring)."""
    gen_tokens = float(batch.mask.sum())
    prompt_tokens = sum(x.numel() for x in batch.prompts["prompt_ids"])  # each prompt once
    grids = batch.prompts.get("image_grid_thw") or []
    patches = sum(int(g.prod(-1).sum()) for g in grids if g is not None)
    return {
        "generated_tokens": gen_tokens,
        "lm_tokens": prompt_tokens + gen_tokens,
        "vision_patches": float(patches),
        "gen_flops": 2.0 * counts["language"] * gen_tokens,
        "train_flops": 6.0 * (counts["language"] * (prompt_tokens + gen_tokens)
                              + counts["visual"] * patches),
    }  # fmt: skip


def run_setting(trainer, gc: bool, args, counts: dict) -> dict:
    """``warmup + steps`` train steps with checkpointing ``gc``; figures of the timed steps."""
    from perceptrl.vlm.model import set_checkpointing

    cuda = trainer.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    set_checkpointing(trainer.policy.model, gc)
    trainer.policy.model.train()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    seen, collect = [], trainer.source.collect

    def recording(policy, step):  # observation only: keep the batch to count its tokens
        batch, metrics = collect(policy, step)
        seen.append(batch)
        return batch, metrics

    trainer.source.collect = recording
    rows = []
    try:
        for i in range(args.warmup + args.steps):
            sync()
            t = time.perf_counter()
            m = trainer.train_step()
            sync()
            wall = time.perf_counter() - t
            trainer.step += 1
            if i >= args.warmup:
                rows.append({**m, "wall": wall, **step_flops(seen[-1], counts)})
                if time.perf_counter() > args.deadline:  # keep what was timed, stop here
                    break
    finally:
        trainer.source.collect = collect
    peak = args.peak_tflops * 1e12
    rollout_s = [r["time/rollout"] for r in rows]
    train_s = [r["wall"] - r["time/collect"] for r in rows]
    gen_tok = [r["generated_tokens"] for r in rows]
    out = {
        "gradient_checkpointing": gc,
        "steps": len(rows),
        "step_s": statistics.mean(r["wall"] for r in rows),
        "rollout_s": statistics.mean(rollout_s),
        "rollout_tokens_per_s": sum(gen_tok) / sum(rollout_s),
        "rollout_mfu": sum(r["gen_flops"] for r in rows) / sum(rollout_s) / peak,
        "train_step_s": statistics.mean(train_s),
        "train_tflops_per_s": sum(r["train_flops"] for r in rows) / sum(train_s) / 1e12,
        "train_mfu": sum(r["train_flops"] for r in rows) / sum(train_s) / peak,
        "breakdown_s": {k: statistics.mean(r.get(f"time/{k}", 0.0) for r in rows)
                        for k in ("rollout", "reward", "old_logp", "forward_backward", "optimizer")},
        "rows": statistics.mean(r["rollout/samples"] for r in rows),
        "completion_len_mean": statistics.mean(r["rollout/completion_len_mean"] for r in rows),
        "prompt_len_mean": statistics.mean(r["rollout/prompt_len_mean"] for r in rows),
        "lm_tokens_per_step": statistics.mean(r["lm_tokens"] for r in rows),
        "vision_patches_per_step": statistics.mean(r["vision_patches"] for r in rows),
        "loss": [r.get("actor/pg_loss") for r in rows],
        "grad_norm": [r.get("grad_norm") for r in rows],
        "peak_gpu_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_gpu_reserved_gb": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
    }  # fmt: skip
    return out


def markdown(res: dict) -> str:
    s, c = res["settings"], res["params"]
    lines = [
        f"# GRPO rollout and train-step throughput ({res['size']}, random weights, {s['dtype']}, {s['device']})",
        "",
        f"Machine: {res['machine']['cuda'] or res['machine']['cpu']} "
        f"({res['machine']['cores']} CPU cores), torch {res['machine']['torch']}, "
        f"transformers {res['machine']['transformers']}.",
        f"Params: {c['total'] / 1e9:.3f} B (vision {c['visual'] / 1e9:.3f} B, language model "
        f"{c['language'] / 1e9:.3f} B). Batch: {s['prompts']} prompts x G={s['group']}, one "
        f"{s['image_size']}px image each, up to {s['max_new_tokens']} new tokens, T=1, micro-batch "
        f"{s['micro']}; HF engine. MFU against {s['peak_tflops']:.0f} TFLOP/s; generation FLOPs "
        "2 x LM params x generated tokens, training 6 x (LM params x LM tokens + vision params x "
        "patches), recomputation not counted.",
        "",
        "| grad. ckpt | timed steps | rollout tok/s | rollout MFU | train step s | train TFLOP/s "
        "| train MFU | step s | peak GPU GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        mem = f"{r['peak_gpu_mem_gb']:.1f}" if r["peak_gpu_mem_gb"] is not None else "-"
        lines.append(
            f"| {'on' if r['gradient_checkpointing'] else 'off'} | {r['steps']} | "
            f"{r['rollout_tokens_per_s']:.0f} | {r['rollout_mfu']:.2%} | {r['train_step_s']:.2f} "
            f"| {r['train_tflops_per_s']:.1f} | {r['train_mfu']:.2%} | {r['step_s']:.2f} | {mem} |"
        )
    lines += ["", f"Peak host RSS {res['peak_rss_mb']:.0f} MB. {res['note']}"]
    return "\n".join(lines)


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny config, fp32 (checks the script)")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per checkpointing setting")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per setting")
    p.add_argument("--gc", default=None, help="checkpointing settings, e.g. off,on (tiny: off)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (16; tiny 2)")
    p.add_argument("--group", type=int, default=None, help="group size G (8; tiny 2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="256 (tiny 8)")
    p.add_argument("--micro", type=int, default=None, help="micro-batch rows (16; tiny 4)")
    p.add_argument("--image-size", type=int, default=None, help="image side px (448; tiny 112)")
    p.add_argument("--token-budget", type=int, default=262144, help="tokens per generate call")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H200)")
    p.add_argument("--name", default=None, help="results name (gpu_scale; tiny: gpu_scale_tiny_*)")
    p.add_argument("--out", default=None, help="results folder (default bench/results)")
    p.add_argument(
        "--time-limit",
        type=float,
        default=240.0,
        help="seconds: past this, no further timed step or setting starts (results "
        "are written after each setting)",
    )
    a = p.parse_args(argv)
    real = dict(device="cuda", dtype="bfloat16", gc="off,on", prompts=16, group=8,
                max_new_tokens=256, micro=16, image_size=448)  # fmt: skip
    tiny = dict(device="cpu", dtype="float32", gc="off", prompts=2, group=2,
                max_new_tokens=8, micro=4, image_size=112)  # fmt: skip
    for k, v in (tiny if a.tiny else real).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.gc = [{"off": False, "on": True}[x.strip()] for x in a.gc.split(",")]
    if a.name is None:
        a.name = f"gpu_scale_tiny_{a.device.split(':')[0]}" if a.tiny else "gpu_scale"
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: no CUDA device here (use --tiny --device cpu)")
    return a


def report(args, counts: dict, build_s: float, runs: list[dict], skipped: list[str]) -> dict:
    """Write the results so far (after every setting: a run cut short still leaves its figures)."""
    import transformers

    keys = ("device", "dtype", "steps", "warmup", "prompts", "group", "max_new_tokens", "micro",
            "image_size", "token_budget", "peak_tflops", "time_limit")  # fmt: skip
    note = (
        "A tiny run only checks that the script works; it is not a GPU figure."
        if args.tiny
        else "Random weights: completions almost always run to the length limit (see "
        "completion_len_mean) and rewards are zero, so advantages are zero; the update computes "
        "the same forward, backward and optimizer step as with a signal."
    )
    if skipped:
        note += f" Not run (--time-limit {args.time_limit:.0f} s reached): gc {', '.join(skipped)}."
    res = {
        "size": "tiny" if args.tiny else "qwen2.5-vl-3b",
        "machine": machine(transformers=transformers.__version__),
        "settings": {k: getattr(args, k) for k in keys},
        "params": counts,
        "build_s": build_s,
        "runs": runs,
        "peak_rss_mb": peak_rss_mb(),
        "note": note,
    }
    if args.out:
        common.RESULTS = Path(args.out)  # write_results' folder
    seeds = [recipe(args, Path(".")).train.seed]  # weights, data order and sampling
    js, md = write_results(args.name, res, markdown(res), seeds=seeds)
    print(f"wrote {js} and {md}", flush=True)
    return res


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    args.deadline = time.perf_counter() + args.time_limit
    with tempfile.TemporaryDirectory(prefix="gpu_scale_") as tmp:
        t = time.perf_counter()
        trainer = build_trainer(args, Path(tmp))
        build_s = time.perf_counter() - t
        counts = param_counts(trainer.policy.model)
        print(f"built {counts['total'] / 1e9:.3f} B params in {build_s:.1f} s", flush=True)
        runs: list[dict] = []
        for k, gc in enumerate(args.gc):
            if runs and time.perf_counter() > args.deadline:
                res = report(
                    args, counts, build_s, runs, ["on" if g else "off" for g in args.gc[k:]]
                )
                break
            runs.append(run_setting(trainer, gc, args, counts))
            print({k: v for k, v in runs[-1].items() if k != "breakdown_s"}, flush=True)
            res = report(args, counts, build_s, runs, [])
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
