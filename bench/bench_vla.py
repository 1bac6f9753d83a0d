"""Does PPO teach the compact VLA reach from pixels and instruction in 30 minutes on 2 cores?

PPO with the compact VLA from pixels + instruction on the reach task.

Trains ``configs/vla_ppo_reach.yaml`` through the shared Trainer for ``--minutes`` and records
held-out success over time (deterministic actions, seeds ``env.eval_seed + i``; the final
evaluation uses ``--final-episodes`` >= 200 episodes), collection throughput (env steps/s
including policy inference, ``env.num_envs`` envs) and peak RSS. Writes
``bench/results/vla_ppo_reach.json`` and ``.md`` with the machine noted.

    MUJOCO_GL=egl OMP_NUM_THREADS=2 python bench/bench_vla.py --minutes 30
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import torch  # noqa: E402  (import torch before any rendering)
from common import RESULTS, machine, peak_rss_mb, write_results  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "vla_ppo_reach.yaml"


def run(minutes: float, final_episodes: int, eval_every: int, overrides: list[str]) -> dict:
    from perceptrl.vla.builder import build_trainer
    from perceptrl.vla.evaluate import evaluate_policy
    from perceptrl.wiring import load_config

    cfg = load_config(
        RECIPE,
        [f"train.time_limit_min={minutes}", f"train.eval_every={eval_every}",
         "log.progress=false", "log.tensorboard=false", *overrides],
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        trainer = build_trainer(cfg, tmp)
        trainer.fit()
        train_s = time.perf_counter() - t0
        rows = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    final = evaluate_policy(trainer.policy, cfg.env, episodes=final_episodes)
    trainer.source.close()
    curve, t_acc = [], 0.0
    for r in rows:
        t_acc += r.get("time/step", 0.0) + r.get("time/eval", 0.0)
        if "eval/success_rate" in r:
            curve.append({"step": r["step"], "minutes": round(t_acc / 60, 2),
                          "success": r["eval/success_rate"]})  # fmt: skip
    sps = [r["rollout/env_steps_per_s"] for r in rows if "rollout/env_steps_per_s" in r]
    upd = [r["time/forward_backward"] + r["time/optimizer"] for r in rows if "time/optimizer" in r]
    steps = [r["time/step"] for r in rows if "time/step" in r]
    return {
        "recipe": "configs/vla_ppo_reach.yaml", "overrides": overrides,
        "minutes_budget": minutes, "train_seconds": round(train_s, 1),
        "train_steps": len(steps), "env_steps": len(steps) * cfg.env.num_envs
        * cfg.env.steps_per_rollout * cfg.env.action_chunk,
        "final_success": final["success_rate"], "final_episodes": final_episodes,
        "curve": curve,
        "collect_env_steps_per_s": round(sum(sps) / max(len(sps), 1), 1),
        "update_fraction_of_step": round(sum(upd) / max(sum(steps), 1e-9), 3),
        "num_envs": cfg.env.num_envs, "peak_rss_mb": round(peak_rss_mb(), 1),
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "machine": machine(torch_threads=torch.get_num_threads(), device=str(cfg.train.device)),
    }  # fmt: skip


def write(result: dict, name: str = "vla_ppo_reach", rewrite: bool = False) -> None:
    m = result["machine"]
    lines = [
        f"# {name}: PPO, compact VLA from 64x64 pixels + instruction, reach",
        "",
        f"Machine: {m['cpu']}, {m.get('cores', m.get('cores_visible'))} cores visible, torch "
        f"{m['torch']} ({m['torch_threads']} threads), {m['device']}"
        + (
            f"; 1/5/15-min load average at the end {result['load_average_after']}"
            if "load_average_after" in result
            else ""
        )
        + ".",
        "",
        f"Recipe: `{result['recipe']}`"
        + (f" with `{' '.join(result['overrides'])}`" if result["overrides"] else "")
        + ".",
        "",
        f"- training: {result['train_seconds'] / 60:.1f} min, {result['train_steps']} PPO steps, "
        f"{result['env_steps']} env steps",
        f"- final held-out success ({result['final_episodes']} episodes, deterministic): "
        f"**{result['final_success']:.3f}**",
        f"- collection: {result['collect_env_steps_per_s']} env steps/s with inference "
        f"({result['num_envs']} envs); PPO update = {result['update_fraction_of_step']:.0%} of "
        "step time",
        f"- peak RSS: {result['peak_rss_mb']} MB",
        "",
        "| step | minutes | held-out success |",
        "|---|---|---|",
    ]
    lines += [f"| {c['step']} | {c['minutes']} | {c['success']:.3f} |" for c in result["curve"]]
    if result.get("note"):
        lines += ["", f"Note: {result['note']}"]
    seed = next(
        (int(o.split("=", 1)[1]) for o in result["overrides"] if o.startswith("train.seed=")), 0
    )  # fmt: skip  (else the recipe's: 0)
    seeds = {"train": [seed], "eval": "env.eval_seed + i"}
    write_results(name, result, "\n".join(lines), seeds=seeds, keep_provenance=rewrite)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--final-episodes", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument(
        "--note", default="", help="free text added to the Markdown (e.g. machine load)"
    )
    ap.add_argument("--rewrite", action="store_true", help="only rewrite the .md from the .json")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = ap.parse_args(argv)
    if args.rewrite:
        result = json.loads((RESULTS / "vla_ppo_reach.json").read_text())
        result["note"] = args.note or result.get("note", "")
        write(result, rewrite=True)
        return
    result = run(args.minutes, args.final_episodes, args.eval_every, args.overrides)
    result["note"] = args.note
    write(result)
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}, indent=1))


if __name__ == "__main__":
    main()
