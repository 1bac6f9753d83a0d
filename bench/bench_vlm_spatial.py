"""Does GRPO after an SFT warm start teach the tiny VLM the 3D spatial tasks?

GRPO on the 3D spatial tasks (MuJoCo rooms, VSI-style questions) with the tiny VLM.

The shipped base (assets/vlm_base) was trained on image counting only, so the run is:
base -> SFT warm start on templated spatial traces (``--minutes``) -> GRPO from that checkpoint
(``--minutes``), with continued SFT from the same warm start for the same wall time as the
control arm. Every model is scored greedily on the same held-out questions (a data seed no arm
trained on), per question family: MRA for numeric answers, exact letter for choices. Each arm
runs in its own process (`perceptrl sft` / `perceptrl train`).

    python bench/bench_vlm_spatial.py [--minutes 5] [--n-train 2000] [--n-test 180]

Writes bench/results/vlm_spatial.{json,md} and the evaluation charts under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

from common import arm_runner, machine, metrics, write_results

ARMS = ("base", "sft_warm", "grpo", "sft_more")
RESULT = Path(__file__).resolve().parent / "results" / "vlm_spatial.json"
SFT_ARGS = ["train.lr=2.0e-3", "train.warmup_steps=20", "rollout.prompts_per_step=16"]


def score(model: Path, samples: list[dict], out: Path) -> dict:
    """Greedy accuracy per family, prompted exactly as in training (the recipe's settings)."""
    from perceptrl.cli import CONFIGS
    from perceptrl.rewards import build_reward
    from perceptrl.vlm.builder import build_policy as vlm_policy
    from perceptrl.vlm.report import family_rows, write_report
    from perceptrl.vlm.run_plan import resolve
    from perceptrl.vlm.source import evaluate_accuracy
    from perceptrl.wiring import load_config

    cfg = load_config(CONFIGS / "vlm_spatial.yaml", [f"model.path={model}"])
    policy = vlm_policy(resolve(cfg), out)
    m = evaluate_accuracy(
        policy, samples, build_reward({"accuracy": 1.0}), batch_size=32,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )  # fmt: skip
    write_report(family_rows(m, samples), out, model=str(model))  # eval.json/md/png per arm
    return m


def prior_baseline(train: list[dict], test: list[dict]) -> dict[str, float]:
    """Accuracy of a constant answer per family, chosen on the training set: the median for
    numeric families (scored with MRA), the most frequent letter for choices. A model that only
    learned the answer distribution scores this."""
    from perceptrl.rewards.measure import mra_score

    out, scores = {}, []
    for fam in sorted({s["family"] for s in test}):
        tr = [s["answer"] for s in train if s["family"] == fam]
        te = [s["answer"] for s in test if s["family"] == fam]
        if next(s for s in test if s["family"] == fam)["reward"] == "mra":
            const = statistics.median(float(a) for a in tr)
            fam_scores = [mra_score(const, float(a)) for a in te]
        else:
            const = Counter(tr).most_common(1)[0][0]
            fam_scores = [float(a == const) for a in te]
        out[fam] = sum(fam_scores) / len(fam_scores)
        scores += fam_scores
    out["all"] = sum(scores) / len(scores)
    return out


def grpo_breakdown(rows: list[dict]) -> dict:
    steps = [r for r in rows if "time/step" in r and "actor/pg_loss" in r]
    out = {
        k.split("/")[1]: sum(r.get(k, 0.0) for r in steps) / max(len(steps), 1)
        for k in ("time/rollout", "time/old_logp", "time/forward_backward", "time/step")
    }
    for key in ("reward/mean", "reward/accuracy", "reward/format"):
        vals = [r[key] for r in steps if key in r]
        k = max(1, len(vals) // 5)
        name = key.split("/")[1]
        out[f"{name}_first_fifth"] = sum(vals[:k]) / k if vals else float("nan")
        out[f"{name}_last_fifth"] = sum(vals[-k:]) / k if vals else float("nan")
    out["steps"] = len(steps)
    out["peak_rss_mb"] = max((r.get("sys/peak_rss_mb", 0.0) for r in steps), default=0.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="wall time of each training arm")
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-test", type=int, default=180)
    ap.add_argument("--base", default="assets/vlm_base")
    ap.add_argument("--out", default="runs/bench_vlm_spatial")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--reuse", action="store_true",
        help="keep the data and the arms already under --out (rescore them; wall times from the "
        "previous results file)",
    )  # fmt: skip
    args = ap.parse_args()

    from perceptrl.datasets.loader import load_samples
    from perceptrl.datasets.spatial import generate
    from perceptrl.trainer.runtime import resolve_path

    out = Path(args.out)
    base = resolve_path(args.base)
    previous = json.loads(RESULT.read_text()) if args.reuse and RESULT.exists() else {}
    train, test_path = out / "data" / "train.jsonl", out / "eval_data" / "test.jsonl"
    t = time.perf_counter()
    if not (args.reuse and train.exists() and test_path.exists()):
        generate(out / "data", splits={"train": args.n_train}, seed=1)
        generate(out / "eval_data", splits={"test": args.n_test}, seed=1000 + args.seed)
    gen_s = previous.get("generate_s", 0.0) if args.reuse else time.perf_counter() - t
    test = load_samples(test_path)[0]

    common = [f"train.time_limit_min={args.minutes}", "train.steps=100000", f"train.seed={args.seed}",
              "log.progress=false", "train.eval_every=0", "train.eval_samples=0",
              f"data.train={train.resolve()}", "checkpoint.every=0"]  # fmt: skip
    wall: dict[str, float] = {}

    arm = arm_runner(out, args.reuse, previous, wall)
    warm = arm("sft_warm", ["sft", "vlm_spatial", *common, *SFT_ARGS, f"model.path={base}"])
    grpo = arm("grpo", ["train", "vlm_spatial", *common, f"model.path={warm}"])
    more = arm("sft_more", ["sft", "vlm_spatial", *common, *SFT_ARGS, f"model.path={warm}"])
    models = {"base": base, "sft_warm": warm, "grpo": grpo, "sft_more": more}
    results = {arm: score(models[arm], test, out / "eval" / arm) for arm in ARMS}
    train_samples = load_samples(train)[0]
    prior = prior_baseline(train_samples, test)

    fams = sorted(k.split("/", 1)[1] for k in results["base"] if k.startswith("accuracy/"))
    sft_rows = {arm: metrics(out / arm) for arm in ("sft_warm", "sft_more")}
    data = {
        "machine": machine(note="2 CPU cores shared with other jobs; OMP_NUM_THREADS=1"),
        "settings": {
            "minutes_per_arm": args.minutes,
            "n_train": len(train_samples),
            "n_test": len(test),
            "train_data_seed": 1,
            "eval_data_seed": 1000 + args.seed,
            "seed": args.seed,
            "decoding": "greedy",
            "base": str(args.base),
            "views": 4,
            "image_size": 112,
            "sft_args": SFT_ARGS,
        },  # fmt: skip
        "generate_s": gen_s,
        "wall_s": wall,
        "accuracy": {arm: results[arm]["accuracy"] for arm in ARMS},
        "per_family": {arm: {f: results[arm][f"accuracy/{f}"] for f in fams} for arm in ARMS},
        "answer_prior_baseline": prior,
        "format": {arm: results[arm].get("reward/accuracy") for arm in ARMS},
        "grpo": grpo_breakdown(metrics(out / "grpo")),
        "sft_steps": {a: len([r for r in rows if "sft/loss" in r]) for a, rows in sft_rows.items()},
    }
    g = data["grpo"]
    md = [
        f"# GRPO on 3D spatial questions (MuJoCo, 4 views), {args.minutes:g} min per arm",
        "",
        f"Machine: {data['machine']['cpu']}, {data['machine']['cores']} cores shared with other "
        f"jobs, torch {data['machine']['torch']}. Greedy decoding on {args.n_test} held-out "
        f"questions (eval data seed {1000 + args.seed}); MRA for numeric families, exact letter "
        "for choices. base = shipped counting SFT base; sft_warm = base + SFT on spatial traces; "
        "grpo = sft_warm + GRPO; sft_more = sft_warm + the same wall time of SFT (control).",
        "",
        "| family | " + " | ".join(ARMS) + " | answer prior |",
        "|---|" + "---|" * (len(ARMS) + 1),
    ]
    for f in fams:
        cells = " | ".join(f"{data['per_family'][a][f]:.3f}" for a in ARMS)
        md.append(f"| {f} | {cells} | {prior[f]:.3f} |")
    cells = " | ".join(f"**{data['accuracy'][a]:.3f}**" for a in ARMS)
    md.append(f"| **all** | {cells} | **{prior['all']:.3f}** |")
    md += [
        "",
        "answer prior = a constant answer per family chosen on the training set (median for "
        "numeric families, most frequent letter for choices): what a model that learned only the "
        "answer distribution scores.",
    ]
    md += [
        "",
        f"GRPO: {g['steps']} steps, mean step {g['step']:.1f} s (rollout {g['rollout']:.1f}, "
        f"old log-probs {g['old_logp']:.1f}, forward/backward {g['forward_backward']:.1f}); "
        f"training reward (format 0.2 + accuracy) first fifth of the steps {g['mean_first_fifth']:.3f} "
        f"-> last fifth {g['mean_last_fifth']:.3f} (accuracy {g['accuracy_first_fifth']:.3f} -> "
        f"{g['accuracy_last_fifth']:.3f}); peak RSS {g['peak_rss_mb']:.0f} MB. SFT steps: "
        f"{data['sft_steps']}. Data generation ({len(train_samples) + len(test)} questions): "
        f"{gen_s:.0f} s.",
    ]
    seeds = {"train": [args.seed], "train_data": 1, "eval_data": 1000 + args.seed}
    js, mdp = write_results("vlm_spatial", data, "\n".join(md), seeds=seeds)
    print("\n".join(md))
    print(f"\nwrote {js} and {mdp}")


if __name__ == "__main__":
    main()
