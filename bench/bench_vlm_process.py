"""Do process rewards reach the outcome-only arm's accuracy in less training time?

Outcome-only rewards versus outcome + process rewards on a task of several steps (issue 15).

Task (``--family``, datasets/clevr.py): ``count_size`` (the default): "How many objects are
there? Count the small and the large ones first", or ``count_sum``: "How many red and blue
objects are there in total? Count each colour first". The generator knows both sub-counts, and
its trace lists each group's objects, states the sub-count, then the sum. On count_sum the tiny
model never got past the constant-answer prior (most colours hold one object, and every model
learnt to list one per colour: the committed count_sum result said so), hence count_size, whose
sub-counts range over 0..6 and whose listing is the count traces' listing of all objects. One SFT
warm start (``--sft-steps`` from assets/vlm_base) on a *sloppy teacher's* traces (``--miscount``:
in that share of them the teacher lists a group's objects correctly but states its sub-count one
short, and the total follows), the base that made the demo show learning: it imitates a habit the
rewards penalise while its samples still hold the right sub-counts. Then three GRPO arms from it
for the same wall time (``--minutes``), each in its own process, recipe
``configs/vlm_process.yaml``; all of it once per training seed (``--seeds``):

* outcome: accuracy + format only, RLOO advantages (``rollout.process_reward=``);
* rule: + the rule-based step reward ``step_values`` (each stated sub-count checked), PRIME's
  estimator (RLOO on outcome and on process, summed);
* implicit: + PRIME's implicit PRM (a second model trained online from the outcome labels),
  PRIME's estimator.

Learning curves at equal wall time: a checkpoint every ``--every`` steps, each scored greedily
on held-out questions (a data seed no arm trained on) after the runs, placed at its training
time (sum of ``time/step`` up to it). Goal: a process arm reaches the outcome arm's final
accuracy in <= 0.7x the time. A single checkpoint on a few hundred questions moves by several
points from one to the next, so "final accuracy" is the outcome arm's plateau (its mean over the
last third of its checkpoints) and an arm reaches it when the mean of ``WINDOW`` consecutive
checkpoints does; the ratio is against the outcome arm's own time to its plateau. The recipes
were fixed before the run (no tuning on the held-out questions). Also reported: the process
reward of each arm and its correlation with the outcome over training (a process reward that
rises while accuracy falls is hacked), and what each final model writes greedily.

    python bench/bench_vlm_process.py [--family count_size] [--sft-steps 800] [--miscount 0.6]
        [--minutes 6] [--seeds 0,1] [--reuse] [--report]

Writes bench/results/<--name>.{json,md} (vlm_process: count_size; vlm_process_count_sum: the
earlier count_sum run).
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import statistics
import time
from pathlib import Path

from common import RESULTS, arm_runner, last_model, machine, metrics, write_results

ARMS = {
    "outcome": ["rollout.process_reward=", "algo.adv_estimator=rloo"],
    "rule": [],
    "implicit": ["rollout.process_reward=implicit_prm"],
}
SFT_ARGS = ["train.lr=1.0e-3", "train.warmup_steps=20"]
GOAL_TIME_RATIO = 0.7
WINDOW = 3
"""checkpoints averaged when an arm's time to a target accuracy is read off its curve"""
MAX_NEW = 96
"""tokens of a completion: the listing traces take up to about 75"""
SUB = re.compile(r"(\w+): (\d+)\.")


def sloppy_teacher(miscount: float, seed: int):
    """``teacher(sample, trace)``: with probability ``miscount`` (drawn from the sample's id and
    ``seed``) the largest sub-count is stated one short (the listing stays right) and the total
    and answer follow it."""

    def teacher(sample: dict, trace: str) -> str:
        steps = sample["meta"]["steps"]
        if random.Random(f"{seed}:{sample['id']}").random() >= miscount:
            return trace
        wrong = max(steps, key=lambda c: steps[c])
        counts = {c: n - (c == wrong) for c, n in steps.items()}
        out = SUB.sub(lambda m: f"{m[1]}: {counts[m[1]]}." if m[1] in counts else m[0], trace)
        total = sum(counts.values())
        out = re.sub(r"Total: .*? = \d+\.", "Total: " + " + ".join(map(str, counts.values()))
                     + f" = {total}.", out)  # fmt: skip
        return re.sub(r"<answer>\d+</answer>", f"<answer>{total}</answer>", out)

    return teacher


