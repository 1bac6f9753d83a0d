"""Does GRPO on the simulator's rewards make a better reason-then-act planner than SFT?

Reason, then act: a VLM planner trained by what its executor achieves in MuJoCo (issue 17).

Task: the long-horizon composites of ``sim/composite.py`` (put_two, put_then_stack,
push_then_put, put_three; 2-3 subgoals each), samples from ``datasets/plan_tasks.py``. The planner is
the planner base (assets/vlm_plan_base: the shipped tiny VLM after a text-only drill on planner
dialogues, assets/build/make_plan_base.py) under ``configs/plan_grpo.yaml``; the executor is the
scripted oracle (``plan.executor=oracle``), or with ``--executor policy`` frozen VLAs trained
by this run (``configs/plan_exec_bc.yaml``: behaviour cloning of each primitive's scripted expert
from entity poses, ``--exec-steps`` steps per family; the planner arms then train and score with
them), or with ``--executor reader`` one frozen VLA for every family that reads its instruction
(``configs/plan_exec_reader.yaml``: cloned on single subgoals of long-horizon scenes, it finds the
entities the words name among all of the scene's), which can also be given the whole long
instruction with no planner. Arms, each in its own process:

* base: the planner base as it is (it has read dialogues, never an image);
* sft: the warm start on the oracle plans (``--sft-steps``), every trace's subgoals executed;
* grpo: RL from the sft checkpoint for ``--grpo-minutes`` with the simulator's rewards (the
  recipe's GRPO, or what ``--grpo-args`` makes of it: the reader result used per-turn rewards);
* sft_more (``--sft-control``, on by default): the equal-time control, SFT continued from the
  sft checkpoint for ``--grpo-minutes`` on the same traces;
* exec_<family>_s<seed> (``--executor policy``): the executors, one run per ``--exec-seeds``
  seed; the planner arms use each family's run with the best success on its own primitive task
  (the evaluation on the primitive's evaluation seeds, none of the held-out composite states;
  the run's best evaluation where it kept one, ``checkpoint.best``, else its last): BC of a
  placing expert is seed-sensitive at this size. With ``--executor reader`` one run per seed,
  ``exec_all_s<seed>``, chosen by its success on single subgoals of its training scenes'
  evaluation seeds;
* alone (``--executor reader``): no planner, the executor given the task's long instruction for
  as many env steps as the oracle plan's subgoals get together (`plan_eval.executor_alone`).

Scored greedily on held-out initial states (the generator's test split: task ids no training
or validation sample uses, trial seed ``1000 + --seed``): the share of episodes that complete
the task (``planner/success``), progress, valid subgoals, turns; and the oracle plan with the
same executor on the same states (the upper bound of planning), with the executor's success per
subgoal family on that plan, so that planning and execution errors can be told apart.

    python bench/bench_plan.py [--sft-steps 100] [--grpo-minutes 10] [--n-test 100]
    python bench/bench_plan.py --executor policy [--exec-steps 1000] [--exec-seeds 0 1 2]
    python bench/bench_plan.py --executor reader --exec-steps 3000 --exec-seeds 0 \
        --grpo-args algo.adv_estimator=prime rollout.process_reward=plan_turns \
        rollout.reward.plan_progress=0.0 rollout.reward.plan_validity=0.0 \
        rollout.reward.subgoal_cost=0.0

Writes bench/results/plan.{json,md,png} and plan_episode.png (a key-frame strip of the best
planner arm's first completed held-out episode); plan_policy.* with ``--executor policy``,
plan_reader.* with ``--executor reader``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from common import RESULTS, ROOT, arm_runner, machine, metrics, run_timed, write_results

EXEC_ENVS = {"put": "perceptrl/Put-v0", "stack": "perceptrl/Stack-v0", "push": "perceptrl/Push-v0"}
"""primitive family -> the env its executor is cloned on"""
EXEC_RECIPES = {
    "policy": {f: ("plan_exec_bc", env) for f, env in EXEC_ENVS.items()},
    "reader": {"all": ("plan_exec_reader", "perceptrl/Skills-v0")},
}
"""--executor -> {plan.policies key: (recipe, env it is cloned on)}"""
SFT_ARGS = ["train.lr=3.0e-4", "rollout.prompts_per_step=8"]
GOALS = {"grpo_minus_sft": 0.20, "grpo_minus_alone": 0.30}
"""the issue's goals (the second where the executor alone was run: ``--executor reader``)"""
KEYS = ("planner/success", "planner/progress", "planner/valid", "planner/invalid",
        "planner/on_plan", "planner/subgoals", "planner/executed", "episode/turns_mean")  # fmt: skip


