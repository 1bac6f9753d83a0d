"""Does GRPO beat SFT given the same wall time, on questions unlike the training ones?

RL against SFT out of distribution: GRPO and three SFT controls, equal wall time, several seeds.

The question (issue: "an RL-versus-SFT study that can come out either way"): from one base, does
GRPO with a verifiable reward beat supervised fine-tuning given the same wall time, on questions
unlike the training ones? Every arm starts from ``--base`` (default the demo's base,
``assets/vlm_demo_base``: the shipped SFT base after SFT on a sloppy teacher whose count is one
short in 60% of its traces; `assets/build/make_demo_base.py`) and trains on "how many objects"
questions of the same scenes (data seed 1) for ``--minutes``:

- ``grpo``: `configs/vlm_demo.yaml` (ground-truth reward; lr chosen on the validation split);
- ``sft_teacher``: continued SFT on the same teacher's traces (the supervision the base had);
- ``sft_gold``: continued SFT on correct reasoning traces (an oracle teacher);
- ``sft_answer``: continued SFT on correct final answers only, no reasoning.

SFT arms use lr 1e-3 (the base's own SFT), not tuned. Each arm runs ``--seeds`` training seeds.
Every model is scored greedily on two splits of fresh scenes (data seed 1000, which no arm and no
recipe choice saw): ``test`` (in distribution: 1-5 objects, seen colour-shape pairs) and ``ood``
(CLEVR-CoGenT style: every scene has 6 objects, a count no training scene has, or a colour-shape
pair never seen in training, or both), broken down into ``ood/count6`` and ``ood/new_pair``.

GRPO against each SFT arm: the difference of mean accuracies over seeds, with a standard error
that adds the question-sampling part (paired over questions, each question's difference averaged
over seeds) and the seed-to-seed part (spread of the per-seed differences) in quadrature;
``z`` = difference / SE. pass@k (16 samples a question, the OOD split) of the base and of each
arm's first seed shows what each arm did to the spread of the samples.

    python bench/bench_rl_vs_sft.py [--minutes 3] [--seeds 3] [--n-test 500] [--reuse]

Writes bench/results/rl_vs_sft.{json,md} and rl_vs_sft_passk.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from common import RESULTS, ROOT, last_model, machine, run_arm, run_timed, write_results

sys.path.insert(0, str(ROOT / "assets" / "build"))
from make_demo_base import COUNT, sloppy_teacher  # noqa: E402

SFT_ARMS = ("sft_teacher", "sft_gold", "sft_answer")
ARMS = ("grpo", *SFT_ARMS)
DATA_SEED = 1  # the scenes every arm trains on (the base saw seed 0)
EVAL_SEED = 1000
GOAL_Z = 2.0


def answer_only(sample: dict, trace: str) -> str:
    """The correct trace reduced to its final answer (SFT without reasoning)."""
    m = COUNT.search(trace)
    return f"<think></think><answer>{m.group(2) if m else sample['answer']}</answer>"


TEACHERS = {
    "sft_teacher": sloppy_teacher(0.6, 0),  # the base's own teacher, unchanged
    "sft_gold": None,  # the generator's correct traces
    "sft_answer": answer_only,
}
"""SFT arm -> the ``teacher`` rewriting its targets (`vlm.builder.run_sft`)"""


def sft_arm(arm: str, base: str, seed: int, minutes: float, run_dir: Path) -> None:
    """One SFT arm, in this process (the child `train_arm` starts with ``arm``)."""
    from perceptrl.cli import CONFIGS
    from perceptrl.vlm.builder import run_sft
    from perceptrl.wiring import load_config

    cfg = load_config(
        CONFIGS / "vlm_sft.yaml",
        [f"model.path={base}", "data.families=[count_all]", f"data.seed={DATA_SEED}",
         "data.n_train=2000", "train.steps=100000", f"train.time_limit_min={minutes}",
         "train.lr=1.0e-3", "train.warmup_steps=20", "train.eval_every=0",
         "train.eval_samples=0", f"train.seed={seed}", "log.progress=false",
         "checkpoint.every=0", "checkpoint.keep_last=1"],
    )  # fmt: skip
    run_sft(cfg, run_dir, teacher=TEACHERS[arm])


def train_arm(arm: str, base: str, seed: int, minutes: float, run_dir: Path) -> float:
    """Train one arm and seed in its own process (its own memory and threads); wall seconds."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    if arm == "grpo":
        return run_arm(
            ["train", "vlm_demo", f"model.path={base}", "train.steps=100000",
             f"train.time_limit_min={minutes}", f"train.seed={seed}", f"data.seed={DATA_SEED}",
             "train.eval_every=0", "train.eval_samples=0", "log.progress=false",
             "checkpoint.every=0"], run_dir,
        )  # fmt: skip
    return run_timed([sys.executable, __file__, "arm", arm, base, str(seed), str(minutes), str(run_dir)])  # fmt: skip