def sft_base(args, seed: int, out: Path, base: Path, train: Path) -> tuple[Path, float]:
    """The sloppy teacher's SFT of ``base``, in this process. Returns (model, seconds)."""
    from perceptrl.cli import CONFIGS
    from perceptrl.vlm.builder import run_sft
    from perceptrl.wiring import load_config

    cfg = load_config(
        CONFIGS / "vlm_process.yaml",
        [f"model.path={base}", f"data.train={train.resolve()}", f"train.steps={args.sft_steps}",
         *SFT_ARGS, "train.eval_every=0", "train.eval_samples=0", f"train.seed={seed}",
         f"rollout.max_new_tokens={MAX_NEW}", "checkpoint.every=0", "log.progress=false"],
    )  # fmt: skip
    run = out / "sft"
    if run.exists():
        shutil.rmtree(run)
    t0 = time.perf_counter()
    run_sft(cfg, run, teacher=sloppy_teacher(args.miscount, seed))
    return last_model(run), time.perf_counter() - t0


def score(model: Path, samples: list[dict]) -> float:
    from perceptrl.rewards import build_reward
    from perceptrl.vlm.policy import VLMPolicy
    from perceptrl.vlm.source import evaluate_accuracy

    policy = VLMPolicy.from_pretrained(model)
    m = evaluate_accuracy(
        policy, samples, build_reward({"accuracy": 1.0}), batch_size=50, max_new_tokens=MAX_NEW
    )
    return m["accuracy"]


def curve(run: Path, samples: list[dict]) -> list[dict]:
    """(step, training seconds, held-out accuracy) of every checkpoint of a run."""
    rows = [r for r in metrics(run) if "actor/pg_loss" in r]
    elapsed, t = {}, 0.0
    for r in rows:
        t += r.get("time/step", 0.0)
        elapsed[int(r["step"])] = t
    out = []
    for ck in sorted((run / "checkpoints").glob("step_*")):
        step = int(ck.name.split("_")[1])
        out.append(
            {
                "step": step,
                "seconds": elapsed.get(step, t),
                "accuracy": score(ck / "model", samples),
            }
        )
    return out


def greedy_habits(model: Path, samples: list[dict]) -> dict:
    """What a model writes greedily on ``samples``: how often each answer and each stated
    sub-count appears (the diagnosis when accuracy sits at a constant-answer prior)."""
    from collections import Counter

    from perceptrl.vlm.policy import VLMPolicy
    from perceptrl.vlm.rollout import SamplingParams
    from perceptrl.vlm.sampler import Rollouts

    policy = VLMPolicy.from_pretrained(model)
    prompts, _ = policy.encode(samples)
    batch = Rollouts(policy).sample(
        prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    )
    texts = [m["completion"] for m in batch.meta]
    answers = Counter((re.findall(r"<answer>(\d+)", t) or ["none"])[0] for t in texts)
    subs = Counter(n for t in texts for _, n in SUB.findall(t.split("Total:")[0]))
    return {"answers": dict(answers.most_common()), "sub_counts": dict(subs.most_common())}