def score(model: Path, samples: list[dict], out: Path, extra: list[str]) -> tuple[dict, dict, dict]:
    """Greedy planner episodes on ``samples``: (success per task and the episode means, success
    per sample id, episode record per sample id)."""
    from perceptrl.cli import CONFIGS
    from perceptrl.wiring import load_config, side

    cfg = load_config(
        CONFIGS / "plan_grpo.yaml",
        [f"model.path={model}", f"train.eval_samples={len(samples)}", *extra],
    )
    side(cfg)  # registers the planner's environment
    from perceptrl.vlm.builder import build_evaluator, build_policy
    from perceptrl.vlm.run_plan import resolve

    plan = resolve(cfg)
    policy = build_policy(plan, out)
    per_sample: dict[str, float] = {}
    records: dict[str, dict] = {}
    metrics = build_evaluator(plan.evaluation, samples)(policy, scores=per_sample, records=records)
    return metrics, per_sample, records


def oracle(samples: list[dict], extra: list[str], retries: int = 0) -> tuple[dict, dict, dict]:
    """The oracle plan (the generator's traces; ``retries``: a subgoal not finished is issued
    again up to that many times) with the recipe's executor on ``samples``: its success per task,
    the executor's per subgoal family ({family: [finished, tried]}), and its success per sample
    id."""
    from perceptrl.cli import CONFIGS
    from perceptrl.vla.plan_env import plan_settings
    from perceptrl.vla.plan_eval import oracle_plan
    from perceptrl.vla.run_plan import resolve_executor
    from perceptrl.wiring import load_config

    settings = plan_settings(resolve_executor(load_config(CONFIGS / "plan_grpo.yaml", extra)))
    scores, records = oracle_plan(settings, samples, retries)
    families = [k.split("/", 1)[1] for k in scores if k.startswith("executor/")]
    tallies = {f: [round(scores[f"executor/{f}"] * scores[f"count/executor/{f}"]),
                   int(scores[f"count/executor/{f}"])] for f in families}  # fmt: skip
    per_sample = {k: float(r["info"]["planner/success"]) for k, r in records.items()}
    return scores, tallies, per_sample


def reader_start(out: Path, seed: int, wall: dict, executor: str) -> list[str]:
    """``--executor reader``: the overrides that start its BC from the drilled reader
    (``assets/build/make_reader_base.py``, run into ``out/reader_base_s<seed>`` unless it is
    there; its seconds go into ``wall``); nothing for the other executors."""
    if executor != "reader":
        return []
    base = out / f"reader_base_s{seed}"
    if not (base / "drill.json").exists():
        run_timed([sys.executable, str(ROOT / "assets" / "build" / "make_reader_base.py"),
                   "--out", str(base), "--seed", str(seed)])  # fmt: skip
    drill = json.loads((base / "drill.json").read_text())
    wall[base.name] = sum(drill["seconds"].values())
    return [f"model.path={base}"]


def alone(samples: list[dict], extra: list[str]) -> tuple[dict, dict]:
    """The recipe's executor given each sample's long instruction with no planner: its success
    per task (and progress) and its success per sample id."""
    from perceptrl.cli import CONFIGS
    from perceptrl.vla.plan_env import plan_settings
    from perceptrl.vla.plan_eval import executor_alone
    from perceptrl.vla.run_plan import resolve_executor
    from perceptrl.wiring import load_config

    settings = plan_settings(resolve_executor(load_config(CONFIGS / "plan_grpo.yaml", extra)))
    scores, records = executor_alone(settings, samples)
    scores["planner/progress"] = scores["progress"]
    return scores, {k: r["info"]["success"] for k, r in records.items()}


