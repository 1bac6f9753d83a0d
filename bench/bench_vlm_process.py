"""Outcome-only rewards versus outcome + process rewards on a task of several steps (issue 15).

Task: ``count_sum`` (datasets/clevr.py): "How many red and blue objects are there in total?
Count each colour first"; the generator knows both sub-counts, and its trace lists each colour's
objects, states the sub-count, then the sum. One SFT warm start (``--sft-steps`` from
assets/vlm_base) on a *sloppy teacher's* traces (``--miscount``: in that share of them the
teacher lists a colour's objects correctly but states its sub-count one short, and the total
follows), the base that made the demo show learning: it imitates a habit the rewards penalise
while its samples still hold the right sub-counts. Then three GRPO arms from it for the same
wall time (``--minutes``), each in its own process, recipe ``configs/vlm_process.yaml``:

* outcome: accuracy + format only, RLOO advantages (``rollout.process_reward=``);
* rule: + the rule-based step reward ``step_values`` (each stated sub-count checked), PRIME's
  estimator (RLOO on outcome and on process, summed);
* implicit: + PRIME's implicit PRM (a second model trained online from the outcome labels),
  PRIME's estimator.

Learning curves at equal wall time: a checkpoint every ``--every`` steps, each scored greedily
on held-out questions (a data seed no arm trained on) after the runs, placed at its training
time (sum of ``time/step`` up to it). Goal: a process arm reaches the outcome arm's final
accuracy in <= 0.7x the time. The recipes were fixed before the run (no tuning on the held-out
questions). Also reported: the process reward of each arm and its correlation with the
outcome over training (a process reward that rises while accuracy falls is hacked).

    python bench/bench_vlm_process.py [--sft-steps 800] [--miscount 0.6] [--minutes 6]

Writes bench/results/vlm_process.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import statistics
import time
from pathlib import Path

from common import RESULTS, last_model, machine, metrics, run_arm, write_results

ARMS = {
    "outcome": ["rollout.process_reward=", "algo.adv_estimator=rloo"],
    "rule": [],
    "implicit": ["rollout.process_reward=implicit_prm"],
}
SFT_ARGS = ["train.lr=1.0e-3", "train.warmup_steps=20"]
GOAL_TIME_RATIO = 0.7
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


def sft_base(args, out: Path, base: Path, train: Path) -> tuple[Path, float]:
    """The sloppy teacher's SFT of ``base``, in this process. Returns (model, seconds)."""
    from perceptrl.cli import CONFIGS
    from perceptrl.vlm.run import run_sft
    from perceptrl.wiring import load_config

    cfg = load_config(
        CONFIGS / "vlm_process.yaml",
        [f"model.path={base}", f"data.train={train.resolve()}", f"train.steps={args.sft_steps}",
         *SFT_ARGS, "train.eval_every=0", "train.eval_samples=0", f"train.seed={args.seed}",
         f"rollout.max_new_tokens={MAX_NEW}", "checkpoint.every=0", "log.progress=false"],
    )  # fmt: skip
    run = out / "sft"
    if run.exists():
        shutil.rmtree(run)
    t0 = time.perf_counter()
    run_sft(cfg, run, teacher=sloppy_teacher(args.miscount, args.seed))
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

    policy = VLMPolicy.from_pretrained(model)
    prompts, _ = policy.encode(samples)
    batch = policy.sample(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
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


def time_to_reach(points: list[dict], target: float) -> float | None:
    return next((p["seconds"] for p in points if p["accuracy"] >= target), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=800)
    ap.add_argument("--miscount", type=float, default=0.6, help="sloppy teacher's share")
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--n-test", type=int, default=100)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--base", default="assets/vlm_base")
    ap.add_argument("--out", default="runs/bench_vlm_process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", action="store_true", help="rewrite the result from --out's runs")
    args = ap.parse_args()
    if args.report:
        return report(args)

    from perceptrl.datasets.clevr import generate
    from perceptrl.datasets.loader import load_samples
    from perceptrl.trainer.runtime import resolve_path

    out, base = Path(args.out), resolve_path(args.base)
    generate(out / "data", splits={"train": args.n_train}, families=["count_sum"], seed=1)
    generate(out / "eval_data", splits={"test": args.n_test}, families=["count_sum"],
             seed=1000 + args.seed)  # fmt: skip
    test = load_samples(out / "eval_data" / "test.jsonl")[0]
    common = ["train.steps=100000", f"train.seed={args.seed}", "log.progress=false",
              "train.eval_every=0", "train.eval_samples=0", f"rollout.max_new_tokens={MAX_NEW}",
              f"data.train={(out / 'data' / 'train.jsonl').resolve()}"]  # fmt: skip
    sft, sft_s = sft_base(args, out, base, out / "data" / "train.jsonl")
    wall = {"sft": sft_s}
    start = {"step": 0, "seconds": 0.0, "accuracy": score(sft, test)}
    curves, runs = {}, {}
    for a in args.arms.split(","):
        wall[a] = run_arm(["train", "vlm_process", *common, *ARMS[a], f"model.path={sft}",
                           f"train.time_limit_min={args.minutes}",
                           f"checkpoint.every={args.every}", "checkpoint.keep_last=1000"],
                          out / a)  # fmt: skip
        curves[a] = [start, *curve(out / a, test)]
        runs[a] = summary(out / a)
    data = {
        "machine": machine(note="2 CPU cores"),
        "settings": {
            "sft_steps": args.sft_steps,
            "miscount": args.miscount,
            "minutes": args.minutes,
            "max_new_tokens": MAX_NEW,
            "n_train": args.n_train,
            "n_test": len(test),
            "train_data_seed": 1,
            "eval_data_seed": 1000 + args.seed,
            "seed": args.seed,
            "every": args.every,
            "arms": {a: ARMS[a] for a in curves},
            "sft_args": SFT_ARGS,
        },  # fmt: skip
        "wall_s": wall,
        "curves": curves,
        "runs": runs,
    }
    data.update(diagnosis(out, test, list(curves)))
    if "outcome" in curves:
        target = curves["outcome"][-1]["accuracy"]
        total = curves["outcome"][-1]["seconds"]
        data["time_to_outcome_final"] = {
            a: {"seconds": (s := time_to_reach(c, target)),
                "ratio": None if s is None else s / total}
            for a, c in curves.items()
        }  # fmt: skip
    js, md = write_results("vlm_process", data, markdown(data))
    print(markdown(data))
    print(f"\nwrote {js} and {md}")