def steps_of(run_dir: Path) -> int:
    from perceptrl.trainer.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    return len([r for r in rows if "actor/pg_loss" in r or "sft/loss" in r])


def score(model: Path, splits: dict[str, list[dict]], out: Path) -> dict[str, dict[str, float]]:
    """Greedy per-question scores (id -> 0/1) of one model on each split, prompted as in training."""
    import dataclasses

    from perceptrl.cli import CONFIGS
    from perceptrl.vlm.builder import build_evaluator, build_policy
    from perceptrl.vlm.run_plan import resolve
    from perceptrl.wiring import load_config

    plan = resolve(load_config(CONFIGS / "vlm_demo.yaml", [f"model.path={model}"]))
    policy = build_policy(plan, out)
    result = {}
    for name, samples in splits.items():
        evaluation = dataclasses.replace(plan.evaluation, samples=len(samples))
        result[name] = {}
        build_evaluator(evaluation, samples)(policy, prompt=plan.prompt, scores=result[name])
    return result


def compare(a: list[dict[str, float]], b: list[dict[str, float]], ids: list[str]) -> dict:
    """Arm ``a`` minus arm ``b`` over seeds (lists of per-seed {id: score}) on questions ``ids``:
    difference, SE (question part and seed part in quadrature) and z."""
    import numpy as np

    d = np.array([[sa[i] - sb[i] for i in ids] for sa, sb in zip(a, b)])  # seeds x questions
    diff = float(d.mean())
    se_q = float(d.mean(axis=0).std(ddof=1) / np.sqrt(d.shape[1]))
    se_s = float(d.mean(axis=1).std(ddof=1) / np.sqrt(d.shape[0])) if d.shape[0] > 1 else 0.0
    se = (se_q**2 + se_s**2) ** 0.5
    return {"diff": diff, "se": se, "se_questions": se_q, "se_seeds": se_s,
            "z": diff / se if se > 0 else 0.0, "questions": len(ids)}  # fmt: skip


def subsets(splits: dict[str, list[dict]]) -> dict[str, tuple[str, list[str]]]:
    """Reported question sets: name -> (split, ids)."""
    ood = splits["ood"]
    six = {s["id"] for s in ood if len(s["meta"]["objects"]) == 6}
    return {
        "test": ("test", [s["id"] for s in splits["test"]]),
        "ood": ("ood", [s["id"] for s in ood]),
        "ood/count6": ("ood", [s["id"] for s in ood if s["id"] in six]),
        "ood/new_pair": ("ood", [s["id"] for s in ood if s["id"] not in six]),
    }