def episode_strip(samples: list[dict], records: dict, extra: list[str], out: Path) -> dict:
    """A PNG strip (and mp4 under ``out``) of a planner's first held-out episode that completed
    its task (the first episode when none did), replayed from its turns with the executor."""
    from perceptrl.cli import CONFIGS
    from perceptrl.vla.plan_env import plan_settings, replay_video
    from perceptrl.vla.run_plan import resolve_executor
    from perceptrl.wiring import load_config

    done = [s for s in samples if (records.get(str(s["id"])) or {}).get("info", {})
            .get("planner/success")]  # fmt: skip
    sample = (done or samples)[0]
    settings = plan_settings(resolve_executor(load_config(CONFIGS / "plan_grpo.yaml", extra)))
    texts = records[str(sample["id"])]["texts"]
    out.mkdir(parents=True, exist_ok=True)
    png = out / "episode.png"
    record = replay_video(settings, sample, texts, out / "episode.mp4", sheet=png)
    return {"id": str(sample["id"]), "task": sample.get("family"), "turns": texts,
            "success": record["planner/success"], "first_success": bool(done), "png": png}  # fmt: skip


def own_success(run_dir: Path) -> float | None:
    """An executor's success on its own primitive task: its best evaluation's where the run
    kept one (``checkpoint.best``), else its last evaluation's."""
    from perceptrl.trainer.checkpoint import best_record

    best = best_record(run_dir)
    if best is not None:
        return best["value"]
    rows = [r for r in metrics(run_dir) if "eval/success_rate" in r]
    return rows[-1]["eval/success_rate"] if rows else None


def executor_model(run_dir: Path, last: Path) -> Path:
    """The weights an executor run offers: its best evaluation's, else its last checkpoint's."""
    best = run_dir / "best" / "model"
    return best if best.is_dir() else last


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=100)
    ap.add_argument("--grpo-minutes", type=float, default=10.0)
    ap.add_argument("--n-train", type=int, default=400)
    ap.add_argument("--n-test", type=int, default=100)
    ap.add_argument("--base", default="assets/vlm_plan_base")
    ap.add_argument("--out", default="runs/bench_plan")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--executor", choices=("oracle", "policy", "reader"), default="oracle")
    ap.add_argument("--exec-steps", type=int, default=1000, help="BC steps per executor")
    ap.add_argument(
        "--exec-seeds",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="train each executor with these seeds and keep the best on its own task",
    )
    ap.add_argument("--executor-args", nargs="*", default=[], help="more plan.* overrides")
    ap.add_argument("--grpo-args", nargs="*", default=[], help="overrides of the GRPO arm")
    ap.add_argument(
        "--sft-control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="an arm that continues SFT from the sft checkpoint for GRPO's minutes",
    )
    ap.add_argument("--reuse", action="store_true", help="rescore the arms already under --out")
    ap.add_argument(
        "--sft-model",
        default="",
        help="start GRPO from this SFT model instead of "
        "training the sft arm (say how it was trained with --sft-note)",
    )
    ap.add_argument("--sft-note", default="")
    return ap.parse_args()


def train_executors(args, out: Path, arm, wall: dict) -> tuple[dict, dict, dict]:
    """The executors of ``--executor`` (none for the oracle): each family's runs, one per
    ``--exec-seeds`` seed. Returns (family -> the chosen run's model, family -> {seed: its
    own-task success}, family -> the chosen seed)."""
    executors: dict[str, Path] = {}
    candidates: dict[str, dict[int, float | None]] = {}  # family: {seed: own-task success}
    chosen: dict[str, int] = {}
    for family, (recipe, env_id) in EXEC_RECIPES.get(args.executor, {}).items():
        models = {seed: executor_model(out / f"exec_{family}_s{seed}", arm(
                f"exec_{family}_s{seed}", ["sft", recipe, f"env.id={env_id}",
                f"train.steps={args.exec_steps}", f"train.seed={seed}", "log.progress=false",
                *reader_start(out, seed, wall, args.executor)]))
                for seed in args.exec_seeds}  # fmt: skip
        candidates[family] = {s: own_success(out / f"exec_{family}_s{s}") for s in models}
        chosen[family] = max(models, key=lambda s: candidates[family][s] or 0.0)
        executors[family] = models[chosen[family]]
    return executors, candidates, chosen


