"""Does GRPO beat continued SFT on visual counting from the same base at equal wall time?

GRPO vs continued SFT on synthetic visual counting, from the same SFT base.

Three models are scored with greedy decoding on the same held-out questions: the base, the
base after ``--minutes`` of GRPO, and the base after the same wall time of continued SFT (the
honest control). An out-of-distribution split (colour-shape pairs and an object count never seen
in training, as CLEVR-CoGenT does for R1-V) is scored too. Each arm runs in its own process
(`perceptrl train` / `perceptrl sft`) so its peak RSS is its own.

    python bench/bench_vlm_grpo.py [--minutes 10] [--n-test 500] [--base assets/vlm_base]

Writes bench/results/vlm_grpo_counting.{json,md}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import last_model, machine, metrics, run_arm, write_results

FAMILIES = "count_all,count_color,count_shape"


def score(model: Path, splits: dict[str, list[dict]], out: Path) -> dict:
    """Greedy accuracy per split, prompted exactly as in training (the recipe's system prompt)."""
    from perceptrl.cli import CONFIGS
    from perceptrl.rewards import build_reward
    from perceptrl.vlm.builder import build_policy as vlm_policy
    from perceptrl.vlm.run_plan import resolve
    from perceptrl.vlm.source import evaluate_accuracy
    from perceptrl.wiring import load_config

    cfg = load_config(CONFIGS / "vlm_clevr.yaml", [f"model.path={model}"])
    policy = vlm_policy(resolve(cfg), out)
    reward = build_reward({"accuracy": 1.0})
    return {
        name: evaluate_accuracy(policy, samples, reward, batch_size=64, max_new_tokens=64)
        for name, samples in splits.items()
    }


def step_breakdown(rows: list[dict]) -> dict:
    steps = [r for r in rows if "time/step" in r and "actor/pg_loss" in r]
    keys = [
        "time/rollout",
        "time/refill",
        "time/reward",
        "time/old_logp",
        "time/forward_backward",
        "time/optimizer",
        "time/step",
    ]
    out = {k.split("/")[1]: sum(r.get(k, 0.0) for r in steps) / max(len(steps), 1) for k in keys}
    out["steps"] = len(steps)
    out["peak_rss_mb"] = max((r.get("sys/peak_rss_mb", 0.0) for r in steps), default=0.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="wall time of each training arm")
    ap.add_argument("--n-test", type=int, default=500)
    ap.add_argument("--base", default="assets/vlm_base")
    ap.add_argument("--out", default="runs/bench_vlm_grpo")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from perceptrl.datasets.clevr import generate
    from perceptrl.datasets.loader import load_samples
    from perceptrl.trainer.runtime import resolve_path

    out = Path(args.out)
    base = resolve_path(args.base)
    # test/ood from a data seed neither the SFT base (seed 0) nor GRPO (seed 1) trained on
    paths = generate(out / "eval_data", splits={"test": args.n_test, "ood": args.n_test},
                     families=FAMILIES.split(","), seed=1000 + args.seed)  # fmt: skip
    splits = {k: load_samples(v)[0] for k, v in paths.items()}

    common = [f"train.time_limit_min={args.minutes}", "train.steps=100000", f"model.path={base}",
              f"train.seed={args.seed}", "log.progress=false", "train.eval_every=0", "train.eval_samples=0"]  # fmt: skip
    wall = {
        "grpo": run_arm(["train", "vlm_clevr", *common, "checkpoint.every=0"], out / "grpo"),
        "sft": run_arm(["sft", "vlm_sft", *common, "data.seed=1"], out / "sft"),
    }
    results = {
        "base": score(base, splits, out),
        "grpo": score(last_model(out / "grpo"), splits, out),
        "sft": score(last_model(out / "sft"), splits, out),
    }
    grpo_rows, sft_rows = metrics(out / "grpo"), metrics(out / "sft")
    data = {
        "machine": machine(),
        "settings": {
            "minutes_per_arm": args.minutes,
            "n_test": args.n_test,
            "seed": args.seed,
            "eval_data_seed": 1000 + args.seed,
            "families": FAMILIES,
            "decoding": "greedy",
            "base": str(args.base),
        },  # fmt: skip
        "wall_s": wall,
        "accuracy": {
            arm: {split: r[split]["accuracy"] for split in r} for arm, r in results.items()
        },
        "per_family": {
            arm: {
                split: {k: v for k, v in r[split].items() if k.startswith("accuracy/")}
                for split in r
            }
            for arm, r in results.items()
        },  # fmt: skip
        "grpo_steps": step_breakdown(grpo_rows),
        "sft_steps": len([r for r in sft_rows if "sft/loss" in r]),
        "sft_peak_rss_mb": max((r.get("sys/peak_rss_mb", 0.0) for r in sft_rows), default=0.0),
    }
    acc = data["accuracy"]
    md = [
        f"# GRPO vs continued SFT on synthetic counting ({args.minutes:g} min per arm)",
        "",
        f"Machine: {data['machine']['cpu']}, {data['machine']['cores']} cores, torch {data['machine']['torch']}. "
        f"Greedy decoding, {args.n_test} questions per split ({FAMILIES}), eval data seed {1000 + args.seed}.",
        "",
        "| model | held-out test | OOD (unseen colour-shape pairs / count) |",
        "|---|---|---|",
    ]
    for arm in ("base", "grpo", "sft"):
        md.append(f"| {arm} | {acc[arm]['test']:.3f} | {acc[arm]['ood']:.3f} |")
    b = data["grpo_steps"]
    md += [
        "",
        f"GRPO: {b['steps']} steps; mean step {b['step']:.2f} s = rollout {b['rollout']:.2f} + dynamic-sampling refills {b['refill']:.2f} + reward {b['reward']:.3f} "
        f"+ old log-probs {b['old_logp']:.2f} + forward/backward {b['forward_backward']:.2f} + optimizer {b['optimizer']:.3f}; "
        f"peak RSS {b['peak_rss_mb']:.0f} MB. SFT: {data['sft_steps']} steps, peak RSS {data['sft_peak_rss_mb']:.0f} MB.",
    ]
    seeds = {"train": [args.seed], "eval_data": 1000 + args.seed}
    js, mdp = write_results("vlm_grpo_counting", data, "\n".join(md), seeds=seeds)
    print("\n".join(md))
    print(f"\nwrote {js} and {mdp}")


if __name__ == "__main__":
    main()
