"""How much faster is a round of planner subgoals executed side by side than one by one?

Executing a round of planner turns: one subgoal at a time against side by side.

A GRPO step of the planner executes every episode's subgoal of a turn. `PlanEnv.respond` alone
runs them one after the other, one policy forward per row and env step; with the round handed
to `PlanEnv.prepare` first (what the episode rollouts do) each distinct subgoal runs in a
simulator of its own and the executor acts for all of them with one forward per scene size and
step. Both modes run the same rows here in one process, alternating, and must give the same
outcomes (asserted); the ratio of their times is the speed-up.

Rows: the first subgoal of the oracle plan of ``--states`` held-out-style initial states (each
task in turn), no memo (every row simulated). Executor: the instruction-reading VLA of a
``bench_plan.py --executor reader`` run (``--policy``), or the scripted oracle.

Usage (after ``bench_plan.py --executor reader --out runs/bench_plan_reader``):
    python bench/bench_plan_exec.py [--policy runs/bench_plan_reader/exec_all_s0/best/model]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import machine, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="runs/bench_plan_reader/exec_all_s0/best/model")
    ap.add_argument("--states", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from perceptrl.sim.composite import COMPOSITES
    from perceptrl.vla.executors import load_executor
    from perceptrl.vla.plan_env import PlanEnv, PlanSettings

    executor = load_executor("policy", {"all": args.policy})
    tasks = sorted(COMPOSITES)
    samples = [{"id": f"s{i}", "meta": {"scene": {"task": tasks[i % len(tasks)],
                "task_id": 900 + i, "trial_id": 0}}} for i in range(args.states)]  # fmt: skip
    settings = PlanSettings(executor, memo=0)
    sims: dict = {}  # kept across repeats, as a run keeps them across its rollouts
    seconds: dict[str, list[float]] = {"one_by_one": [], "side_by_side": []}
    answers: dict[str, list] = {}
    steps = 0
    for _ in range(args.repeats):
        for mode in seconds:
            env = PlanEnv(settings, sims=sims)
            env.reset(samples)
            texts = []
            for row in range(len(samples)):
                e = env.scene(row)
                texts.append(f"<subgoal>{e.task.subgoals[0].text(e.layout.colours)}</subgoal>")
            t = time.perf_counter()
            if mode == "side_by_side":
                env.prepare(list(range(len(samples))), texts)
            got = [env.respond(row, text) for row, text in enumerate(texts)]
            seconds[mode].append(time.perf_counter() - t)
            answers[mode] = [(o.text, o.info["planner/progress"]) for o in got]
            steps = sum(o.info["planner/env_steps"] for o in got)
            images = [np.asarray(o.images[0]) for o in got]
            if mode == "one_by_one":
                first = images
            else:
                assert all((a == b).all() for a, b in zip(first, images)), "images differ"
    assert answers["one_by_one"] == answers["side_by_side"], "outcomes differ"
    best = {m: min(v) for m, v in seconds.items()}
    cpu = machine(note="2 CPU cores")
    data = {"machine": cpu, "states": args.states, "repeats": args.repeats, "policy": args.policy,
            "executor_env_steps": steps, "seconds": seconds, "best_s": best,
            "speedup": best["one_by_one"] / best["side_by_side"],
            "same_outcomes": True,
            "finished": sum("did:" in a[0] for a in answers["side_by_side"])}  # fmt: skip
    md = "\n".join([
        "# Executing a round of planner turns: one by one against side by side",
        "",
        f"{cpu['cpu']} ({cpu['cores']} cores), one process. {args.states} rows (the first "
        f"oracle subgoal of {args.states} initial states of {', '.join(tasks)}), the "
        f"instruction-reading executor ({args.policy}), no memo; {steps} executor env steps "
        f"per round. Best of {args.repeats} alternating repeats.",
        "",
        "| mode | seconds per round |",
        "|---|---|",
        f"| one by one (`respond` alone) | {best['one_by_one']:.2f} |",
        f"| side by side (`prepare`, then `respond`) | {best['side_by_side']:.2f} |",
        "",
        f"Speed-up {data['speedup']:.2f}x; outcomes identical (texts, progress, images); "
        f"{data['finished']} of {args.states} subgoals finished.",
    ])  # fmt: skip
    seeds = {"task_ids": [900, 899 + args.states]}  # first and last; trial 0, no sampling
    js, mdp = write_results("plan_exec", data, md, seeds=seeds)
    print(md)
    print(f"\nwrote {js} and {mdp}")


if __name__ == "__main__":
    main()