def planner_arms(args, base: Path, common: list[str], arm) -> dict[str, Path]:
    """The planner arms' models: base, sft (or ``--sft-model``), grpo and, with
    ``--sft-control``, sft_more."""
    from perceptrl.trainer.runtime import resolve_path

    if args.sft_model:
        sft = resolve_path(args.sft_model)
    else:
        sft = arm("sft", ["sft", "plan_grpo", f"train.steps={args.sft_steps}", *common,
                          *SFT_ARGS, f"model.path={base}", "checkpoint.every=0"])  # fmt: skip
    grpo = arm("grpo", ["train", "plan_grpo", "train.steps=100000", *common,
                        f"train.time_limit_min={args.grpo_minutes}", f"model.path={sft}",
                        "checkpoint.every=0", *args.grpo_args])  # fmt: skip
    arms = {"base": base, "sft": sft, "grpo": grpo}
    if args.sft_control:
        arms["sft_more"] = arm("sft_more", [
            "sft", "plan_grpo", "train.steps=100000", *common, *SFT_ARGS,
            f"train.time_limit_min={args.grpo_minutes}", f"model.path={sft}",
            "checkpoint.every=0"])  # fmt: skip
    return arms


def executor_rows(per_family: dict, candidates: dict, chosen: dict) -> dict:
    """The executor per subgoal family: on the oracle plan's subgoals, and (trained executors)
    on its own primitive task per seed."""
    rows = {}
    for f, (ok, tried) in sorted(per_family.items()):
        row: dict = {"in_composites": ok / tried, "subgoals": tried}
        trained = f if f in candidates else "all"  # the reader is one run for every family
        if trained in candidates:
            row.update(seed=chosen[trained], own_task=candidates[trained][chosen[trained]],
                       own_task_per_seed={str(s): v for s, v in candidates[trained].items()})  # fmt: skip
        rows[f] = row
    return rows


def write_report(args, name: str, data: dict, results: dict, test: list, records: dict,
                 executor_args: list[str], out: Path) -> None:  # fmt: skip
    """The episode picture of the best planner arm, the chart and the result files."""
    from perceptrl.vla.plan_eval import bar_chart

    shown = max(
        ("grpo", "sft", "sft_more"), key=lambda a: results[a]["accuracy"] if a in results else -1
    )
    # the README's picture of the loop: the best planner arm's first completed episode
    strip = episode_strip(test, records[shown], executor_args, out / "episode")
    strip["planner"] = shown
    shutil.copy(strip.pop("png"), RESULTS / f"{name}_episode.png")
    data["episode_picture"] = strip
    tasks = [t for t in data["success"]["oracle_plan"] if t != "all"]
    bar_chart(results, tasks, RESULTS / f"{name}.png",
              title=f"held-out task success ({len(test)} states)")  # fmt: skip
    seeds = {"planner": [args.seed]}  # training; the data's are seed and 1000 + seed
    if args.executor != "oracle":
        seeds["executors"] = args.exec_seeds
    js, mdp = write_results(name, data, markdown(data), seeds=seeds)
    print(markdown(data))
    print(f"\nwrote {js}, {mdp}, {name}.png and {name}_episode.png")


