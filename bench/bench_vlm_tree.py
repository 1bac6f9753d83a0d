"""Do tree rollouts train as well as flat GRPO groups while decoding fewer tokens?

Tree rollouts versus flat GRPO groups at the same number of leaves per prompt (issue 15).

Both arms start from the shipped base (assets/vlm_base), train on the same counting data for the
same wall time, each in its own process, and are scored greedily on held-out questions (a data
seed neither trained on):

* flat: ``configs/vlm_clevr.yaml`` (GRPO, 8 independent completions per prompt, each prompt
  prefilled once and forked);
* tree: ``configs/vlm_clevr_tree.yaml`` (branches [2, 2, 2] of 10-token segments, TreePO-style
  advantages), the same recipe otherwise;
* treerl (``--arms`` to add it): the tree with TreeRL-style segment credit.

Per training step: tokens the sampler decoded (a segment shared by k leaves counts once), tokens
of the leaves, wall time of the step and of its rollout. The recipes were fixed before the run
(no tuning on the held-out questions).

    python bench/bench_vlm_tree.py [--minutes 10] [--n-test 200] [--arms flat,tree]

Writes bench/results/vlm_tree.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from common import last_model, machine, metrics, run_arm, write_results

RECIPES = {
    "flat": ("vlm_clevr", []),
    "tree": ("vlm_clevr_tree", []),
    "treerl": ("vlm_clevr_tree", ["algo.adv_estimator=treerl"]),
}
FAMILIES = ["count_all", "count_color", "count_shape"]
GOAL_TOKEN_RATIO = 0.65


def score(model: Path, samples: list[dict]) -> dict:
    from perceptrl.rewards import build_reward
    from perceptrl.vlm.policy import VLMPolicy
    from perceptrl.vlm.source import evaluate_accuracy

    policy = VLMPolicy.from_pretrained(model)
    return evaluate_accuracy(
        policy, samples, build_reward({"accuracy": 1.0}), batch_size=50, max_new_tokens=64
    )


def step_summary(rows: list[dict]) -> dict:
    """Means over the training steps: decoded and leaf tokens, step and rollout seconds."""
    steps = [r for r in rows if "actor/pg_loss" in r]
    leaf = [r["rollout/completion_len_mean"] * r["rollout/samples"] for r in steps]
    decoded = [r.get("rollout/sampled_tokens", x) for r, x in zip(steps, leaf)]

    def mean(key):
        vals = [r[key] for r in steps if key in r]
        return statistics.mean(vals) if vals else None

    k = max(1, len(steps) // 5)
    acc = [r["reward/accuracy"] for r in steps if "reward/accuracy" in r]
    return {
        "steps": len(steps),
        "decoded_tokens": statistics.mean(decoded),
        "leaf_tokens": statistics.mean(leaf),
        "step_s": mean("time/step"),
        "rollout_s": mean("time/rollout"),
        "completion_len": mean("rollout/completion_len_mean"),
        "train_accuracy_first": statistics.mean(acc[:k]),
        "train_accuracy_last": statistics.mean(acc[-k:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--n-test", type=int, default=200)
    ap.add_argument("--arms", default="flat,tree")
    ap.add_argument("--base", default="assets/vlm_base")
    ap.add_argument("--out", default="runs/bench_vlm_tree")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from perceptrl.datasets.clevr import generate
    from perceptrl.datasets.loader import load_samples
    from perceptrl.trainer.runtime import resolve_path

    out, base = Path(args.out), resolve_path(args.base)
    generate(out / "data", splits={"train": args.n_train}, families=FAMILIES, seed=1)
    generate(out / "eval_data", splits={"test": args.n_test}, families=FAMILIES,
             seed=1000 + args.seed)  # fmt: skip
    test = load_samples(out / "eval_data" / "test.jsonl")[0]
    common = [f"model.path={base}", f"train.time_limit_min={args.minutes}", "train.steps=100000",
              f"train.seed={args.seed}", "log.progress=false", "train.eval_every=0",
              "train.eval_samples=0", f"data.train={(out / 'data' / 'train.jsonl').resolve()}",
              "checkpoint.every=0"]  # fmt: skip
    arms = args.arms.split(",")
    wall, steps, acc = {}, {}, {"base": score(base, test)}
    for a in arms:
        recipe, extra = RECIPES[a]
        wall[a] = run_arm(["train", recipe, *common, *extra], out / a)
        steps[a] = step_summary(metrics(out / a))
        acc[a] = score(last_model(out / a), test)
    data = {
        "machine": machine(note="2 CPU cores"),
        "settings": {
            "minutes": args.minutes,
            "n_train": args.n_train,
            "n_test": len(test),
            "train_data_seed": 1,
            "eval_data_seed": 1000 + args.seed,
            "seed": args.seed,
            "families": FAMILIES,
            "decoding": "greedy",
            "recipes": RECIPES,
        },  # fmt: skip
        "wall_s": wall,
        "steps": steps,
        "accuracy": {
            a: {k: v for k, v in r.items() if k.startswith("accuracy")} for a, r in acc.items()
        },  # fmt: skip
    }
    flat = steps.get("flat")
    if flat:
        data["vs_flat"] = {
            a: {
                "decoded_token_ratio": s["decoded_tokens"] / flat["decoded_tokens"],
                "step_time_ratio": s["step_s"] / flat["step_s"],
                "rollout_time_ratio": s["rollout_s"] / flat["rollout_s"],
                "accuracy_gap": acc[a]["accuracy"] - acc["flat"]["accuracy"],
            }
            for a, s in steps.items() if a != "flat"
        }  # fmt: skip
    seeds = {"train": [args.seed], "train_data": 1, "eval_data": 1000 + args.seed}
    js, md = write_results("vlm_tree", data, markdown(data), seeds=seeds)
    print(markdown(data))
    print(f"\nwrote {js} and {md}")


def markdown(d: dict) -> str:
    s, m = d["settings"], d["machine"]
    md = [
        f"# Tree rollouts vs flat GRPO groups: {s['minutes']:g} min of training per arm",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}. Both arms from "
        f"assets/vlm_base, 16 prompts x 8 leaves per step, max 64 new tokens; greedy accuracy on "
        f"{s['n_test']} held-out questions (data seed {s['eval_data_seed']}; training data seed "
        f"{s['train_data_seed']}).",
        "",
        "| arm | steps | decoded tokens / step | leaf tokens / step | step (s) | rollout (s) | "
        "held-out accuracy |",
        "|---|---|---|---|---|---|---|",
        f"| base | - | - | - | - | - | {d['accuracy']['base']['accuracy']:.3f} |",
    ]
    for a, st in d["steps"].items():
        md.append(
            f"| {a} | {st['steps']} | {st['decoded_tokens']:.0f} | {st['leaf_tokens']:.0f} | "
            f"{st['step_s']:.2f} | {st['rollout_s']:.2f} | {d['accuracy'][a]['accuracy']:.3f} |"
        )
    for a, v in d.get("vs_flat", {}).items():
        met = v["decoded_token_ratio"] <= GOAL_TOKEN_RATIO
        md += [
            "",
            f"{a} / flat: {v['decoded_token_ratio']:.2f}x the decoded tokens per step (goal <= "
            f"{GOAL_TOKEN_RATIO}: {'met' if met else 'not met'}), {v['step_time_ratio']:.2f}x the "
            f"step time, {v['rollout_time_ratio']:.2f}x the rollout time; held-out accuracy "
            f"{v['accuracy_gap']:+.3f} against flat at equal wall time (goal >= 0: "
            f"{'met' if v['accuracy_gap'] >= 0 else 'not met'}; one seed, standard error of the "
            f"difference about {_se_diff(d, a):.3f} on {s['n_test']} questions).",
        ]
    fams = sorted(k for k in d["accuracy"]["base"] if "/" in k)
    md += [
        "",
        "| family | " + " | ".join(d["accuracy"]) + " |",
        "|---|" + "---|" * len(d["accuracy"]),
    ]
    for f in fams:
        md.append(f"| {f.split('/')[1]} | " + " | ".join(
            f"{r.get(f, float('nan')):.3f}" for r in d["accuracy"].values()) + " |")  # fmt: skip
    return "\n".join(md)


def _se_diff(d: dict, arm: str) -> float:
    """Standard error of the accuracy difference arm - flat, as two independent proportions."""
    n = d["settings"]["n_test"]
    ps = [d["accuracy"][a]["accuracy"] for a in (arm, "flat")]
    return sum(p * (1 - p) / n for p in ps) ** 0.5


if __name__ == "__main__":
    main()
