"""Reason, then act: a VLM planner trained by what its executor achieves in MuJoCo (issue 17).

Task: the long-horizon composites of ``sim/composite.py`` (put_two, put_then_stack,
push_then_put, put_three; 2-3 subgoals each), samples from ``datasets/plan.py``. The planner is
the planner base (assets/vlm_plan_base: the shipped tiny VLM after a text-only drill on planner
dialogues, bench/make_plan_base.py) under ``configs/plan_grpo.yaml``; the executor is the
scripted oracle (``plan.executor=oracle``) unless ``--executor-args`` says otherwise. Arms, each
in its own process:

* base: the planner base as it is (it has read dialogues, never an image);
* sft: the warm start on the oracle plans (``--sft-steps``), every trace's subgoals executed;
* grpo: GRPO from the sft checkpoint for ``--grpo-minutes`` with the simulator's rewards.

Scored greedily on held-out initial states (the generator's test split: task ids no training
or validation sample uses, trial seed ``1000 + --seed``): the share of episodes that complete
the task (``planner/success``), progress, valid subgoals, turns; and the oracle plan with the
same executor on the same states (the upper bound of planning).

    python bench/bench_plan.py [--sft-steps 100] [--grpo-minutes 10] [--n-test 100]

Writes bench/results/plan.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import arm_runner, machine, metrics, write_results

RESULT = Path(__file__).resolve().parent / "results" / "plan.json"
SFT_ARGS = ["train.lr=3.0e-4", "rollout.prompts_per_step=8"]
GOALS = {"grpo_minus_sft": 0.20}
KEYS = ("planner/success", "planner/progress", "planner/valid", "planner/invalid",
        "planner/subgoals", "planner/executed", "episode/turns_mean")  # fmt: skip


def score(model: Path, samples: list[dict], out: Path, extra: list[str]) -> dict:
    """Greedy planner episodes on ``samples``: success per task and the episode records."""
    from perceptrl.cli import CONFIGS
    from perceptrl.wiring import load_config, side

    cfg = load_config(
        CONFIGS / "plan_grpo.yaml",
        [f"model.path={model}", f"train.eval_samples={len(samples)}", *extra],
    )
    side(cfg)  # registers the planner's environment
    from perceptrl.vlm.run import build_evaluator, build_policy

    policy = build_policy(cfg, out)
    return build_evaluator(cfg, samples)(policy)


def oracle(samples: list[dict], extra: list[str]) -> dict:
    """The oracle plan (the generator's traces) with the recipe's executor on ``samples``."""
    from perceptrl.cli import CONFIGS
    from perceptrl.datasets.plan import reasoning_trace
    from perceptrl.vla.plan import PlanEnv, plan_settings
    from perceptrl.wiring import load_config

    env = PlanEnv(plan_settings(load_config(CONFIGS / "plan_grpo.yaml", extra)))
    by_task: dict[str, list[float]] = {}
    for s in samples:
        env.reset([s])
        for turn in reasoning_trace(s):
            if env.respond(0, turn) is None:
                break
        by_task.setdefault(s["family"], []).append(env.rows[0].record["planner/success"])
    every = [v for vs in by_task.values() for v in vs]
    return {"accuracy": sum(every) / len(every),
            **{f"accuracy/{k}": sum(v) / len(v) for k, v in sorted(by_task.items())}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=100)
    ap.add_argument("--grpo-minutes", type=float, default=10.0)
    ap.add_argument("--n-train", type=int, default=400)
    ap.add_argument("--n-test", type=int, default=100)
    ap.add_argument("--base", default="assets/vlm_plan_base")
    ap.add_argument("--out", default="runs/bench_plan")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--executor-args", nargs="*", default=[], help="plan.* overrides")
    ap.add_argument("--grpo-args", nargs="*", default=[], help="overrides of the GRPO arm")
    ap.add_argument("--reuse", action="store_true", help="rescore the arms already under --out")
    ap.add_argument(
        "--sft-model",
        default="",
        help="start GRPO from this SFT model instead of "
        "training the sft arm (say how it was trained with --sft-note)",
    )
    ap.add_argument("--sft-note", default="")
    args = ap.parse_args()

    from perceptrl.datasets.loader import load_samples
    from perceptrl.datasets.plan import generate
    from perceptrl.trainer.runtime import resolve_path

    out, base = Path(args.out), resolve_path(args.base)
    previous = json.loads(RESULT.read_text()) if args.reuse and RESULT.exists() else {}
    train, test_path = out / "data" / "train.jsonl", out / "eval_data" / "test.jsonl"
    if not (args.reuse and train.exists() and test_path.exists()):
        generate(out / "data", splits={"train": args.n_train}, seed=args.seed)
        generate(out / "eval_data", splits={"test": args.n_test}, seed=1000 + args.seed)
    test = load_samples(test_path)[0]
    common = [f"train.seed={args.seed}", "log.progress=false", "train.eval_every=0",
              "train.eval_samples=0", f"data.train={train.resolve()}", "data.val=",
              *args.executor_args]  # fmt: skip
    wall: dict[str, float] = {}

    arm = arm_runner(out, args.reuse, previous, wall)

    if args.sft_model:
        sft = resolve_path(args.sft_model)
    else:
        sft = arm("sft", ["sft", "plan_grpo", f"train.steps={args.sft_steps}", *common,
                          *SFT_ARGS, f"model.path={base}", "checkpoint.every=0"])  # fmt: skip
    grpo = arm("grpo", ["train", "plan_grpo", "train.steps=100000", *common,
                        f"train.time_limit_min={args.grpo_minutes}", f"model.path={sft}",
                        "checkpoint.every=0", *args.grpo_args])  # fmt: skip
    results = {
        name: score(path, test, out / "eval" / name, args.executor_args)
        for name, path in (("base", base), ("sft", sft), ("grpo", grpo))
    }
    results["oracle_plan"] = oracle(test, args.executor_args)
    data = report_data(args, results, wall, out, len(test))
    js, mdp = write_results("plan", data, markdown(data))
    print(markdown(data))
    print(f"\nwrote {js} and {mdp}")


def grpo_summary(rows: list[dict]) -> dict:
    """Steps, seconds per step, and the training reward and planner records in the first and
    last fifth of the steps."""
    steps = [r for r in rows if "actor/pg_loss" in r]
    out: dict = {"steps": len(steps)}
    vals = [r["time/step"] for r in steps if "time/step" in r]
    out["step_s"] = sum(vals) / len(vals) if vals else None
    k = max(1, len(steps) // 5)
    for key in ("reward/mean", *KEYS):
        vals = [r[key] for r in steps if key in r]
        name = key.replace("/", "_")
        out[f"{name}_first"] = sum(vals[:k]) / len(vals[:k]) if vals else None
        out[f"{name}_last"] = sum(vals[-k:]) / len(vals[-k:]) if vals else None
    return out


def report_data(args, results: dict, wall: dict, out: Path, n_test: int) -> dict:
    tasks = sorted(k.split("/", 1)[1] for k in results["oracle_plan"] if "/" in k)
    success = {
        a: {"all": r["accuracy"], **{t: r.get(f"accuracy/{t}") for t in tasks}}
        for a, r in results.items()
    }
    gap = success["grpo"]["all"] - success["sft"]["all"]
    return {
        "machine": machine(note="2 CPU cores"),
        "settings": {
            "sft_steps": args.sft_steps,
            "grpo_minutes": args.grpo_minutes,
            "n_train": args.n_train,
            "n_test": n_test,
            "seed": args.seed,
            "test_trial_seed": 1000 + args.seed,
            "decoding": "greedy",
            "base": str(args.base),
            "executor_args": args.executor_args,
            "grpo_args": args.grpo_args,
            "sft_args": SFT_ARGS,
            "sft_model": args.sft_note or ("given" if args.sft_model else "trained by this run"),
        },  # fmt: skip
        "wall_s": wall,
        "success": success,
        "episodes": {
            a: {k: r.get(k) for k in KEYS} for a, r in results.items() if a != "oracle_plan"
        },
        "gaps": {
            "grpo_minus_sft": gap,
            "oracle_minus_grpo": success["oracle_plan"]["all"] - success["grpo"]["all"],
        },
        "goals": {k: {"goal": v, "met": gap >= v} for k, v in GOALS.items()},
        "grpo": grpo_summary(metrics(out / "grpo")),
    }


def markdown(d: dict) -> str:
    s, tasks = d["settings"], [t for t in d["success"]["oracle_plan"] if t != "all"]
    lines = [
        "# Reason, then act: planner success on held-out initial states",
        "",
        f"Machine: {d['machine']['cpu']} ({d['machine']['cores']} cores). Planner: tiny VLM "
        f"({s['base']}); executor: {' '.join(s['executor_args']) or 'plan.executor=oracle'}. "
        f"SFT: {s['sft_model']}, then GRPO for {s['grpo_minutes']} min "
        f"({d['grpo']['steps']} steps, {d['grpo']['step_s'] or 0:.1f} s each). Greedy episodes on "
        f"{s['n_test']} held-out states (test split, trial seed {s['test_trial_seed']}).",
        "",
        "| planner | all | " + " | ".join(tasks) + " |",
        "|---|---|" + "---|" * len(tasks),
    ]
    for a, row in d["success"].items():
        cells = " | ".join(f"{row[t]:.3f}" if row[t] is not None else "-" for t in tasks)
        lines.append(f"| {a} | {row['all']:.3f} | {cells} |")
    lines += ["", "| planner | " + " | ".join(KEYS) + " |", "|---|" + "---|" * len(KEYS)]
    for a, row in d["episodes"].items():
        lines.append(
            f"| {a} | "
            + " | ".join(f"{row[k]:.3f}" if row[k] is not None else "-" for k in KEYS)
            + " |"
        )
    g = d["gaps"]
    lines += [
        "",
        f"GRPO minus SFT: {g['grpo_minus_sft']:+.3f} (goal +{GOALS['grpo_minus_sft']:.2f}: "
        f"{'met' if d['goals']['grpo_minus_sft']['met'] else 'not met'}); oracle plan minus GRPO: "
        f"{g['oracle_minus_grpo']:+.3f}. Wall time: "
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in d["wall_s"].items())
        + ".",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
