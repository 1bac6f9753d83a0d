"""Why GRPO collapsed with trained executors, probed on validation states: GRPO recipes from the
same SFT planner, each for a few minutes, scored greedily on the generator's val split (never the
test states bench_plan.py reports).

With the policy executors GRPO drove the planner to one subgoal then ``<done/>``
(bench/results/plan_policy.md). The probe varies what could reward stopping early: the validity
and per-subgoal cost terms, and the sampling temperature.

Usage (after ``bench_plan.py --executor policy --out runs/bench_plan_policy``):
    python bench/probe_plan_grpo.py --runs runs/bench_plan_policy [--minutes 5] [--n-val 60]
    python bench/probe_plan_grpo.py --split test --variants outcome_only --minutes 10
    python bench/probe_plan_grpo.py --executor reader --runs runs/bench_plan_reader \
        --variants recipe lr_1e-4 lr_1e-4_outcome_only turns --minutes 6 [--reuse]
    python bench/probe_plan_grpo.py --executor reader --runs runs/bench_plan_reader \
        --split test --variants turns --minutes 30 --curve 280
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_plan import score
from common import last_model, logged_seconds, machine, metrics, run_arm, write_results

SHOWN = ("accuracy", "planner/subgoals", "planner/progress")
"""the scores kept per arm (0 where absent: a planner that writes no subgoal records none)"""
VARIANTS = {
    "recipe": [],
    "outcome_only": ["rollout.reward.plan_validity=0.0", "rollout.reward.subgoal_cost=0.0"],
    "temperature_0.7": ["rollout.temperature=0.7"],
    "lr_1e-4": ["train.lr=1.0e-4"],
    "lr_1e-4_outcome_only": [
        "train.lr=1.0e-4",
        "rollout.reward.plan_validity=0.0",
        "rollout.reward.subgoal_cost=0.0",
    ],  # fmt: skip
    "turns": [
        "algo.adv_estimator=prime",
        "rollout.process_reward=plan_turns",
        "rollout.reward.plan_progress=0.0",
        "rollout.reward.plan_validity=0.0",
        "rollout.reward.subgoal_cost=0.0",
    ],  # fmt: skip
}
"""probe arm -> overrides of configs/plan_grpo.yaml"""
VARIANTS["turns_epochs_2"] = [*VARIANTS["turns"], "train.ppo_epochs=2"]
VARIANTS["turns_lr_1e-4"] = [*VARIANTS["turns"], "train.lr=1.0e-4"]
VARIANTS["turns_early_done"] = [*VARIANTS["turns"], "rollout.process_params.early_done=-0.5"]
VARIANTS["turns_match"] = [*VARIANTS["turns"], "rollout.process_params.match=0.5"]
VARIANTS["turns_match_1"] = [*VARIANTS["turns"], "rollout.process_params.match=1.0"]
VARIANTS["turns_t_0.7"] = [*VARIANTS["turns"], "rollout.temperature=0.7"]
VARIANTS["turns_match_1_t_0.7"] = [*VARIANTS["turns_match_1"], "rollout.temperature=0.7"]
STOP = "rollout.episode.stop=[</subgoal>, <done/>]"
"""turns end at the planner's closing tags"""
GROUPS_OF_8 = ["rollout.group_size=8", "rollout.prompts_per_step=2"]
"""8 episodes from each of 2 states per step (the recipe: 4 from 4)"""
VARIANTS["turns_stop"] = [*VARIANTS["turns"], STOP]
VARIANTS["tree"] = [
    "algo.adv_estimator=treepo",
    "rollout.tree.branches=[2, 2, 2]",
    *GROUPS_OF_8,
    *VARIANTS["outcome_only"],
]
"""episodes that fork after turns 1 and 2 (a later subgoal compared between siblings that share
the turns before it), TreePO advantages on success and progress"""
VARIANTS["tree_stop"] = [*VARIANTS["tree"], STOP]
VARIANTS["turns_rerun"] = VARIANTS["turns"]
"""the same recipe run again (seeded: how much the steps a run gets in its minutes move it)"""
VARIANTS["turns_stop_t_1.3"] = [*VARIANTS["turns_stop"], "rollout.temperature=1.3"]
"""sampling hotter, so that a confidently wrong copy of a clause meets its alternatives"""
VARIANTS["turns_seed_1"] = [*VARIANTS["turns"], "train.seed=1"]
"""the per-turn recipe with another training seed: the spread between seeds of one arm"""
VARIANTS["turns_seed_2"] = [*VARIANTS["turns"], "train.seed=2"]
VARIANTS["turns_stop_seed_1"] = [*VARIANTS["turns_stop"], "train.seed=1"]
VARIANTS["turns_group_8"] = [*VARIANTS["turns"], *GROUPS_OF_8]
VARIANTS["turns_guide"] = [*VARIANTS["turns"], "rollout.guide=1"]
"""off-policy guidance: one member of each group is the oracle plan, executed by the trained
executor (LUFFY's mixed groups; it scores and counts like the samples)"""
VARIANTS["turns_guide_seed_1"] = [*VARIANTS["turns_guide"], "train.seed=1"]
VARIANTS["turns_guide_lr_2e-4"] = [*VARIANTS["turns_guide"], "train.lr=2.0e-4"]
"""guide rows at a learning rate nearer SFT's (3e-4): at 5e-5 they move the planner little"""
VARIANTS["turns_guide_lr_2e-4_seed_1"] = [*VARIANTS["turns_guide_lr_2e-4"], "train.seed=1"]
VARIANTS["turns_t_2_top_p_0.9"] = [
    *VARIANTS["turns"],
    "rollout.temperature=2.0",
    "rollout.top_p=0.9",
]
"""sampling far hotter, the tail cut: a confident wrong copy (0.08 nats a token at 1.0) meets
its alternatives while the tokens around it stay"""
VARIANTS["turns_oracle_exec"] = [*VARIANTS["turns"], "plan.executor=oracle"]
"""a diagnosis, not a recipe: trained against the scripted oracle executor, scored with the
trained one like every arm (is it the executor's failures in training that hold RL back?)"""
VARIANTS["recipe_oracle_exec"] = ["plan.executor=oracle"]
"""the same with the GRPO recipe, which met the goal with the oracle executor
(bench/results/plan.md)"""