def summary(run: Path) -> dict:
    rows = [r for r in metrics(run) if "actor/pg_loss" in r]
    k = max(1, len(rows) // 5)

    def ends(key):
        vals = [r[key] for r in rows if key in r]
        return (statistics.mean(vals[:k]), statistics.mean(vals[-k:])) if vals else (None, None)

    proc = [r.get("reward/process_mean") for r in rows]
    acc = [r.get("reward/accuracy") for r in rows]
    corr = None
    if all(v is not None for v in proc) and len(rows) > 2 and statistics.pstdev(proc) > 0:
        corr = statistics.correlation(proc, acc)
    return {
        "steps": len(rows),
        "step_s": statistics.mean(r["time/step"] for r in rows),
        "train_accuracy": ends("reward/accuracy"),
        "process_mean": ends("reward/process_mean"),
        "process_outcome_correlation": corr,
        "hacking_flags": sum(r.get("reward/process_vs_outcome", 0.0) for r in rows),
    }


def plateau(points: list[dict]) -> float:
    """Mean held-out accuracy over the last third of a curve's checkpoints: what an arm ended at,
    less noisy than its last checkpoint alone."""
    tail = points[-max(1, len(points) // 3) :]
    return statistics.mean(p["accuracy"] for p in tail)


def time_to_reach(points: list[dict], target: float, window: int = WINDOW) -> float | None:
    """Training seconds at the first checkpoint where the mean of it and the ``window - 1``
    before it reaches ``target`` (None: never)."""
    for i in range(window - 1, len(points)):
        if statistics.mean(p["accuracy"] for p in points[i - window + 1 : i + 1]) >= target:
            return points[i]["seconds"]
    return None


def reach(curves: dict[str, list[dict]]) -> dict:
    """Each arm's time to the outcome arm's plateau, and as a fraction of the outcome arm's own."""
    target = plateau(curves["outcome"])
    own = time_to_reach(curves["outcome"], target)
    return {
        "target": target,
        "arms": {
            a: {"seconds": (t := time_to_reach(c, target)),
                "ratio": None if t is None or not own else t / own}
            for a, c in curves.items()
        },
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="count_size", choices=["count_size", "count_sum"])
    ap.add_argument("--sft-steps", type=int, default=800)
    ap.add_argument("--miscount", type=float, default=0.6, help="sloppy teacher's share")
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--n-test", type=int, default=300)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--base", default="assets/vlm_base")
    ap.add_argument("--out", default="runs/bench_vlm_process")
    ap.add_argument("--name", default="vlm_process", help="result file name under bench/results")
    ap.add_argument("--seeds", default="0,1", help="training seeds (SFT and GRPO), one run each")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="keep the runs already under --out (and their scores in the result file)",
    )
    ap.add_argument("--report", action="store_true", help="rewrite the markdown from the JSON")
    args = ap.parse_args()

    import json

    if args.report:
        data = json.loads((RESULTS / f"{args.name}.json").read_text())
        seeds = data.get("provenance", {}).get("seeds", sorted(data["seeds"]))
        return print(write_results(args.name, data, markdown(data), seeds=seeds,
                                   keep_provenance=True)[1])  # fmt: skip

    from perceptrl.datasets.clevr import generate
    from perceptrl.datasets.loader import load_samples
    from perceptrl.trainer.runtime import resolve_path

    out, base = Path(args.out), resolve_path(args.base)
    fam = [args.family]
    generate(out / "data", splits={"train": args.n_train}, families=fam, seed=1)
    generate(out / "eval_data", splits={"test": args.n_test}, families=fam, seed=1000)
    test = load_samples(out / "eval_data" / "test.jsonl")[0]
    old = RESULTS / f"{args.name}.json"
    previous = json.loads(old.read_text()).get("seeds", {}) if args.reuse and old.exists() else {}
    seeds = {}
    for seed in (int(x) for x in args.seeds.split(",")):
        seeds[str(seed)] = run_seed(args, seed, out / f"s{seed}", base, out / "data", test,
                                    previous.get(str(seed), {}))  # fmt: skip
    data = {
        "machine": machine(note="2 CPU cores"),
        "settings": {
            "family": args.family,
            "sft_steps": args.sft_steps,
            "miscount": args.miscount,
            "minutes": args.minutes,
            "max_new_tokens": MAX_NEW,
            "n_train": args.n_train,
            "n_test": len(test),
            "train_data_seed": 1,
            "eval_data_seed": 1000,
            "every": args.every,
            "window": WINDOW,
            "arms": {a: ARMS[a] for a in args.arms.split(",")},
            "sft_args": SFT_ARGS,
        },  # fmt: skip
        "seeds": seeds,
    }
    seeds = {"train": [int(s) for s in seeds], "train_data": 1, "eval_data": 1000}
    js, md = write_results(args.name, data, markdown(data), seeds=seeds)
    print(markdown(data))
    print(f"\nwrote {js} and {md}")


def run_seed(args, seed: int, out: Path, base: Path, data: Path, test: list[dict],
             previous: dict) -> dict:  # fmt: skip
    """SFT and the GRPO arms of one training seed under ``out``; curves on ``test``."""
    common = ["train.steps=100000", f"train.seed={seed}", "log.progress=false",
              "train.eval_every=0", "train.eval_samples=0", f"rollout.max_new_tokens={MAX_NEW}",
              f"data.train={(data / 'train.jsonl').resolve()}"]  # fmt: skip
    wall = {}
    if args.reuse and (out / "sft" / "checkpoints").exists():
        sft, wall["sft"] = last_model(out / "sft"), previous.get("wall_s", {}).get("sft")
    else:
        sft, wall["sft"] = sft_base(args, seed, out, base, data / "train.jsonl")
    arm = arm_runner(out, args.reuse, previous, wall)
    arms = args.arms.split(",")
    # a kept run keeps its scores from the result file (only a run kept as it is)
    kept = {a: c for a, c in previous.get("curves", {}).items()
            if args.reuse and a in arms and (out / a / "checkpoints").exists()}  # fmt: skip
    start = (next(iter(kept.values()))[0] if kept
             else {"step": 0, "seconds": 0.0, "accuracy": score(sft, test)})  # fmt: skip
    curves, runs = {}, {}
    for a in arms:
        arm(a, ["train", "vlm_process", *common, *ARMS[a], f"model.path={sft}",
                f"train.time_limit_min={args.minutes}", f"checkpoint.every={args.every}",
                "checkpoint.keep_last=1000"])  # fmt: skip
        curves[a] = kept.get(a) or [start, *curve(out / a, test)]
        runs[a] = summary(out / a)
    result = {"wall_s": wall, "curves": curves, "runs": runs}
    known = args.reuse and set(previous.get("habits", {})) == {"sft", *curves}
    result.update({k: previous[k] for k in ("prior", "habits")} if known
                  else diagnosis(out, test, list(curves)))  # fmt: skip
    if "outcome" in curves:
        result["reach"] = reach(curves)
    return result


def diagnosis(out: Path, test: list[dict], arms: list[str]) -> dict:
    """The test set's constant-answer prior and each model's greedy habits."""
    from collections import Counter

    top = Counter(s["answer"] for s in test).most_common(1)[0]
    models = {"sft": last_model(out / "sft"), **{a: last_model(out / a) for a in arms}}
    return {
        "prior": {"answer": top[0], "share": top[1] / len(test)},
        "habits": {k: greedy_habits(m, test) for k, m in models.items()},
    }


def markdown(d: dict) -> str:
    s, m = d["settings"], d["machine"]
    seeds = d["seeds"]
    arms = list(s["arms"])
    md = [
        f"# Outcome vs process rewards on {s['family']}: {s['sft_steps']} SFT steps on a sloppy "
        f"teacher, then {s['minutes']:g} min of GRPO per arm, {len(seeds)} seed(s)",
        "",
        f"The teacher states the largest sub-count one short in {s['miscount']:.0%} of its "
        "traces (its listing of the objects stays right; the total follows the wrong "
        "sub-count). Each training seed has its own SFT start and arms.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}. Greedy accuracy on "
        f"{s['n_test']} held-out questions (data seed {s['eval_data_seed']}, the same for every "
        f"seed), checkpoints every {s['every']} steps placed at their training time. An arm's "
        "*plateau* is its mean accuracy over the last third of its checkpoints; its *time to "
        "the outcome plateau* is the training time at the first checkpoint where the mean of "
        f"{s['window']} consecutive checkpoints reaches the outcome arm's plateau. Goal: a "
        f"process arm gets there in <= {GOAL_TIME_RATIO}x the outcome arm's own time.",
        "",
        "| seed | SFT start | "
        + " | ".join(f"{a} plateau" for a in arms)
        + " | "
        + " | ".join(f"{a}: time (ratio)" for a in arms)
        + " |",
        "|---|---|" + "---|" * (2 * len(arms)),
    ]
    ratios: dict[str, list[float | None]] = {a: [] for a in arms}
    for seed, r in seeds.items():
        cells = [f"{plateau(r['curves'][a]):.3f}" for a in arms]
        for a in arms:
            v = r["reach"]["arms"][a]
            ratios[a].append(v["ratio"])
            cells.append(
                "never" if v["seconds"] is None
                else f"{v['seconds']:.0f} s ({_f(v['ratio'], 2)}x)"
            )  # fmt: skip
        md.append(
            f"| {seed} | {r['curves']['outcome'][0]['accuracy']:.3f} | " + " | ".join(cells) + " |"
        )
    prior = next(iter(seeds.values()))["prior"]
    md += ["", f"Constant-answer prior of the test questions: answer {prior['answer']} is right "
           f"on {prior['share']:.0%} of them.", ""]  # fmt: skip
    for seed, r in seeds.items():
        top, start = plateau(r["curves"]["outcome"]), r["curves"]["outcome"][0]["accuracy"]
        if top <= max(prior["share"], start):
            md.append(f"- seed {seed}: not assessable, the outcome arm's plateau ({top:.3f}) is "
                      f"not above the SFT start ({start:.3f}) or the constant-answer prior")  # fmt: skip
    for a in arms:
        if a == "outcome":
            continue
        rs = ratios[a]
        met = sum(x is not None and x <= GOAL_TIME_RATIO for x in rs)
        shown = ", ".join("never" if x is None else f"{x:.2f}x" for x in rs)
        md.append(f"- {a}: {shown}; goal met on {met} of {len(rs)} seeds")
    for seed, r in seeds.items():
        md += _seed_markdown(seed, r)
    return "\n".join(md)


def _seed_markdown(seed: str, d: dict) -> list[str]:
    sft = d["wall_s"].get("sft")
    md = [
        "",
        f"## Seed {seed}",
        "",
        f"SFT: {'n/a' if sft is None else f'{sft / 60:.1f} min'}.",
        "",
        "| arm | steps | s / step | plateau | last checkpoint | train acc. first -> last | "
        "process reward first -> last | corr(process, outcome) | hacking flags |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for a, r in d["runs"].items():
        fa, la = r["train_accuracy"]
        fp, lp = r["process_mean"]
        c = d["curves"][a]
        md.append(
            f"| {a} | {r['steps']} | {r['step_s']:.2f} | {plateau(c):.3f} | "
            f"{c[-1]['accuracy']:.3f} | {fa:.3f} -> {la:.3f} | {_f(fp)} -> {_f(lp)} | "
            f"{_f(r['process_outcome_correlation'])} | {r['hacking_flags']:.0f} |"
        )
    md += ["", "What each model writes greedily on the test questions (answers; sub-counts "
           "stated before the total):", ""]  # fmt: skip
    for k, h in d["habits"].items():
        top = ", ".join(f"{a}: {n}" for a, n in list(h["answers"].items())[:4])
        sub = ", ".join(f"{a}: {n}" for a, n in list(h["sub_counts"].items())[:4])
        md.append(f"- {k}: answers {top}; sub-counts {sub}")
    md += ["", "Curves (training seconds: held-out accuracy):", ""]
    for a, c in d["curves"].items():
        md.append(f"- {a}: " + ", ".join(f"{p['seconds']:.0f}: {p['accuracy']:.2f}" for p in c))
    return md


def _f(v, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


if __name__ == "__main__":
    main()