def main() -> None:
    args = parse_args()
    from perceptrl.datasets.loader import load_samples
    from perceptrl.datasets.plan_tasks import generate
    from perceptrl.trainer.runtime import resolve_path
    from perceptrl.vlm.report import paired_gain

    out, base = Path(args.out), resolve_path(args.base)
    name = "plan" if args.executor == "oracle" else f"plan_{args.executor}"
    result = RESULTS / f"{name}.json"
    previous = json.loads(result.read_text()) if args.reuse and result.exists() else {}
    train, test_path = out / "data" / "train.jsonl", out / "eval_data" / "test.jsonl"
    if not (args.reuse and train.exists() and test_path.exists()):
        generate(out / "data", splits={"train": args.n_train}, seed=args.seed)
        generate(out / "eval_data", splits={"test": args.n_test}, seed=1000 + args.seed)
    test = load_samples(test_path)[0]
    wall: dict[str, float] = {}
    arm = arm_runner(out, args.reuse, previous, wall)
    executors, candidates, chosen = train_executors(args, out, arm, wall)
    kind = "oracle" if args.executor == "oracle" else "policy"
    executor_args = [f"plan.executor={kind}", *args.executor_args]
    executor_args += [f"plan.policies.{f}={p}" for f, p in executors.items()]
    common = [f"train.seed={args.seed}", "log.progress=false", "train.eval_every=0",
              "train.eval_samples=0", f"data.train={train.resolve()}", "data.val=",
              *executor_args]  # fmt: skip
    arms = planner_arms(args, base, common, arm)
    results, per_sample, records = {}, {}, {}
    for a, p in arms.items():
        results[a], per_sample[a], records[a] = score(p, test, out / "eval" / a, executor_args)
    results["oracle_plan"], per_family, per_sample["oracle_plan"] = oracle(test, executor_args)
    if args.executor == "reader":
        t0 = time.perf_counter()
        results["alone"], per_sample["alone"] = alone(test, executor_args)
        wall["alone"] = time.perf_counter() - t0
    data = report_data(args, results, wall, out, len(test))
    pairs = (("sft", "grpo"), ("sft_more", "grpo"), ("sft", "sft_more"), ("alone", "grpo"),
             ("alone", "sft"), ("alone", "oracle_plan"))  # fmt: skip
    data["paired"] = {
        f"{b}_minus_{a}": paired_gain(per_sample[a], per_sample[b])
        for a, b in pairs
        if a in per_sample and b in per_sample
    }
    data["settings"].update(executor=args.executor, exec_steps=args.exec_steps,
                            exec_seeds=args.exec_seeds, executor_args=executor_args)  # fmt: skip
    data["executor"] = executor_rows(per_family, candidates, chosen)
    write_report(args, name, data, results, test, records, executor_args, out)


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


def success_table(results: dict, reference: str = "oracle_plan") -> dict:
    """{arm: {"all": success, <task>: success}} of evaluator scores, tasks as ``reference``'s."""
    tasks = sorted(k.split("/", 1)[1] for k in results[reference] if k.startswith("accuracy/"))
    return {
        a: {"all": r["accuracy"], **{t: r.get(f"accuracy/{t}") for t in tasks}}
        for a, r in results.items()
    }


def report_data(args, results: dict, wall: dict, out: Path, n_test: int) -> dict:
    success = success_table(results)
    gap = success["grpo"]["all"] - success["sft"]["all"]
    gaps = {
        "grpo_minus_sft": gap,
        "grpo_minus_alone": (
            success["grpo"]["all"] - success["alone"]["all"] if "alone" in success else None
        ),
    }
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
            "grpo_minus_sft_more": (
                success["grpo"]["all"] - success["sft_more"]["all"]
                if "sft_more" in success
                else None
            ),
            "oracle_minus_grpo": success["oracle_plan"]["all"] - success["grpo"]["all"],
            "grpo_minus_alone": gaps["grpo_minus_alone"],
        },
        "goals": {
            k: {"goal": v, "met": gaps[k] >= v} for k, v in GOALS.items() if gaps[k] is not None
        },
        "grpo": grpo_summary(metrics(out / "grpo")),
    }


def executor_text(s: dict) -> str:
    if s.get("executor") == "reader":
        return (f"one frozen state VLA for every subgoal family that reads its instruction "
                f"(configs/plan_exec_reader.yaml: its encoder drilled by "
                f"assets/build/make_reader_base.py, then {s['exec_steps']} BC steps; best of seeds "
                f"{s['exec_seeds']}), for both training and scoring; 'alone' is that executor "
                f"given the task's long instruction with no planner")  # fmt: skip
    if s.get("executor") == "policy":
        return (f"frozen state VLAs cloned from the scripted experts (configs/plan_exec_bc.yaml, "
                f"{s['exec_steps']} steps per family, best of seeds {s['exec_seeds']}), for both "
                f"training and scoring")  # fmt: skip
    return "plan.executor=oracle (the scripted experts)"


