"""How many env steps/s does VLA collection reach, policy inference included, at what RSS?

VLA collection throughput: env steps/s including policy inference, and peak RSS.

Runs the PPO collector of ``configs/vla_ppo_reach.yaml`` (two 64x64 cameras, the compact VLA with
its keypoint encoder, on the CPU) for ``--rollouts`` collections at each number of envs, each
setting in its own process so its peak RSS is its own. Writes
``bench/results/vla_collect.{json,md}``.

    MUJOCO_GL=egl python bench/bench_vla_collect.py --envs 8 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

from common import machine, peak_rss_mb, write_results  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "vla_ppo_reach.yaml"


def measure(num_envs: int, rollouts: int) -> dict:
    """One setting, in this process: ``rollouts`` collections after one warm-up collection."""
    import torch  # before any rendering

    from perceptrl.vla.builder import build_policy, build_source
    from perceptrl.vla.envs import make_envs
    from perceptrl.vla.run_plan import resolve
    from perceptrl.wiring import load_config

    cfg = load_config(RECIPE, [f"env.num_envs={num_envs}", "train.device=cpu"])
    plan = resolve(cfg)
    runner = make_envs(plan.env, seed=0)
    policy = build_policy(plan.policy, runner)
    source = build_source(plan.collect, runner)
    source.collect(policy, 0)  # warm-up: renderers, first resets
    steps, t0 = 0, time.perf_counter()
    for i in range(rollouts):
        batch, _ = source.collect(policy, i + 1)
        steps += int(batch.mask.sum()) * cfg.env.action_chunk
    seconds = time.perf_counter() - t0
    source.close()
    return {
        "num_envs": num_envs, "rollouts": rollouts, "env_steps": steps,
        "seconds": round(seconds, 2), "env_steps_per_s": round(steps / seconds, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1), "torch_threads": torch.get_num_threads(),
        "steps_per_rollout": cfg.env.steps_per_rollout, "cameras": list(cfg.env.cameras),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envs", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--rollouts", type=int, default=40, help="timed collections per setting")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # worker: one setting, JSON out
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.rollouts)))
        return
    rows = []
    for n in args.envs:
        cmd = [sys.executable, __file__, "--one", str(n), "--rollouts", str(args.rollouts)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    result = {"recipe": "configs/vla_ppo_reach.yaml", "rows": rows, "machine": machine()}
    m = result["machine"]
    lines = [
        "# VLA collection throughput (PPO collector, compact VLA, 2 cameras 64x64, CPU)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} "
        f"({rows[0]['torch_threads']} threads). Recipe `{result['recipe']}` (keypoint encoder, "
        f"cameras {rows[0]['cameras']}, {rows[0]['steps_per_rollout']} steps per env per "
        "collection); env steps/s include rendering, policy inference on the CPU and episode "
        "bookkeeping; each setting ran in its own process (its own peak RSS), after one "
        "warm-up collection.",
        "",
        "| envs | timed collections | env steps | env steps/s | peak RSS (MB) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['num_envs']} | {r['rollouts']} | {r['env_steps']} | {r['env_steps_per_s']} "
        f"| {r['peak_rss_mb']} |"
        for r in rows
    ]
    write_results("vla_collect", result, "\n".join(lines), seeds=[0])  # the envs' seed


if __name__ == "__main__":
    main()
