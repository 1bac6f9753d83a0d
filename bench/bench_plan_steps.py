"""The oracle plan with the instruction-reading executor under longer time limits per subgoal,
on bench_plan.py's held-out states: does the executor fail for lack of time?

With the reader executor (``bench_plan.py --executor reader``) the oracle plan finishes only
about 30% of its put subgoals within the primitive's time limit, yet completes 0.72 of the
tasks. This runs the same plan with ``plan.subgoal_steps`` at the primitive's limit (0) and
longer, and reports the task success and the subgoals finished per family at each.

Usage (after ``bench_plan.py --executor reader --out runs/bench_plan_reader``):
    python bench/bench_plan_steps.py [--runs runs/bench_plan_reader] [--steps 0 200 300]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench_plan import RESULTS, oracle
from common import machine, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs/bench_plan_reader")
    ap.add_argument("--steps", nargs="+", type=int, default=[0, 200, 300],
                    help="env steps per subgoal (0: the primitive task's time limit)")  # fmt: skip
    args = ap.parse_args()

    from perceptrl.datasets.loader import load_samples

    test = load_samples(Path(args.runs) / "eval_data" / "test.jsonl")[0]
    executor_args = json.loads((RESULTS / "plan_reader.json").read_text())["settings"][
        "executor_args"
    ]
    rows = {}
    for steps in args.steps:
        t0 = time.perf_counter()
        scores, families, _ = oracle(test, [*executor_args, f"plan.subgoal_steps={steps}"])
        rows[str(steps)] = {"success": scores["accuracy"], "subgoals": families,
                            "wall_s": time.perf_counter() - t0}  # fmt: skip
    data = {"machine": machine(note="2 CPU cores"), "n_test": len(test),
            "executor_args": executor_args, "rows": rows}  # fmt: skip
    fams = sorted({f for r in rows.values() for f in r["subgoals"]})
    lines = [
        "# The oracle plan with the reader executor: time limits per subgoal",
        "",
        f"{data['machine']['cpu']} ({data['machine']['cores']} cores). The generator's plan on "
        f"bench_plan.py's {len(test)} held-out states, executed by the instruction-reading "
        "executor of bench/results/plan_reader.json; subgoals finished within the limit / tried.",
        "",
        "| env steps per subgoal | task success | " + " | ".join(fams) + " | wall |",
        "|---" * (3 + len(fams)) + "|",
    ]
    for steps, r in rows.items():
        done = " | ".join("{}/{}".format(*r["subgoals"][f]) for f in fams)
        limit = "primitive's limit (120)" if steps == "0" else steps
        lines.append(f"| {limit} | {r['success']:.2f} | {done} | {r['wall_s'] / 60:.1f} min |")
    js, md = write_results("plan_subgoal_steps", data, "\n".join(lines))
    print("\n".join(lines))
    print(f"\nwrote {js} and {md}")


if __name__ == "__main__":
    main()
