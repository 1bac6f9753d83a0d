"""How many env steps/s do CPU MuJoCo and MJWarp give, with and without rendering?

Batched simulation: env steps/s of CPU MuJoCo against MJWarp, with and without rendering.

Both backends run the way collection runs them: `sim.vector.VecEnv` steps N envs of a task
with random delta-EE actions, episodes end at the time limit and restart by masked resets.
"state" renders nothing; "rgb" renders two 64x64 cameras (agent view + wrist) every step.

* CPU (default, ``--device cpu``): for each N in ``--worlds`` both backends in one process,
  alternating timed slices (``--rounds`` of each) so that other load hits both alike. Writes
  ``bench/results/sim_warp.{json,md}``.
* GPU (``--device cuda``, run by ``make gpu-lane``): MJWarp only, N up to 8192, plus the PPO
  collector of ``configs/vla_ppo_reach_warp.yaml`` (compact VLA on the same device). Writes
  ``bench/results/gpu_sim_warp.{json,md}``. A machine without CUDA or without warp-lang gets a
  record saying so and exit status 0 (the lane goes on).

    MUJOCO_GL=egl python bench/bench_sim_warp.py --worlds 4 16 64
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

from common import machine, write_results  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "vla_ppo_reach_warp.yaml"
GOAL = 20_000
"""GPU goal: rendered env steps/s at 64x64 with two cameras (issue 18)"""
SEEDS = [0]
"""every runner's seed (initial states and random actions)"""


def make_runner(backend: str, task: str, n: int, mode: str, device: str):
    import perceptrl.sim  # noqa: F401
    from perceptrl.sim import env_id
    from perceptrl.vla.config import EnvConfig
    from perceptrl.vla.envs import make_envs

    cfg = EnvConfig(
        id=env_id(task), num_envs=n, obs_mode=mode, image_size=64,
        cameras=["agentview", "wrist"], backend=backend, device=device,
    )  # fmt: skip
    runner = make_envs(cfg, seed=0)
    runner.reset()
    return runner


def timed(runner, seconds: float, min_steps: int = 2) -> tuple[int, float]:
    """Env steps (N per step) and seconds of random actions for at least ``seconds``; envs
    whose episode ends are reset by the runner (its masked "park" reset), as in collection."""
    import numpy as np

    rng = np.random.default_rng(0)
    steps, t0 = 0, time.perf_counter()
    while steps < min_steps or time.perf_counter() - t0 < seconds:
        a = rng.uniform(-1, 1, (runner.n, 1, runner.action_dim)).astype(np.float32)
        runner.step(a)
        steps += 1
    return steps * runner.n, time.perf_counter() - t0


def measure_pair(task: str, n: int, mode: str, seconds: float, rounds: int) -> dict:
    """Both backends, ``rounds`` alternating slices of ``seconds / rounds`` each."""
    runners = {b: make_runner(b, task, n, mode, "cpu") for b in ("mujoco", "warp")}
    for r in runners.values():
        timed(r, 0.0, min_steps=1)  # warm-up: kernels, renderers, first contacts
    total = {b: [0, 0.0] for b in runners}
    for _ in range(rounds):
        for b, r in runners.items():
            s, t = timed(r, seconds / rounds)
            total[b][0] += s
            total[b][1] += t
    for r in runners.values():
        r.close()
    rate = {b: s / t for b, (s, t) in total.items()}
    return {
        "worlds": n, "mode": mode, "mujoco_env_steps_per_s": round(rate["mujoco"], 1),
        "warp_env_steps_per_s": round(rate["warp"], 1),
        "warp_over_mujoco": round(rate["warp"] / rate["mujoco"], 4),
        "warp_world_substeps_per_s": round(rate["warp"] * 25, 1),
        "seconds_each": round(total["mujoco"][1], 1),
    }  # fmt: skip


def measure_warp(task: str, n: int, mode: str, seconds: float, device: str) -> dict:
    import torch

    runner = make_runner("warp", task, n, mode, device)
    timed(runner, 0.0, min_steps=2)  # warm-up (kernels, CUDA graph capture)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps, t = timed(runner, seconds)  # each step ends in a host copy: already synchronised
    runner.close()
    return {
        "worlds": n,
        "mode": mode,
        "env_steps_per_s": round(steps / t, 1),
        "seconds": round(t, 2),
    }


def measure_collect(n: int, rollouts: int, device: str) -> dict:
    """The PPO collector of the warp recipe with the compact VLA on ``device``."""
    import torch

    from perceptrl.vla.builder import build_policy, build_source
    from perceptrl.vla.envs import make_envs
    from perceptrl.vla.run_plan import resolve
    from perceptrl.wiring import load_config

    cfg = load_config(RECIPE, [f"env.num_envs={n}", f"env.device={device}",
                               f"train.device={device}"])  # fmt: skip
    plan = resolve(cfg)
    runner = make_envs(plan.env, seed=0)
    policy = build_policy(plan.policy, runner)
    source = build_source(plan.collect, runner)
    source.collect(policy, 0)
    steps, t0 = 0, time.perf_counter()
    for i in range(rollouts):
        batch, _ = source.collect(policy, i + 1)
        steps += int(batch.mask.sum())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    source.close()
    return {"worlds": n, "rollouts": rollouts, "env_steps": steps, "seconds": round(seconds, 2),
            "env_steps_per_s": round(steps / seconds, 1)}  # fmt: skip


