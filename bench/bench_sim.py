"""How fast does a MuJoCo env step (state-only, rendered) against its raw physics?

Simulation throughput: env steps/s for 1, 4 and 8 envs, state-only and with one 128x128 camera,
peak RSS, and raw ``mj_step`` on the same model in the same run.

Run: ``MUJOCO_GL=egl python bench/bench_sim.py [--seconds 3] [--task pick]``. Each configuration
runs in a fresh subprocess (so its peak RSS is its own); results go to
``bench/results/sim_bench.json`` and ``bench/results/sim_bench.md``.
Targets (issue 4): state-only env step within 2x of the raw physics of one env step
(``frame_skip`` x ``mj_step``), measured side by side in one process in alternating slices so that
other load on the machine hits both alike; >= 60 rendered steps/s per process at 128x128.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import machine, write_results


def _machine() -> dict:
    import mujoco

    return machine(mujoco=mujoco.__version__, MUJOCO_GL=os.environ.get("MUJOCO_GL", ""))


def _peak_rss_mb() -> dict:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"peak_rss_mb": round(own, 1), "peak_rss_worker_mb": round(kids, 1)}


def _timed(step, seconds: float) -> tuple[int, float]:
    step()  # warm-up (renderer creation, first contacts)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
    return n, time.perf_counter() - t0


def run_raw(task: str, seconds: float) -> dict:
    """Raw ``mj_step`` on the task's model, from the env's initial state, zero control."""
    import gymnasium as gym
    import mujoco

    from perceptrl.sim import env_id

    env = gym.make(env_id(task), obs_mode="state").unwrapped
    env.reset(seed=0)
    model, data = env.model, env.data
    n, dt = _timed(lambda: mujoco.mj_step(model, data), seconds)
    per_env_step = dt / n * env.cfg.frame_skip
    return {
        "mj_step_per_s": n / dt,
        "frame_skip": env.cfg.frame_skip,
        "raw_env_steps_per_s": 1.0 / per_env_step,
    }


def run_paired(task: str, seconds: float) -> dict:
    """Side by side in one process: state-only ``env.step`` (with gym.make's wrappers) and raw
    ``frame_skip`` x ``mj_step`` on a copy of the same model's data, alternating in 0.2 s slices
    so that a busy machine slows both alike. Returns the time ratio env / raw."""
    import copy

    import gymnasium as gym
    import mujoco
    import numpy as np

    from perceptrl.sim import env_id

    env = gym.make(env_id(task), obs_mode="state")
    env.reset(seed=0)
    inner = env.unwrapped
    model, raw_data, skip = inner.model, copy.copy(inner.data), inner.cfg.frame_skip
    rng = np.random.default_rng(0)
    t_env = t_raw = 0.0
    n_env = n_raw = 0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        n, dt = _timed(lambda: _env_step(env, rng), 0.2)
        n_env, t_env = n_env + n, t_env + dt
        n, dt = _timed(lambda: [mujoco.mj_step(model, raw_data) for _ in range(skip)], 0.2)
        n_raw, t_raw = n_raw + n, t_raw + dt
    env.close()
    env_s, raw_s = t_env / n_env, t_raw / n_raw
    return {"env_step_us": env_s * 1e6, "raw_physics_us": raw_s * 1e6, "ratio": env_s / raw_s}


def _env_step(env, rng) -> None:
    import numpy as np

    _, _, term, trunc, _ = env.step(rng.uniform(-1, 1, 5).astype(np.float32))
    if term or trunc:
        env.reset()


def run_env(task: str, mode: str, n_envs: int, async_: bool, seconds: float) -> dict:
    """Random actions through ``n_envs`` envs (one env: plain gym.make with its wrappers)."""
    import numpy as np

    from perceptrl.sim import env_id
    from perceptrl.sim.vector import make_vec

    kw = {"obs_mode": mode}
    if mode == "rgb":
        kw.update(width=128, height=128, cameras=("agentview",))
    rng = np.random.default_rng(0)
    gid = env_id(task)
    if n_envs == 1 and not async_:
        import gymnasium as gym

        env = gym.make(gid, **kw)
        env.reset(seed=0)

        def step():
            _, _, term, trunc, _ = env.step(rng.uniform(-1, 1, 5).astype(np.float32))
            if term or trunc:
                env.reset()
    else:
        env = make_vec(gid, n_envs, async_=async_, **kw)
        env.reset(seed=0)

        def step():
            env.step(rng.uniform(-1, 1, (n_envs, 5)).astype(np.float32))

    n, dt = _timed(step, seconds)
    workers = [p.pid for p in getattr(env, "processes", [])]
    worker_rss = [_vm_hwm_mb(pid) for pid in workers]
    env.close()
    out = {"env_steps_per_s": n * n_envs / dt, "steps_per_s_per_env": n / dt}
    if worker_rss:
        out["peak_rss_worker_mb"] = round(max(worker_rss), 1)
    return out


def _vm_hwm_mb(pid: int) -> float:
    """Peak resident set of a live process (VmHWM), MB; async workers are forkserver children,
    so ``RUSAGE_CHILDREN`` of this process never sees them."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _one(args) -> None:
    """Child mode: run one configuration, print one JSON line."""
    if args.kind == "raw":
        out = run_raw(args.task, args.seconds)
    elif args.kind == "paired":
        out = run_paired(args.task, args.seconds)
    else:
        out = run_env(args.task, args.mode, args.n, args.async_, args.seconds)
    out = {**_peak_rss_mb(), **out}
    print("RESULT " + json.dumps(out))


def _child(cmd: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, *cmd], capture_output=True, text=True, timeout=600
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"bench child {cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def _markdown(res: dict) -> str:
    m, raw = res["machine"], res["raw"]
    lines = [
        "# Simulation throughput (bench/bench_sim.py)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores visible, MuJoCo {m['mujoco']}, "
        f"MUJOCO_GL={m['MUJOCO_GL']}. Task `{res['task']}`, {res['seconds']} s per row, "
        "random actions, autoreset included. Rows run one after another, each in its own process.",
        "`raw physics / total`: time of one env step relative to its bare physics (`frame_skip` x "
        "`mj_step` on one core); a vector env shares the visible cores among its envs, and async "
        "workers add pipe traffic, so with 2 cores it cannot beat the single env.",
        "",
        f"Raw `mj_step`: {raw['mj_step_per_s']:.0f}/s = {raw['raw_env_steps_per_s']:.0f} "
        f"env-step equivalents/s (frame_skip {raw['frame_skip']}).",
        "",
        "| obs | envs | vector | env steps/s (total) | per env | raw physics / total | peak RSS MB "
        "(main / each worker) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        ratio = raw["raw_env_steps_per_s"] / r["env_steps_per_s"]
        lines.append(
            f"| {r['mode']} | {r['n_envs']} | {r['vector']} | {r['env_steps_per_s']:.0f} | "
            f"{r['steps_per_s_per_env']:.0f} | {ratio:.2f}x | "
            f"{r['peak_rss_mb']:.0f} / {r['peak_rss_worker_mb']:.0f} |"
        )
    t, p = res["targets"], res["paired"]
    lines += [
        "",
        f"Side by side in one process (alternating 0.2 s slices): state-only env step "
        f"{p['env_step_us']:.0f} us vs the raw physics of one env step {p['raw_physics_us']:.0f} "
        f"us = {p['ratio']:.2f}x (this is the ratio the target uses).",
        "",
        f"Targets: state-only single env within 2x of raw physics: "
        f"{t['state_ratio']:.2f}x ({'met' if t['state_ok'] else 'NOT met'}); "
        f">= 60 rendered steps/s per process at 128x128: {t['render_steps_per_s']:.0f}/s "
        f"({'met' if t['render_ok'] else 'NOT met'}).",
        "",
    ]
    return "\n".join(lines)


def main(seconds: float = 3.0, task: str = "pick") -> dict:
    """Run every configuration and write ``sim_bench.json`` / ``sim_bench.md``."""
    base = ["--one", "--task", task, "--seconds", str(seconds)]
    raw = _child([*base, "--kind", "raw"])
    paired = _child([*base, "--kind", "paired"])
    rows = []
    for mode in ("state", "rgb"):
        for n, async_ in ((1, False), (4, False), (8, False), (4, True), (8, True)):
            cmd = [*base, "--kind", "env", "--mode", mode, "--n", str(n)]
            r = _child(cmd + (["--async"] if async_ else []))
            r.update(
                mode=mode, n_envs=n, vector="async" if async_ else ("none" if n == 1 else "sync")
            )
            rows.append(r)
            print(
                f"{mode:>5} n={n} {r['vector']:>5}: {r['env_steps_per_s']:.0f} steps/s", flush=True
            )
    single = {r["mode"]: r for r in rows if r["n_envs"] == 1}
    ratio = paired["ratio"]
    res = {
        "paired": paired,
        "task": task,
        "seconds": seconds,
        "machine": _machine(),
        "raw": raw,
        "rows": rows,
        "targets": {
            "state_ratio": ratio,
            "state_ok": ratio <= 2.0,
            "render_steps_per_s": single["rgb"]["steps_per_s_per_env"],
            "render_ok": single["rgb"]["steps_per_s_per_env"] >= 60,
        },
    }
    write_results("sim_bench", res, _markdown(res), seeds=[0])  # every env reset(seed=0)
    print(_markdown(res))
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="MuJoCo env throughput benchmark")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--task", default="pick")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", default="env", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="state", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--async", dest="async_", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        _one(a)
    else:
        main(a.seconds, a.task)