def markdown(d: dict) -> str:
    s, tasks = d["settings"], [t for t in d["success"]["oracle_plan"] if t != "all"]
    lines = [
        "# Reason, then act: planner success on held-out initial states",
        "",
        f"Machine: {d['machine']['cpu']} ({d['machine']['cores']} cores). Planner: tiny VLM "
        f"({s['base']}); executor: {executor_text(s)}. "
        f"SFT: {s['sft_model']}, then GRPO for {s['grpo_minutes']} min "
        f"({d['grpo']['steps']} steps, {d['grpo']['step_s'] or 0:.1f} s each"
        + (
            f"; overrides of configs/plan_grpo.yaml: {' '.join(s['grpo_args'])}"
            if s.get("grpo_args")
            else ""
        )  # fmt: skip
        + f"). Greedy episodes on "
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
    lines += ["", gaps_line(d), *paired_lines(d), *picture_lines(d), *executor_lines(d)]
    return "\n".join(lines) + "\n"


def gaps_line(d: dict) -> str:
    """The gaps between the arms against the goals, and the wall time."""
    g = d["gaps"]
    return (
        f"GRPO minus SFT: {g['grpo_minus_sft']:+.3f} (goal +{GOALS['grpo_minus_sft']:.2f}: "
        f"{'met' if d['goals']['grpo_minus_sft']['met'] else 'not met'}); oracle plan minus GRPO: "
        f"{g['oracle_minus_grpo']:+.3f}"
        + (
            f"; GRPO minus the equal-time SFT control (sft_more): {g['grpo_minus_sft_more']:+.3f}"
            if g.get("grpo_minus_sft_more") is not None
            else ""
        )
        + (
            f"; GRPO minus the executor alone on the long instruction: "
            f"{g['grpo_minus_alone']:+.3f} (goal +{GOALS['grpo_minus_alone']:.2f}: "
            f"{'met' if d['goals']['grpo_minus_alone']['met'] else 'not met'})"
            if g.get("grpo_minus_alone") is not None
            else ""
        )
        + ". Wall time: "
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in d["wall_s"].items())
        + "."
    )


def paired_lines(d: dict) -> list[str]:
    if not d.get("paired"):
        return []
    lines = ["", "Paired on the same held-out states (difference, standard error, states "
             "only the second arm / only the first completed):", ""]  # fmt: skip
    for k, g in d["paired"].items():
        lines.append(f"- {k}: {g['gain']:+.3f} ± {g['se']:.3f} (z {g['z']:.1f}; "
                     f"{int(g['improved'])} / {int(g['regressed'])})")  # fmt: skip
    return lines


def picture_lines(d: dict) -> list[str]:
    if not d.get("episode_picture"):
        return []
    e = d["episode_picture"]
    which = "first held-out episode that completed the task" if e["first_success"] else (
        "first held-out episode (none completed the task)")  # fmt: skip
    return ["", f"The {e.get('planner', 'grpo')} planner's (the best arm's) {which} "
            f"({e['task']}, `{e['id']}`): the picture beside this file (`*_episode.png`); "
            "the chart of the table above: `*.png`."]  # fmt: skip


def executor_lines(d: dict) -> list[str]:
    if not d.get("executor"):
        return []
    lines = [
        "",
        "The executor on the oracle plan's subgoals (finished / tried, composite scenes), and "
        "on its own primitive task (its training run's kept evaluation, per BC seed; the "
        "planner arms use the best seed's run, chosen by that evaluation):",
        "",
        "| subgoal family | in composites | subgoals | seed used | own task, per seed |",
        "|---|---|---|---|---|",
    ]
    for f, e in d["executor"].items():
        per_seed = ", ".join(
            f"s{k}: " + ("-" if v is None else f"{v:.3f}")
            for k, v in e.get("own_task_per_seed", {}).items()
        )
        lines.append(
            f"| {f} | {e['in_composites']:.3f} | {e['subgoals']} | {e.get('seed', '-')} | "
            f"{per_seed or '-'} |"
        )
    return lines


if __name__ == "__main__":
    main()