def cpu_report(args) -> None:
    import mujoco

    from perceptrl.sim.mjwarp import import_warp

    wp, mjw = import_warp()
    rows = []
    for n in args.worlds:
        for mode in ("state", "rgb"):
            rows.append(measure_pair(args.task, n, mode, args.seconds, args.rounds))
            print(rows[-1], flush=True)
    m = machine(mujoco=mujoco.__version__, warp=wp.__version__,
                mujoco_warp=getattr(mjw, "__version__", "4.0.0"))  # fmt: skip
    result = {"task": args.task, "device": "cpu", "rows": rows, "machine": m}
    lines = [
        f"# CPU MuJoCo against MJWarp on warp's CPU device ({args.task})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; mujoco {m['mujoco']}, warp {m['warp']}. "
        "`VecEnv` stepping N envs with random delta-EE actions (episodes restart by masked "
        "resets); rgb renders two 64x64 cameras per step (MuJoCo: EGL/Mesa per env; MJWarp: "
        f"its ray tracer, all worlds in one launch). Alternating slices, {args.rounds} of each "
        "backend per row, after a warm-up step (kernels compiled and cached beforehand).",
        "",
        "| worlds | obs | CPU MuJoCo env steps/s | MJWarp (CPU) env steps/s | MJWarp / MuJoCo |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['worlds']} | {r['mode']} | {r['mujoco_env_steps_per_s']} | "
        f"{r['warp_env_steps_per_s']} | {r['warp_over_mujoco']:.3f} |"
        for r in rows
    ]
    lines += [
        "",
        "On warp's CPU device MJWarp's throughput grows with the number of worlds (its cost "
        "is mostly per kernel launch, and a step launches many), but it stays below CPU "
        "MuJoCo's at these sizes: it is the correctness lane (what CI has), not a fast path. "
        "On a CPU, use env.backend=mujoco.",
    ]
    write_results(args.name or "sim_warp", result, "\n".join(lines), seeds=SEEDS)


def gpu_report(args) -> None:
    import torch

    name = args.name or "gpu_sim_warp"
    record = {"device": args.device, "machine": machine()}
    try:
        from perceptrl.sim.mjwarp import import_warp

        wp, _ = import_warp()
    except ImportError as e:
        record["skipped"] = f"warp is not importable here ({e})"
    else:
        if not torch.cuda.is_available() or wp.get_cuda_device_count() == 0:
            record["skipped"] = "no CUDA device visible to torch and warp"
    if "skipped" in record:
        print(f"bench_sim_warp: skipped: {record['skipped']}", flush=True)
        write_results(
            name, record, f"# MJWarp on a GPU: skipped\n\n{record['skipped']}\n", seeds=SEEDS
        )
        return
    rows, collect = [], []
    for n in args.worlds:
        for mode in ("state", "rgb"):
            rows.append(measure_warp(args.task, n, mode, args.seconds, args.device))
            print(rows[-1], flush=True)
    for n in args.collect_worlds:
        collect.append(measure_collect(n, args.rollouts, args.device))
        print(collect[-1], flush=True)
    best = max((r["env_steps_per_s"] for r in rows if r["mode"] == "rgb"), default=0.0)
    record.update(task=args.task, rows=rows, collect=collect, goal_rgb_env_steps_per_s=GOAL,
                  goal_met=best >= GOAL, warp=wp.__version__)  # fmt: skip
    lines = [
        f"# MJWarp on {record['machine'].get('cuda')} ({args.task})",
        "",
        f"Goal: >= {GOAL} rendered env steps/s at 64x64 with two cameras: "
        f"{'met' if best >= GOAL else 'not met'} (best {best}).",
        "",
        "| worlds | obs | env steps/s |",
        "|---|---|---|",
    ]
    lines += [f"| {r['worlds']} | {r['mode']} | {r['env_steps_per_s']} |" for r in rows]
    lines += ["", "PPO collection (vla_ppo_reach_warp, compact VLA on the same device):", "",
              "| worlds | env steps/s |", "|---|---|"]  # fmt: skip
    lines += [f"| {c['worlds']} | {c['env_steps_per_s']} |" for c in collect]
    write_results(name, record, "\n".join(lines), seeds=SEEDS)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu (both backends) | cuda (warp only)")
    ap.add_argument("--task", default="pick")
    ap.add_argument("--worlds", type=int, nargs="+")
    ap.add_argument("--collect-worlds", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--seconds", type=float, default=12.0, help="timed seconds per row/backend")
    ap.add_argument("--rounds", type=int, default=3, help="alternating slices per backend (CPU)")
    ap.add_argument("--rollouts", type=int, default=5, help="timed collections (GPU)")
    ap.add_argument("--name", help="result file name (default sim_warp / gpu_sim_warp)")
    args = ap.parse_args(argv)
    import torch  # noqa: F401  (before any rendering)

    if args.device == "cpu":
        args.worlds = args.worlds or [4, 16, 64]
        cpu_report(args)
    else:
        args.worlds = args.worlds or [256, 1024, 4096, 8192]
        gpu_report(args)


if __name__ == "__main__":
    main()
