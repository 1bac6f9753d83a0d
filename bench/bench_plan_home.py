"""Trained executors on the oracle plan: subgoals started where the last one ended, against
subgoals started at the home pose, on the same held-out composite states.

The state VLAs of ``configs/plan_exec_bc.yaml`` are cloned from primitive episodes that all start
with the arm at the home posture. In a long task a subgoal used to start wherever the previous
one left the arm (risen clear above the last bowl), a state no primitive episode shows, and the
policy executors finished far fewer subgoals in composites than on their own tasks
(bench/results/plan_policy.md). ``plan.home`` sends the arm home after each subgoal; this
benchmark runs the generator's plan with the same frozen executors both ways.

Executors come from a ``bench_plan.py --executor policy`` run directory (``--runs``): for each
family the seed named by ``--seeds`` (``exec_<family>_s<seed>``, its kept best weights).

Usage:
    python bench/bench_plan_home.py --runs runs/bench_plan_policy [--n-test 100]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench_plan import EXEC_ENVS, executor_model, oracle, own_success, success_table
from common import last_model, machine, write_results

MODES = {"where_left": "plan.home=never", "home": "plan.home=always"}
"""arm -> the setting it runs with"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs/bench_plan_policy")
    ap.add_argument(
        "--seeds", nargs=3, type=int, default=[1, 0, 0], metavar=("PUT", "STACK", "PUSH")
    )
    ap.add_argument("--n-test", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from perceptrl.datasets.loader import load_samples
    from perceptrl.datasets.plan import generate
    from perceptrl.vlm.report import paired_gain

    runs = Path(args.runs)
    data_dir = runs / "home_eval_data"
    generate(data_dir, splits={"test": args.n_test}, seed=1000 + args.seed)
    test = load_samples(data_dir / "test.jsonl")[0]
    seeds = dict(zip(EXEC_ENVS, args.seeds, strict=True))
    dirs = {f: runs / f"exec_{f}_s{s}" for f, s in seeds.items()}
    policies = [f"plan.policies.{f}={executor_model(d, last_model(d))}" for f, d in dirs.items()]
    results, families, per_sample, wall = {}, {}, {}, {}
    for mode, setting in MODES.items():
        t0 = time.perf_counter()
        results[mode], families[mode], per_sample[mode] = oracle(
            test, ["plan.executor=policy", setting, *policies]
        )
        wall[mode] = time.perf_counter() - t0
    data = {
        "machine": machine(note="2 CPU cores"),
        "settings": {
            "n_test": len(test),
            "test_trial_seed": 1000 + args.seed,
            "executors": {
                f: {"seed": seeds[f], "own_task": own_success(d)} for f, d in dirs.items()
            },
        },  # fmt: skip
        "success": success_table(results, "home"),
        "subgoals": families,
        "paired": paired_gain(per_sample["where_left"], per_sample["home"]),
        "wall_s": wall,
    }
    js, md = write_results("plan_home", data, markdown(data))
    print(markdown(data))
    print(f"\nwrote {js} and {md}")


def markdown(d: dict) -> str:
    ex = d["settings"]["executors"]
    tasks = sorted(t for t in d["success"]["home"] if t != "all")
    lines = [
        "# Trained executors on the oracle plan: subgoals from where the last ended, or from home",
        "",
        f"Machine: {d['machine']['cpu']} ({d['machine']['cores']} cores). The generator's plan "
        f"executed by frozen state VLAs (configs/plan_exec_bc.yaml; "
        + ", ".join(f"{f} seed {e['seed']}, own task {e['own_task']:.3f}" for f, e in ex.items())
        + f") on {d['settings']['n_test']} held-out composite states (trial seed "
        f"{d['settings']['test_trial_seed']}).",
        "",
        "| subgoals start | all | "
        + " | ".join(tasks)
        + " | "
        + " | ".join(f"{f} subgoals done" for f in ex)
        + " |",
        "|---" * (2 + len(tasks) + len(ex)) + "|",
    ]
    for mode, s in d["success"].items():
        fam = d["subgoals"][mode]
        lines.append(
            f"| {mode} | {s['all']:.3f} | " + " | ".join(f"{s[t]:.3f}" for t in tasks) + " | "
            + " | ".join(f"{fam[f][0]}/{fam[f][1]}" if f in fam else "-" for f in ex) + " |"
        )  # fmt: skip
    g = d["paired"]
    lines += [
        "",
        f"Home minus where-left, paired on the same states: {g['gain']:+.3f} ± {g['se']:.3f} "
        f"(z {g['z']:.1f}; {int(g['improved'])} states only from home, {int(g['regressed'])} "
        "only from where left). Wall time: "
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in d["wall_s"].items()) + ".",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