TRAINING = {"zero_std": "rollout/zero_std_groups", "entropy": "actor/entropy"}
"""means over an arm's training steps: the share of groups whose episodes all scored alike (no
signal), and the planner's sampling entropy per token"""


def training_means(run: Path) -> dict[str, float]:
    """`TRAINING`'s means over the steps of the run at ``run``."""
    rows = [r for r in metrics(run) if "time/step" in r]
    return {
        k: sum(r.get(key, 0.0) for r in rows) / max(len(rows), 1) for k, key in TRAINING.items()
    }


def kept_arms(name: str, split: str, n_states: int, minutes: float, rerun: list[str]) -> dict:
    """The arms of the result file ``name`` that this call does not rerun, when it was made on
    the same states with the same budget (so that probing a few variants adds rows to the
    table instead of replacing it); the SFT row is always rescored."""
    path = Path(__file__).parent / "results" / f"{name}.json"
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    if (old.get("split"), old.get("n_states"), old.get("minutes")) != (split, n_states, minutes):
        return {}
    return {k: v for k, v in old["arms"].items() if k not in rerun and not k.endswith(" (start)")}


def curve(run: Path, states: list[dict], executor_args: list[str], split: str,
          last: dict) -> list[dict]:  # fmt: skip
    """Success of each checkpoint a run kept on ``states`` (``last``: its last one's scores,
    already taken), with the seconds its steps had taken by then."""
    rows = [r for r in metrics(run) if "time/step" in r]
    out = []
    models = sorted((run / "checkpoints").glob("step_*"))
    for ckpt in models:
        step = int(ckpt.name[5:])
        scores = last if ckpt == models[-1] else score(
            ckpt / "model", states, run / f"{split}_eval_{step}", executor_args)[0]  # fmt: skip
        seconds = sum(r["time/step"] for r in rows if r["step"] <= step)
        out.append({"step": step, "seconds": seconds, **{k: scores.get(k, 0.0) for k in SHOWN}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs/bench_plan_policy")
    ap.add_argument("--executor", choices=("policy", "reader"), default="policy",
                    help="the bench_plan.py run under --runs (its result file's executor)")  # fmt: skip
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--n-val", type=int, default=60)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--split", choices=("val", "test"), default="val",
                    help="test: the chosen variant on bench_plan.py's held-out test states")  # fmt: skip
    ap.add_argument("--curve", type=int, default=0,
                    help="keep a checkpoint every this many steps and score each on the same "
                    "states (a learning curve); 0: the last only")  # fmt: skip
    ap.add_argument("--start", default="sft",
                    help="the arm under --runs the variants start from (sft_more: the "
                    "equal-time SFT control); its own result file unless sft")  # fmt: skip
    ap.add_argument("--reuse", action="store_true",
                    help="score the arms already trained under --runs instead of training them")  # fmt: skip
    args = ap.parse_args()

    from perceptrl.datasets.loader import load_samples
    from perceptrl.datasets.plan import generate

    runs = Path(args.runs)
    settings = json.loads(
        (Path(__file__).parent / "results" / f"plan_{args.executor}.json").read_text()
    )
    executor_args = settings["settings"]["executor_args"]
    if args.split == "val":
        generate(runs / "val_data", splits={"val": args.n_val}, seed=0)
        val = load_samples(runs / "val_data" / "val.jsonl")[0]
    else:  # the states bench_plan.py scores its arms on
        val = load_samples(runs / "eval_data" / "test.jsonl")[0]
    tag = ("" if args.executor == "policy" else f"_{args.executor}") + (
        "" if args.split == "val" else "_test"
    )
    tag += "" if args.start == "sft" else f"_from_{args.start}"
    start = last_model(runs / args.start)
    common = ["train.seed=0", "log.progress=false", "train.eval_every=0", "train.eval_samples=0",
              f"data.train={(runs / 'data' / 'train.jsonl').resolve()}", "data.val=",
              *executor_args]  # fmt: skip
    checkpoints = ([f"checkpoint.every={args.curve}", "checkpoint.keep_last=0"] if args.curve
                   else ["checkpoint.every=0"])  # fmt: skip
    rows = kept_arms(f"plan_grpo_probe{tag}", args.split, len(val), args.minutes, args.variants)
    for name in args.variants:
        out = runs / f"probe_{name}{'' if args.split == 'val' else '_test'}"
        out = out if args.start == "sft" else out.with_name(f"{out.name}_from_{args.start}")
        if args.reuse and (out / "checkpoints").exists():
            wall = logged_seconds(out)
        else:
            wall = run_arm(["train", "plan_grpo", "train.steps=100000", *common,
                            f"train.time_limit_min={args.minutes}", f"model.path={start}",
                            *checkpoints, *VARIANTS[name]], out)  # fmt: skip
        model = last_model(out)
        scores, _, _ = score(model, val, out / f"{args.split}_eval", executor_args)
        rows[name] = {"overrides": VARIANTS[name], "wall_s": wall,
                      "steps": int(model.parent.name[5:]), **{k: scores.get(k, 0.0) for k in SHOWN},
                      **training_means(out)}  # fmt: skip
        if args.curve:
            rows[name]["curve"] = curve(out, val, executor_args, args.split, scores)
    start_scores, _, _ = score(start, val, runs / f"probe_{args.start}_{args.split}", executor_args)
    rows[f"{args.start} (start)"] = {"overrides": [], "wall_s": 0.0, "steps": 0,
                                     **{k: start_scores[k] for k in SHOWN}}  # fmt: skip
    cpu = machine(note="2 CPU cores")
    data = {"machine": cpu, "split": args.split, "n_states": len(val), "minutes": args.minutes,
            "executor_args": executor_args, "arms": rows}  # fmt: skip
    lines = [
        f"# GRPO recipes with trained executors, on {args.split} states",
        "",
        f"{cpu['cpu']} ({cpu['cores']} cores). Each arm: GRPO "
        f"from the same SFT planner ({args.start}) for {args.minutes} min; greedy episodes on "
        f"{len(val)} "
        + (
            "states of the val split (not the test states)."
            if args.split == "val"
            else "held-out test states (bench_plan.py's), for the variant chosen on validation."
        ),
        "",
        "Groups alike: the share of training groups whose episodes all scored the same (no "
        "signal); entropy: the planner's sampling entropy per token (nats); both means over the "
        "arm's steps (rows without them were scored before they were kept).",
        "",
        "| arm | overrides | steps | success | subgoals / episode | progress | groups alike "
        "| entropy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        train = " | ".join(f"{r[k]:.3f}" if k in r else "-" for k in TRAINING)
        lines.append(f"| {name} | {' '.join(r['overrides']) or '-'} | {r['steps']} | "
                     f"{r['accuracy']:.3f} | {r['planner/subgoals']:.2f} | "
                     f"{r['planner/progress']:.3f} | {train} |")  # fmt: skip
    for name, r in rows.items():
        if r.get("curve"):
            lines += ["", f"Learning curve of {name} (every kept checkpoint, the same states): "
                      + "; ".join(f"step {c['step']} ({c['seconds'] / 60:.1f} min) "
                                  f"{c['accuracy']:.3f}" for c in r["curve"]) + "."]  # fmt: skip
    js, md = write_results(f"plan_grpo_probe{tag}", data, "\n".join(lines))
    print("\n".join(lines))
    print(f"\nwrote {js} and {md}")


if __name__ == "__main__":
    main()