def pass_k(
    models: dict[str, Path], ood: Path, questions: list[dict], kinds: dict, out: Path, n: int
) -> tuple[dict, dict]:
    """pass@k of each model on the first ``n`` OOD questions (``questions``, the samples in the
    file ``ood``; 16 samples each): name -> {k: value}, and name -> sampled pass@1 on the
    questions of each of ``kinds`` (name -> ids, from `subsets`) among them (greedy decoding
    can hide answers that sampling gives)."""
    from perceptrl.cli import CONFIGS
    from perceptrl.vlm.builder import run_pass_k
    from perceptrl.wiring import load_config

    cfgs = {
        name: load_config(CONFIGS / "vlm_demo.yaml",
                          [f"model.path={m}", f"data.val={ood}", f"train.eval_samples={n}"])
        for name, m in models.items()
    }  # fmt: skip
    run_pass_k(cfgs, out, [1, 2, 4, 8, 16], 16)
    shutil.copy(out / "passk.png", RESULTS / "rl_vs_sft_passk.png")  # json, md: by main
    result = json.loads((out / "passk.json").read_text())
    ids = [q["id"] for q in questions[:n]]
    by_kind = {}
    for name, r in result.items():  # r["correct"]: right answers of 16, question by question
        right = dict(zip(ids, r["correct"]))
        by = {kind: [right[i] for i in kind_ids if i in right] for kind, kind_ids in kinds.items()}
        by_kind[name] = {k: sum(v) / (16 * len(v)) for k, v in by.items() if v}
    return {name: r["overall"] for name, r in result.items()}, by_kind


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "arm":  # one SFT arm, from train_arm
        arm, base, seed, minutes, run_dir = sys.argv[2:7]
        sft_arm(arm, base, int(seed), float(minutes), Path(run_dir))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="wall time of each training arm")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--n-test", type=int, default=500, help="questions per split")
    ap.add_argument("--n-passk", type=int, default=200, help="OOD questions for pass@k")
    ap.add_argument("--base", default="assets/vlm_demo_base")
    ap.add_argument("--out", default="runs/bench_rl_vs_sft")
    ap.add_argument("--reuse", action="store_true", help="keep arms already trained in --out")
    args = ap.parse_args()

    from perceptrl.datasets.clevr import generate
    from perceptrl.datasets.loader import load_samples
    from perceptrl.trainer.runtime import resolve_path

    out, base = Path(args.out), str(resolve_path(args.base))
    paths = generate(out / "eval_data", splits={"test": args.n_test, "ood": args.n_test},
                     families=["count_all"], seed=EVAL_SEED)  # fmt: skip
    splits = {k: load_samples(v)[0] for k, v in paths.items()}
    previous = json.loads((out / "result.json").read_text()) if args.reuse and (out / "result.json").exists() else {}  # fmt: skip
    wall, steps, models = {}, {}, {}
    for arm in ARMS:
        for seed in range(args.seeds):
            key, run_dir = f"{arm}/{seed}", out / arm / str(seed)
            if args.reuse and (run_dir / "checkpoints").exists():
                wall[key] = previous.get("wall_s", {}).get(key, float("nan"))
            else:
                wall[key] = train_arm(arm, base, seed, args.minutes, run_dir)
            steps[key], models[key] = steps_of(run_dir), last_model(run_dir)
            print(f"{key}: {steps[key]} steps in {wall[key]:.0f} s", flush=True)
    scores = {"base": score(Path(base), splits, out / "score")}
    for key, m in models.items():
        scores[key] = score(m, splits, out / "score")
    (out / "result.json").write_text(json.dumps({"wall_s": wall, "scores": scores}) + "\n")

    sets = subsets(splits)
    per_arm = {arm: [scores[f"{arm}/{s}"] for s in range(args.seeds)] for arm in ARMS}
    per_arm["base"] = [scores["base"]]

    def acc(runs: list[dict], name: str) -> list[float]:
        split, ids = sets[name]
        return [sum(r[split][i] for i in ids) / len(ids) for r in runs]

    accuracy = {arm: {name: acc(runs, name) for name in sets} for arm, runs in per_arm.items()}
    versus = {
        f"grpo-{b}": {name: compare([r[sets[name][0]] for r in per_arm["grpo"]],
                                    [r[sets[name][0]] for r in per_arm[b]], sets[name][1])
                      for name in sets}
        for b in SFT_ARMS
    }  # fmt: skip
    passk, passk_subsets = pass_k({"base": Path(base), **{a: models[f"{a}/0"] for a in ARMS}},
                   paths["ood"], splits["ood"],
                   {k: sets[k][1] for k in ("ood/count6", "ood/new_pair")},
                   out / "passk", args.n_passk)  # fmt: skip
    data = {
        "machine": machine(),
        "settings": {
            "base": args.base, "minutes_per_arm": args.minutes, "seeds": args.seeds,
            "questions_per_split": args.n_test, "family": "count_all", "train_data_seed": DATA_SEED,
            "eval_data_seed": EVAL_SEED, "decoding": "greedy", "grpo_recipe": "vlm_demo",
            "sft_lr": 1.0e-3, "goal": f"grpo beats an SFT arm on ood by more than {GOAL_Z} SE",
            "subset_questions": {name: len(ids) for name, (_, ids) in sets.items()},
            "passk_questions": args.n_passk,
        },  # fmt: skip
        "wall_s": wall,
        "steps": steps,
        "accuracy": accuracy,
        "grpo_versus": versus,
        "passk_ood": passk,
        "sampled_pass1_ood": passk_subsets,
    }  # fmt: skip
    md = markdown(data)
    seeds = {"train": list(range(args.seeds)), "train_data": DATA_SEED, "eval_data": EVAL_SEED}
    js, mdp = write_results("rl_vs_sft", data, md, seeds=seeds)
    passk_dir = out / "passk"
    write_results("rl_vs_sft_passk", json.loads((passk_dir / "passk.json").read_text()),
                  (passk_dir / "passk.md").read_text(), seeds=seeds)  # fmt: skip
    print(md)
    print(f"\nwrote {js} and {mdp}")


