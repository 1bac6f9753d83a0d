"""Flat GRPO sampling: Hugging Face ``generate`` against the prefill-once KV sampler.

Issue 15 asks that the root of every group (its prompt) be prefilled once and its KV cache forked
to the G rows. ``vlm/rollout.py`` ``sample`` calls ``model.generate`` on G copies of each prompt
(the vision tower and the prompt's prefill run G times); the episode sampler of
``vlm/episode_rollout.py`` already prefills each distinct prompt once and indexes its keys and
values out to its rows. With an environment that ends every episode after its first turn it
samples exactly a flat GRPO group, so timing both on the same prompts measures what the fork
would save before the single-turn path is moved onto it.

Both arms: the shipped base (``vlm_clevr`` recipe), the same encoded prompts, ``--prompts`` x
``--group`` rows, temperature 1.0, ``--max-new-tokens``, log-probs not kept, arms alternating,
``--repeats`` runs each after one untimed warm-up of each.

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

    from perceptrl.vlm.episode import EpisodeSettings
    from perceptrl.vlm.rollout import SamplingParams, sample
    from perceptrl.vlm.run import build_policy, load_data
    from perceptrl.wiring import load_config

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"data.n_train={args.prompts}", "data.n_val=1", "train.device=cpu"]
        cfg = load_config(
            Path(__file__).resolve().parents[1] / "configs" / "vlm_clevr.yaml", overrides
        )
        data = load_data(cfg, Path(tmp))
        policy = build_policy(cfg, Path(tmp))
        prompts, _ = policy.encode(data.train[: args.prompts])
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    fork = EpisodeSettings(env=FirstTurnOnly, max_tokens=args.max_new_tokens)

    def hf():
        return sample(policy.model, policy.processor, prompts, args.group, sp)

    def prefill_once():
        policy.episode = fork
        try:
            return policy.sample(prompts, args.group, sp)
        finally:
            policy.episode = None

    arms = {"hf_generate": hf, "prefill_once": prefill_once}
    times: dict[str, list[float]] = {a: [] for a in arms}
    tokens: dict[str, list[float]] = {a: [] for a in arms}
    for rep in range(args.repeats + 1):
        for name in arms if rep % 2 == 0 else list(arms)[::-1]:
            torch.manual_seed(args.seed + rep)
            t = time.perf_counter()
            batch = arms[name]()
            if rep == 0:
                continue  # warm-up
            times[name].append(time.perf_counter() - t)
            tokens[name].append(float(batch.mask.sum()))
    return {
        a: {
            "median_s": statistics.median(times[a]),
            "runs_s": times[a],
            "tokens_mean": statistics.mean(tokens[a]),
            "tokens_per_s": statistics.mean(tokens[a]) / statistics.median(times[a]),
        }
        for a in arms
    }


def markdown(d: dict) -> str:
    s, r = d["settings"], d["arms"]
    hf, fork = r["hf_generate"], r["prefill_once"]
    return "\n".join(
        [
            "# Flat GRPO sampling: HF generate vs the prefill-once KV sampler",
            "",
            f"Machine: {d['machine']['cpu']}, {d['machine']['cores']} cores, {s['threads']} torch "
            f"threads, torch {d['machine']['torch']}. Shipped base (fp32), {s['prompts']} counting "
            f"prompts x G={s['group']}, temperature 1.0, up to {s['max_new_tokens']} new tokens; "
            f"{s['repeats']} alternating timed runs per arm after a warm-up of each.",
            "",
            "| sampler | median s | tokens per call | tokens/s |",
            "|---|---|---|---|",
            f"| `model.generate` on G copies of each prompt | {hf['median_s']:.2f} | "
            f"{hf['tokens_mean']:.0f} | {hf['tokens_per_s']:.0f} |",
            f"| prefill once, fork the KV cache (episode sampler, one turn) | "
            f"{fork['median_s']:.2f} | {fork['tokens_mean']:.0f} | {fork['tokens_per_s']:.0f} |",
            "",
            f"The prefill-once sampler is {d['speedup_tokens_per_s']:.2f}x HF generate in tokens "
            "per second here. Flat GRPO rollouts still use HF generate; moving them onto the "
            "fork is the first step of issue 15.",
        ]
    )


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
        "speedup_tokens_per_s": arms["prefill_once"]["tokens_per_s"]
        / arms["hf_generate"]["tokens_per_s"],
    }
    write_results("prefill_fork", data, markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
