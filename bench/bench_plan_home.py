"""How much of the oracle plan do trained executors complete: from where left, home, retries?

Trained executors on the oracle plan: subgoals started where the last one ended, against
subgoals started at the home pose, and from home with a failed subgoal issued again, on the same
held-out composite states.

The state VLAs of ``configs/plan_exec_bc.yaml`` are cloned from primitive episodes that all start
with the arm at the home posture. In a long task a subgoal used to start wherever the previous
one left the arm (risen clear above the last bowl), a state no primitive episode shows, and the
policy executors finished far fewer subgoals in composites than on their own tasks
(bench/results/plan_policy.md). ``plan.home`` sends the arm home after each subgoal; this
benchmark runs the generator's plan with the same frozen executors both ways. The third arm
re-issues a subgoal the executor did not finish, up to ``--retries`` more times (the closed-loop
oracle plan): how much a planner could gain by retrying with these executors.

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

MODES = {
    "where_left": "plan.home=never",
    "home": "plan.home=always",
    "home_retry": "plan.home=always",
}
"""arm -> the setting it runs with (home_retry also retries failed subgoals)"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs/bench_plan_policy")
    ap.add_argument(
        "--seeds", nargs=3, type=int, default=[1, 0, 0], metavar=("PUT", "STACK", "PUSH")
    )
    ap.add_argument("--n-test", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--retries", type=int, default=2, help="repeat attempts of the home_retry arm")
    args = ap.parse_args()

    from perceptrl.datasets.loader import load_samples
    from perceptrl.datasets.plan_tasks import generate
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
        retries = args.retries if mode == "home_retry" else 0
        results[mode], families[mode], per_sample[mode] = oracle(
            test, ["plan.executor=policy", setting, *policies], retries
        )
        wall[mode] = time.perf_counter() - t0
    data = {
        "machine": machine(note="2 CPU cores"),
        "settings": {
            "n_test": len(test),
            "test_trial_seed": 1000 + args.seed,
            "retries": args.retries,
            "executors": {
                f: {"seed": seeds[f], "own_task": own_success(d)} for f, d in dirs.items()
            },
        },  # fmt: skip
        "success": success_table(results, "home"),
        "subgoals": families,
        "paired": paired_gain(per_sample["where_left"], per_sample["home"]),
        "paired_retry": paired_gain(per_sample["home"], per_sample["home_retry"]),
        "repeats": [results["home_retry"]["retries"], results["home_retry"]["retries/finished"]],
        "wall_s": wall,
    }
    js, md = write_results("plan_home", data, markdown(data),
                           seeds={"data": [args.seed], "executors": seeds})  # fmt: skip
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
    if "paired_retry" in d:  # older result files have two arms
        g, (tried, ok) = d["paired_retry"], d["repeats"]
        lines += [
            "",
            f"home_retry issues a subgoal the executor did not finish up to "
            f"{d['settings']['retries']} more times (the subgoals-done columns count first "
            f"attempts): {int(tried)} repeat attempts, {int(ok)} finished. Retry minus home, "
            f"paired: {g['gain']:+.3f} ± {g['se']:.3f} ({int(g['improved'])} states only with "
            f"retries, {int(g['regressed'])} only without).",
        ]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