def markdown(data: dict) -> str:
    import numpy as np

    s, m = data["settings"], data["machine"]
    names = list(s["subset_questions"])
    rows = [
        f"# RL against SFT out of distribution ({s['minutes_per_arm']:g} min per arm, {s['seeds']} seeds)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}. Base `{s['base']}`; every arm "
        f"trains on count_all (data seed {s['train_data_seed']}); greedy decoding on fresh scenes "
        f"(data seed {s['eval_data_seed']}): {', '.join(f'{k} {v} questions' for k, v in s['subset_questions'].items())}.",
        "",
        "Accuracy, mean over seeds (min-max):",
        "",
        "| model | steps | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for arm, acc in data["accuracy"].items():
        st = [v for k, v in data["steps"].items() if k.startswith(f"{arm}/")]
        cells = [
            f"{np.mean(acc[n]):.3f}" + (f" ({min(acc[n]):.3f}-{max(acc[n]):.3f})" if len(acc[n]) > 1 else "")
            for n in names
        ]  # fmt: skip
        rows.append(f"| {arm} | {round(np.mean(st)) if st else 0} | " + " | ".join(cells) + " |")
    rows += ["", "GRPO minus each SFT arm (difference ± SE, z):", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
    for vs, r in data["grpo_versus"].items():
        cells = [f"{r[n]['diff']:+.3f} ± {r[n]['se']:.3f} (z {r[n]['z']:+.1f})" for n in names]
        rows.append(f"| {vs} | " + " | ".join(cells) + " |")
    ks = list(next(iter(data["passk_ood"].values())))
    rows += ["", f"pass@k on the first {s['passk_questions']} OOD questions (16 samples each, "
             "temperature 1; the base and each arm's first seed; `rl_vs_sft_passk.png`):", "",
             "| model | " + " | ".join(f"pass@{k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]  # fmt: skip
    for name, r in data["passk_ood"].items():
        rows.append(f"| {name} | " + " | ".join(f"{r[k]:.3f}" for k in ks) + " |")
    rows += ["", "Sampled pass@1 on those questions by kind (greedy decoding never lists a sixth "
             "object; sampling sometimes does):", "", "| model | ood/count6 | ood/new_pair |",
             "|---|---|---|"]  # fmt: skip
    for name, r in data["sampled_pass1_ood"].items():
        rows.append(f"| {name} | {r['ood/count6']:.3f} | {r['ood/new_pair']:.3f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