def diagnosis(out: Path, test: list[dict], arms: list[str]) -> dict:
    """The test set's constant-answer prior and each model's greedy habits."""
    from collections import Counter

    top = Counter(s["answer"] for s in test).most_common(1)[0]
    models = {"sft": last_model(out / "sft"), **{a: last_model(out / a) for a in arms}}
    return {
        "prior": {"answer": top[0], "share": top[1] / len(test)},
        "habits": {k: greedy_habits(m, test) for k, m in models.items()},
    }


def report(args) -> None:
    """Add the diagnosis to an existing result (runs under ``--out``) and rewrite it."""
    import json

    from perceptrl.datasets.loader import load_samples

    out = Path(args.out)
    path = RESULTS / "vlm_process.json"
    data = json.loads(path.read_text())
    test = load_samples(out / "eval_data" / "test.jsonl")[0]
    data.update(diagnosis(out, test, list(data["curves"])))
    write_results("vlm_process", data, markdown(data))
    print(markdown(data))


def markdown(d: dict) -> str:
    s, m = d["settings"], d["machine"]
    md = [
        f"# Outcome vs process rewards on count_sum: {s['sft_steps']} SFT steps on a sloppy "
        f"teacher, then {s['minutes']:g} min of GRPO per arm",
        "",
        f"The teacher states the largest sub-count one short in {s['miscount']:.0%} of its "
        "traces (its listing of the objects stays right; the total follows the wrong "
        f"sub-count); SFT took {d['wall_s']['sft'] / 60:.1f} min.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}. Greedy accuracy on "
        f"{s['n_test']} held-out questions (data seed {s['eval_data_seed']}), checkpoints every "
        f"{s['every']} steps placed at their training time.",
        "",
        "| arm | steps | s / step | final held-out acc. | train acc. first -> last | process "
        "reward first -> last | corr(process, outcome) | hacking flags |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a, r in d["runs"].items():
        fa, la = r["train_accuracy"]
        fp, lp = r["process_mean"]
        corr = r["process_outcome_correlation"]
        md.append(
            f"| {a} | {r['steps']} | {r['step_s']:.2f} | {d['curves'][a][-1]['accuracy']:.3f} | "
            f"{fa:.3f} -> {la:.3f} | {_f(fp)} -> {_f(lp)} | {_f(corr)} | {r['hacking_flags']:.0f} |"
        )
    reach = d.get("time_to_outcome_final")
    start, final = d["curves"]["outcome"][0]["accuracy"], d["curves"]["outcome"][-1]["accuracy"]
    prior = d.get("prior")
    if reach and prior and final <= prior["share"]:
        md += ["", f"Goal not assessable: the outcome arm's final accuracy ({final:.3f}) is the "
               f"constant-answer prior of the test questions (answer {prior['answer']} is right "
               f"on {prior['share']:.0%} of them), so reaching it says nothing about learning to "
               "count; the ratios are not reported."]  # fmt: skip
        reach = None
    if reach and final <= start:
        md += ["", f"Goal not assessable: the outcome arm ended where the SFT start was "
               f"({final:.3f} <= {start:.3f}), so reaching its final accuracy takes no training "
               "(a ratio of 0 here would say nothing)."]  # fmt: skip
        reach = None
    if reach:
        md += ["", f"Time to reach the outcome arm's final accuracy "
               f"({d['curves']['outcome'][-1]['accuracy']:.3f}), as a fraction of its time "
               f"(goal <= {GOAL_TIME_RATIO}):", ""]  # fmt: skip
        for a, v in reach.items():
            if a == "outcome":
                continue
            if v["ratio"] is None:
                md.append(f"- {a}: never reached in {s['minutes']:g} min (not met)")
            else:
                met = "met" if v["ratio"] <= GOAL_TIME_RATIO else "not met"
                md.append(f"- {a}: {v['seconds']:.0f} s, {v['ratio']:.2f}x ({met})")
    if d.get("habits"):
        md += ["", "What each model writes greedily on the test questions (answers; sub-counts "
               "stated before the total):", ""]  # fmt: skip
        for k, h in d["habits"].items():
            top = ", ".join(f"{a}: {n}" for a, n in list(h["answers"].items())[:4])
            sub = ", ".join(f"{a}: {n}" for a, n in list(h["sub_counts"].items())[:4])
            md.append(f"- {k}: answers {top}; sub-counts {sub}")
    md += ["", "Curves (training seconds: held-out accuracy):", ""]
    for a, c in d["curves"].items():
        md.append(f"- {a}: " + ", ".join(f"{p['seconds']:.0f}: {p['accuracy']:.2f}" for p in c))
    return "\n".join(md)


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


if __name__ == "__main__":
    main()
