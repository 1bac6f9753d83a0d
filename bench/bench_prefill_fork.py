"""How much faster than HF `generate` do the prefill-once samplers draw GRPO groups?

GRPO sampling: Hugging Face ``generate`` against the prefill-once samplers, flat and tree.

Issue 15 asks that the root of every group (its prompt) be prefilled once and its KV cache forked
to the G rows. Arms, on the same encoded prompts:

* ``hf_generate``: ``vlm/rollout.py`` ``sample``, ``model.generate`` on G copies of each prompt
  (the vision tower and the prompt's prefill run G times; ``rollout.sampler=generate``);
* ``episode_fork``: the sampler driver (``vlm/sampler.py``) on the HF engine with an environment
  that ends every episode after its first turn (how the fork was first measured);
* ``tree_flat``: the driver's default single-turn path (a flat group is a tree of depth one;
  stopped rows leave the cache, a completion's last token is not fed back);
* ``tree``: the same driver growing ``configs/vlm_clevr_tree.yaml``'s tree (branches [2, 2, 2],
  10-token segments): G leaves per prompt, shared segments sampled once.

Each: the shipped base (``vlm_clevr`` recipe), ``--prompts`` x ``--group`` rows, temperature
1.0, ``--max-new-tokens``, log-probs not kept, arms in rotating order, ``--repeats`` runs each
after one untimed warm-up of each. Reported: seconds per call, leaf tokens (the completions'
tokens) and decoded tokens (a shared segment once) per call.

    python bench/bench_prefill_fork.py [--prompts 16] [--group 8] [--repeats 5]

Writes bench/results/prefill_fork.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import machine, write_results


class FirstTurnOnly:
    """An episode environment that ends every episode after the policy's first turn."""

    def reset(self, samples: list[dict]) -> None:
        pass

    def respond(self, row: int, text: str) -> None:
        return None


def run(args) -> dict:
    import torch

    from perceptrl.vlm.builder import build_policy, load_data
    from perceptrl.vlm.episode import EpisodeSettings
    from perceptrl.vlm.rollout import SamplingParams, sample
    from perceptrl.vlm.run_plan import resolve
    from perceptrl.vlm.sampler import Rollouts, sampled_tokens
    from perceptrl.vlm.schedule import TreeShape
    from perceptrl.wiring import load_config

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"data.n_train={args.prompts}", "data.n_val=1", "train.device=cpu"]
        cfg = load_config(
            Path(__file__).resolve().parents[1] / "configs" / "vlm_clevr.yaml", overrides
        )
        plan = resolve(cfg)
        data = load_data(plan.data, Path(tmp))
        policy = build_policy(plan, Path(tmp))
        prompts, _ = policy.encode(data.train[: args.prompts])
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    fork = EpisodeSettings(env=FirstTurnOnly, max_tokens=args.max_new_tokens)

    def hf():
        return sample(policy.model, policy.processor, prompts, args.group, sp)

    def episode_fork():
        policy.episode = fork
        try:
            return Rollouts(policy).sample(prompts, args.group, sp)
        finally:
            policy.episode = None

    def tree_flat():
        return Rollouts(policy).sample(prompts, args.group, sp)

    def tree():
        policy.tree = TreeShape((2, 2, 2), 10)
        try:
            return Rollouts(policy).sample(prompts, args.group, sp)
        finally:
            policy.tree = None

    arms = {"hf_generate": hf, "episode_fork": episode_fork, "tree_flat": tree_flat, "tree": tree}
    times: dict[str, list[float]] = {a: [] for a in arms}
    tokens: dict[str, list[float]] = {a: [] for a in arms}
    decoded: dict[str, list[float]] = {a: [] for a in arms}
    names = list(arms)
    for rep in range(args.repeats + 1):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            torch.manual_seed(args.seed + rep)
            t = time.perf_counter()
            batch = arms[name]()
            if rep == 0:
                continue  # warm-up
            times[name].append(time.perf_counter() - t)
            tokens[name].append(float(batch.mask.sum()))
            decoded[name].append(float(sampled_tokens(batch)[0]))
    return {
        a: {
            "median_s": statistics.median(times[a]),
            "runs_s": times[a],
            "tokens_mean": statistics.mean(tokens[a]),
            "tokens_per_s": statistics.mean(tokens[a]) / statistics.median(times[a]),
            "decoded_mean": statistics.mean(decoded[a]),
        }
        for a in arms
    }


def markdown(d: dict) -> str:
    s, r = d["settings"], d["arms"]
    names = {
        "hf_generate": "`model.generate` on G copies of each prompt",
        "episode_fork": "prefill once, fork (one-turn episodes)",
        "tree_flat": "prefill once, fork (a flat group, depth one: the default)",
        "tree": "branches [2, 2, 2], 10-token segments",
    }
    hf = r["hf_generate"]
    md = [
        "# GRPO sampling: HF generate vs the prefill-once samplers (flat and tree)",
        "",
        f"Machine: {d['machine']['cpu']}, {d['machine']['cores']} cores, {s['threads']} torch "
        f"threads, torch {d['machine']['torch']}. Shipped base (fp32), {s['prompts']} counting "
        f"prompts x G={s['group']}, temperature 1.0, up to {s['max_new_tokens']} new tokens; "
        f"{s['repeats']} timed runs per arm (rotating order) after a warm-up of each.",
        "",
        "| sampler | median s | leaf tokens per call | decoded tokens per call | leaf tokens/s | "
        "time vs generate |",
        "|---|---|---|---|---|---|",
    ]
    for a, v in r.items():
        md.append(
            f"| {names.get(a, a)} | {v['median_s']:.2f} | {v['tokens_mean']:.0f} | "
            f"{v['decoded_mean']:.0f} | {v['tokens_per_s']:.0f} | "
            f"{hf['median_s'] / v['median_s']:.2f}x |"
        )
    t = r.get("tree")
    if t:
        md += ["", f"The tree decodes {t['decoded_mean'] / t['tokens_mean']:.2f}x the tokens of "
               "its leaves (a segment shared by k leaves is sampled once)."]  # fmt: skip
    return "\n".join(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    arms = run(args)
    data = {
        "machine": machine(),
        "settings": vars(args),
        "arms": arms,
        "speedup_tokens_per_s": {
            a: v["tokens_per_s"] / arms["hf_generate"]["tokens_per_s"] for a, v in arms.items()
        },
    }
    write_results("prefill_fork", data, markdown(data), seeds=[args.seed])
    print(markdown(data))


if __name__ == "__main__":
    main()
