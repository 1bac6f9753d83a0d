"""Does a pipelined trainer (one_step_off, async) process more samples/s than sync?

``train.pipeline`` side by side: sync vs one_step_off vs async at equal wall time.

For one side (``--side vlm``: GRPO on the counting task from the shipped base, the
``vlm_clevr`` recipe; ``--side vla``: pixel PPO on reach, the ``vla_ppo_reach`` recipe), each
arm trains for ``--minutes`` in its own process, one after the other, then evaluates on the
recipe's held-out set. Reported per arm: training steps, samples per second (VLM: completions;
VLA: env steps), the trainer's wait for data, the workers' idle time, the staleness seen, and
the held-out result at the end.

Cores (2 on the development machine): ``sync`` runs rollout and update in one process with 2
torch threads; the pipelined arms run the trainer with 1 thread and ``--workers`` rollout
workers with 1 thread each (``rollout.worker_cpus=1``), so rollout and update each get a core
and overlap instead of taking turns.

    python bench/bench_pipeline.py --side vlm --minutes 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import machine, write_results

MODES = ("sync", "one_step_off", "async")
RECIPES = {"vlm": "vlm_clevr", "vla": "vla_ppo_reach"}
EXTRA = {
    "vlm": ["algo.dynamic_sampling=false", "checkpoint.every=0"],
    "vla": ["checkpoint.every=0", "train.device=cpu"],
}


def run_arm(side: str, mode: str, args, out: Path) -> dict:
    """Train one arm in its own process; returns its summary from metrics.jsonl."""
    run_dir = out / f"{side}_{mode}"
    overrides = [
        f"train.pipeline={mode}", f"train.time_limit_min={args.minutes}", "train.steps=100000",
        "train.eval_every=0", "log.progress=false", "log.tensorboard=false", *EXTRA[side],
    ]  # fmt: skip
    if mode != "sync":
        overrides += [
            f"rollout.workers={args.workers}", "rollout.worker_cpus=1",
            f"train.max_staleness={args.max_staleness}", f"algo.tis_cap={args.tis_cap}",
        ]  # fmt: skip
    threads = "2" if mode == "sync" else "1"
    env = {**os.environ, "OMP_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1", "MUJOCO_GL": "egl"}
    cmd = [sys.executable, "-m", "perceptrl.cli", "train", RECIPES[side], *overrides]
    shutil.rmtree(run_dir, ignore_errors=True)  # the CLI refuses to start over an earlier run
    t = time.perf_counter()
    subprocess.run([*cmd, "--run-dir", str(run_dir)], check=True, env=env)
    wall = time.perf_counter() - t
    return summarize(side, mode, run_dir, wall)


def summarize(side: str, mode: str, run_dir: Path, wall: float) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    key = "eval/accuracy" if side == "vlm" else "eval/success_rate"
    train_s = sum(r["time/step"] for r in steps)
    if side == "vlm":
        samples = sum(r.get("rollout/samples", 0.0) for r in steps)
    else:
        samples = sum(r.get("rollout/env_steps", 0.0) for r in steps)

    def mean(k):
        vals = [r[k] for r in steps if k in r]
        return sum(vals) / len(vals) if vals else None

    return {
        "mode": mode, "steps": len(steps), "train_seconds": round(train_s, 1),
        "wall_seconds": round(wall, 1), "samples": samples,
        "samples_per_s": round(samples / max(train_s, 1e-9), 3),
        "trainer_wait_s_per_step": mean("pipeline/trainer_wait_s") or mean("time/collect"),
        "update_s_per_step": mean("time/forward_backward"),
        "worker_idle_s_total": steps[-1].get("pipeline/worker_idle_s_total") if steps else None,
        "staleness_mean": mean("pipeline/staleness_mean"),
        "staleness_max": max((r.get("pipeline/staleness_max", 0.0) for r in steps), default=0.0),
        "dropped_stale": steps[-1].get("pipeline/dropped_stale", 0.0) if steps else 0.0,
        "held_out_start": evals[0].get(key) if evals else None,
        "held_out_end": evals[-1].get(key) if evals else None,
    }  # fmt: skip


def report(side: str, arms: list[dict], args) -> str:
    sync = next((a for a in arms if a["mode"] == "sync"), None)
    what = "completions" if side == "vlm" else "env steps"
    lines = [
        f"# train.pipeline side by side: {RECIPES[side]} ({side})",
        "",
        f"Machine: {machine()['cpu']}, {os.cpu_count()} cores; each arm {args.minutes} min of "
        f"training in its own process, one after the other; pipelined arms: trainer 1 torch "
        f"thread + {args.workers} rollout worker(s) with 1 thread each, max_staleness "
        f"{args.max_staleness}, tis_cap {args.tis_cap}; sync: one process, 2 threads.",
        "",
        f"| mode | steps | {what}/s | x sync | trainer wait s/step | update s/step | "
        "staleness mean / max | dropped stale | held-out start -> end |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for a in arms:
        ratio = a["samples_per_s"] / sync["samples_per_s"] if sync else float("nan")
        lines.append(
            f"| {a['mode']} | {a['steps']} | {a['samples_per_s']:.2f} | {ratio:.2f} | "
            f"{_f(a['trainer_wait_s_per_step'])} | {_f(a['update_s_per_step'])} | "
            f"{_f(a['staleness_mean'])} / {a['staleness_max']:.0f} | {a['dropped_stale']:.0f} | "
            f"{_f(a['held_out_start'], 3)} -> {_f(a['held_out_end'], 3)} |"
        )
    return "\n".join(lines)


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", choices=sorted(RECIPES), default="vlm")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--tis-cap", type=float, default=2.0)
    ap.add_argument("--out", default="runs/bench_pipeline")
    args = ap.parse_args(argv)
    from perceptrl.cli import CONFIGS
    from perceptrl.wiring import load_config

    out = Path(args.out)
    arms = [run_arm(args.side, m, args, out) for m in args.modes.split(",")]
    settings = {k: v for k, v in vars(args).items() if k != "out"}  # no local paths in results
    data = {"machine": machine(), "side": args.side, "args": settings, "arms": arms}
    seeds = [load_config(CONFIGS / f"{RECIPES[args.side]}.yaml").train.seed]  # the recipe's
    paths = write_results(f"pipeline_{args.side}", data, report(args.side, arms, args), seeds=seeds)
    print(Path(paths[1]).read_text())


if __name__ == "__main__":
    main()
