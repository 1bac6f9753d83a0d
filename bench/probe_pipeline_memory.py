"""Probe: the trainer's memory after each step of a short VLA pixel-PPO run, sync or pipelined.

The committed pipeline benchmark (bench/results/pipeline_vla.md) shows the pipelined trainer's
peak RSS at about twice sync's. This prints, after every step, RSS split into private (USS),
proportional (PSS) and shared pages (the Ray object store's mapping is shared memory), and the
peak so far, so the parts can be told apart. Try it with glibc settings in the environment, e.g.
``MALLOC_MMAP_THRESHOLD_=131072`` (a fixed mmap threshold: freed large blocks go back to the
system) or ``MALLOC_ARENA_MAX=2``.

    MUJOCO_GL=egl OMP_NUM_THREADS=1 python bench/probe_pipeline_memory.py one_step_off [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pipeline", choices=("sync", "one_step_off", "async"))
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()

    import psutil

    from perceptrl.cli import CONFIGS
    from perceptrl.vla.run import build_trainer
    from perceptrl.wiring import load_config

    cfg = load_config(
        CONFIGS / "vla_ppo_reach.yaml",
        ["checkpoint.every=0", "train.device=cpu", f"train.steps={args.steps}",
         f"train.pipeline={args.pipeline}", "rollout.workers=1", "log.progress=false",
         "log.tensorboard=false", "env.eval_episodes=0", "algo.tis_cap=2"],
    )  # fmt: skip
    proc = psutil.Process()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(cfg, run_dir)
        step = trainer.train_step

        def measured_step():
            metrics = step()
            mem = proc.memory_full_info()
            mb = {k: getattr(mem, k) >> 20 for k in ("rss", "uss", "pss", "shared")}
            print(json.dumps({"step": trainer.step, **mb,
                              "peak_rss": round(metrics.get("sys/peak_rss_mb", 0))}), flush=True)  # fmt: skip
            return metrics

        trainer.train_step = measured_step
        try:
            trainer.fit()
        finally:
            if hasattr(trainer.source, "close"):
                trainer.source.close()


if __name__ == "__main__":
    main()
