"""Does GRPO (or T-GRPO) improve video questions over an SFT warm start, using frame order?

Video RL on the tiny model: SFT warm start, GRPO on all video families, T-GRPO vs GRPO.

1. A short SFT warm start of the shipped base (image counting only) on templated traces of the
   synthetic video questions (``datasets/video.py``).
2. GRPO from that warm start on all four families (temporal order, direction, event count,
   temporal grounding): held-out accuracy before and after.
3. On the temporal-order family alone: the warm start continues SFT on that family for one more
   arm, then GRPO and T-GRPO (alpha 0.3, mu 1) start from it with the same number of training
   steps, side by side; each is scored on held-out clips with ordered frames and with the clip's
   frames shuffled (a model that uses frame order should drop to chance on the shuffled copy).

Every arm runs in its own process (`perceptrl sft` / `perceptrl train`) with a wall-time cap;
scoring is greedy decoding with the recipe's prompt, accuracy reward only.

    python bench/bench_vlm_video.py [--minutes 4.5] [--steps 90] [--n-test 200]

Writes bench/results/vlm_video.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from common import last_model, machine, metrics, run_arm, write_results

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "vlm_video.yaml"


def train_summary(run_dir: Path, seconds: float) -> dict:
    rows = [r for r in metrics(run_dir) if "time/step" in r]
    out = {"steps": len(rows), "wall_s": round(seconds, 1)}
    if rows:
        out["step_s"] = round(sum(r["time/step"] for r in rows) / len(rows), 2)
        out["peak_rss_mb"] = round(max(r.get("sys/peak_rss_mb", 0.0) for r in rows), 1)
    for k in (
        "reward/mean",
        "reward/accuracy",
        "reward/tgrpo_bonus_rate",
        "reward/tgrpo_acc_ordered",
        "reward/tgrpo_acc_shuffled",
    ):
        vals = [r[k] for r in rows if k in r]
        if vals:
            q = max(1, len(vals) // 4)
            out[k] = {"first_quarter": _mean(vals[:q]), "last_quarter": _mean(vals[-q:])}
    return out


def _mean(xs) -> float:
    return round(float(sum(xs) / len(xs)), 4) if xs else 0.0


def shuffled_copy(src: Path, out_dir: Path, seed: int = 0) -> Path:
    """The same questions on clips whose written frames are randomly permuted."""
    import decord

    from perceptrl.datasets.video import write_mp4

    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    rng = np.random.default_rng(seed)
    out_rows = []
    for r in rows:
        vids = []
        for v in r["videos"]:
            vr = decord.VideoReader(str(src.parent / v))
            frames = vr.get_batch(list(range(len(vr)))).asnumpy()
            perm = rng.permutation(len(frames))
            rel = f"shuffled/{Path(v).name}"
            write_mp4(frames[perm], out_dir / rel, int(round(vr.get_avg_fps())))
            vids.append(rel)
        out_rows.append({**r, "videos": vids})
    path = out_dir / f"{src.stem}_shuffled.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in out_rows))
    return path


def score(model: Path, splits: dict[str, Path], out: Path) -> dict:
    from perceptrl.datasets.loader import load_samples
    from perceptrl.rewards import build_reward
    from perceptrl.vlm.builder import build_policy as vlm_policy
    from perceptrl.vlm.run_plan import resolve
    from perceptrl.vlm.source import evaluate_accuracy
    from perceptrl.wiring import load_config

    cfg = load_config(RECIPE, [f"model.path={model}", "train.device=cpu"])
    policy = vlm_policy(resolve(cfg), out)
    reward = build_reward({"accuracy": 1.0})
    res = {}
    for name, path in splits.items():
        samples = load_samples(path)[0]
        m = evaluate_accuracy(policy, samples, reward, batch_size=64, max_new_tokens=64)
        res[name] = {k: round(v, 4) for k, v in m.items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=4.5, help="wall-time cap of each arm")
    ap.add_argument("--steps", type=int, default=90, help="GRPO / T-GRPO steps (same for both)")
    ap.add_argument(
        "--order-sft-minutes", type=float, default=4.5,
        help="SFT on temporal order before the GRPO/T-GRPO arms (0: start from the warm start)",
    )  # fmt: skip
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-test", type=int, default=200)
    ap.add_argument("--base", default="assets/vlm_base")
    ap.add_argument("--out", default="runs/bench_vlm_video")
    a = ap.parse_args()
    from perceptrl.datasets.video import FAMILIES, generate
    from perceptrl.trainer.runtime import resolve_path

    out = Path(a.out)
    base = resolve_path(a.base)
    data = out / "data"
    t0 = time.perf_counter()
    allp = generate(data / "all", {"train": a.n_train, "test": a.n_test}, seed=1)
    tord = generate(
        data / "order", {"train": a.n_train, "test": a.n_test}, families=["temporal_order"], seed=2
    )
    tord_shuf = shuffled_copy(tord["test"], data / "order")
    gen_s = time.perf_counter() - t0
    common = ["log.progress=false", "train.device=cpu", f"train.time_limit_min={a.minutes}"]

    sft_dir = out / "sft"
    sft_s = run_arm(
        ["sft", str(RECIPE), f"model.path={base}", f"data.train={allp['train']}",
         f"data.val={allp['test']}", "train.steps=100000", "train.lr=1e-3",
         "train.warmup_steps=20", "train.eval_every=0", "train.eval_samples=0", *common],
        sft_dir,
    )  # fmt: skip
    sft_model = last_model(sft_dir)

    grpo_dir = out / "grpo_all"
    grpo_s = run_arm(
        ["train", str(RECIPE), f"model.path={sft_model}", f"data.train={allp['train']}",
         f"data.val={allp['test']}", "train.steps=100000", "train.eval_every=0",
         "train.eval_samples=0", "checkpoint.every=0", *common],
        grpo_dir,
    )  # fmt: skip

    order_start, order_sft, order_sft_s = sft_model, None, 0.0
    if a.order_sft_minutes > 0:
        order_sft = out / "order_sft"
        order_sft_s = run_arm(
            ["sft", str(RECIPE), f"model.path={sft_model}", f"data.train={tord['train']}",
             f"data.val={tord['test']}", "train.steps=100000", "train.lr=1e-3",
             "train.warmup_steps=20", "train.eval_every=0", "train.eval_samples=0", *common[:2],
             f"train.time_limit_min={a.order_sft_minutes}"],
            order_sft,
        )  # fmt: skip
        order_start = last_model(order_sft)
    arms = {}
    for name, alpha in (("grpo", 0.0), ("tgrpo", 0.3)):
        d = out / f"order_{name}"
        s = run_arm(
            ["train", str(RECIPE), f"model.path={order_start}", f"data.train={tord['train']}",
             f"data.val={tord['test']}", f"train.steps={a.steps}", "train.eval_every=0",
             "train.eval_samples=0", "checkpoint.every=0", f"rollout.tgrpo_alpha={alpha}",
             "rollout.tgrpo_mu=1.0", *common],
            d,
        )  # fmt: skip
        arms[name] = {"dir": d, "seconds": s}

    all_splits = {"test": allp["test"]}
    order_splits = {"order_test": tord["test"], "order_test_shuffled": tord_shuf}
    scores = {
        "base": score(base, {**all_splits, **order_splits}, out / "score"),
        "sft": score(sft_model, {**all_splits, **order_splits}, out / "score"),
        "grpo_all": score(last_model(grpo_dir), all_splits, out / "score"),
    }
    if order_sft is not None:
        scores["order_sft"] = score(order_start, order_splits, out / "score")
    for name, arm in arms.items():
        scores[f"order_{name}"] = score(last_model(arm["dir"]), order_splits, out / "score")
    result = {
        "machine": machine(note="shared 2-core development machine; OMP_NUM_THREADS as listed"),
        "settings": {
            "minutes_cap": a.minutes,
            "order_steps": a.steps,
            "n_train": a.n_train,
            "n_test": a.n_test,
            "base": str(a.base),
            "recipe": "configs/vlm_video.yaml",
            "families": list(FAMILIES),
            "data_gen_s": round(gen_s, 1),
        },  # fmt: skip
        "train": {
            "sft": train_summary(sft_dir, sft_s),
            "grpo_all": train_summary(grpo_dir, grpo_s),
            **({"order_sft": train_summary(order_sft, order_sft_s)} if order_sft else {}),
            **{f"order_{k}": train_summary(v["dir"], v["seconds"]) for k, v in arms.items()},
        },
        "scores": scores,
    }
    seeds = {"train": [0], "data": [1, 2], "shuffle": 0}  # train: the recipes' train.seed
    write_results("vlm_video", result, markdown(result), seeds=seeds)
    print(markdown(result))


def _acc(scores: dict, model: str, split: str, fam: str | None = None) -> str:
    m = scores.get(model, {}).get(split)
    if m is None:
        return "–"
    return f"{m['accuracy' if fam is None else f'accuracy/{fam}']:.3f}"


def markdown(r: dict) -> str:
    s, t = r["scores"], r["train"]
    fams = r["settings"]["families"]
    mc = r["machine"]
    lines = [
        "# Video RL on the tiny Qwen2.5-VL (synthetic moving-shape clips)",
        "",
        f"Machine: {mc['cpu']}, {mc['cores']} cores shared with other work, torch {mc['torch']}, "
        f"OMP_NUM_THREADS={mc['OMP_NUM_THREADS'] or 'unset'}. Each arm capped at "
        f"{r['settings']['minutes_cap']} min; greedy scoring on {r['settings']['n_test']} "
        "held-out questions per split, accuracy reward only.",
        "",
        "## Held-out accuracy, all families (before = SFT warm start, after = + GRPO)",
        "",
        "| model | all | " + " | ".join(fams) + " |",
        "|---|---|" + "---|" * len(fams),
    ]
    lines.append("| chance (uniform guess) | – | 0.417 | 0.250 | 0.333 | – |")
    for name, label in (
        ("base", "shipped base"),
        ("sft", "SFT warm start"),
        ("grpo_all", "+ GRPO"),
    ):
        cells = [_acc(s, name, "test")] + [_acc(s, name, "test", f) for f in fams]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Temporal order: GRPO vs T-GRPO, same steps, from the same start",
        "",
        "| model | steps | wall s | ordered frames | shuffled frames | bonus rate (first → last quarter) |",
        "|---|---|---|---|---|---|",
    ]
    lines.append("| chance (2 or 3 options) | – | – | 0.417 | 0.417 | – |")
    for name, label in (
        ("sft", "SFT warm start (all families)"),
        ("order_sft", "+ SFT on temporal order (start of both arms)"),
        ("order_grpo", "GRPO"),
        ("order_tgrpo", "T-GRPO α=0.3 μ=1"),
    ):
        if name not in s:
            continue
        tr = t.get(name, {})
        br = tr.get("reward/tgrpo_bonus_rate")
        brs = f"{br['first_quarter']:.2f} → {br['last_quarter']:.2f}" if br else "–"
        lines.append(
            f"| {label} | {tr.get('steps', '–')} | {tr.get('wall_s', '–')} | "
            f"{_acc(s, name, 'order_test')} | {_acc(s, name, 'order_test_shuffled')} | {brs} |"
        )
    lines += [
        "",
        "## Training arms",
        "",
        "| arm | steps | wall s | s/step | peak RSS MB |",
        "|---|---|---|---|---|",
    ]
    for name, tr in t.items():
        lines.append(
            f"| {name} | {tr['steps']} | {tr['wall_s']} | {tr.get('step_s', '–')} | "
            f"{tr.get('peak_rss_mb', '–')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
