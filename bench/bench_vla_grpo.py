"""Does GRPO raise a behaviour-cloning warm start's held-out success on pick?

GRPO from a behaviour-cloning warm start on pick (or put), the SimpleVLA-RL recipe in small.

1. Behaviour cloning of the scripted expert (``configs/vla_bc_pick.yaml``; with ``--policy
   token`` the token VLA's ``configs/vla_bc_token.yaml``) for ``--bc-steps`` steps: a
   deliberately short warm start that succeeds sometimes, as a few-demonstration SFT does.
2. Held-out success of that policy on ``--episodes`` seeds from ``env.eval_seed`` (never used
   in training), deterministic (the Gaussian's mean actions; the token VLA's most likely action
   tokens) and with sampled actions (the policy GRPO trains; sampling seeded).
3. GRPO (``configs/vla_grpo.yaml`` / ``configs/vla_grpo_token.yaml``: groups of episodes from
   the same indexed initial state, sparse success reward, dynamic sampling) from the BC weights
   for ``--minutes``.
4. Held-out success again, on the same seeds.

    MUJOCO_GL=egl python bench/bench_vla_grpo.py [--task perceptrl/Pick-v0] [--minutes 12]
    MUJOCO_GL=egl python bench/bench_vla_grpo.py --policy token --task perceptrl/Reach-v0

Writes bench/results/vla_grpo_<task>.{json,md} (``vla_grpo_token_<task>`` for the token VLA).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import torch  # noqa: E402,F401  (import torch before any rendering)
from common import last_model, machine, metrics, peak_rss_mb, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"compact": ("vla_bc_pick", "vla_grpo"), "token": ("vla_bc_token", "vla_grpo_token")}
"""--policy -> (behaviour-cloning recipe, GRPO recipe)"""
DETERMINISTIC = {"compact": "the Gaussian's mean actions", "token": "the most likely action tokens"}


def success(policy, env_cfg, episodes: int) -> dict[str, float]:
    """Held-out success with mean actions and with sampled actions (seeded)."""
    from perceptrl.vla.evaluate import evaluate_policy

    torch.manual_seed(0)
    sampled = evaluate_policy(policy, env_cfg, episodes=episodes, deterministic=False)
    det = evaluate_policy(policy, env_cfg, episodes=episodes)
    return {"deterministic": det["success_rate"], "sampled": sampled["success_rate"]}


def bc_then_grpo(
    out: Path, bc_recipe: str, bc_overrides: list[str], grpo_recipe: str,
    grpo_overrides: list[str], minutes: float, episodes: int, bc_model: Path | None = None,
) -> dict:  # fmt: skip
    """Behaviour cloning (``configs/<bc_recipe>.yaml`` + overrides) into ``out/bc``, held-out
    `success`, GRPO from the BC weights for ``minutes`` into ``out/grpo``, held-out `success`
    again. Returns ``bc_cfg``, ``grpo_cfg``, ``bc_seconds``, ``grpo_seconds``, ``before``,
    ``after`` and ``steps`` (the GRPO metrics rows of the updates). ``bc_model``: start from
    that saved warm start instead (no BC here; ``bc_seconds`` None)."""
    from perceptrl.vla.builder import build_trainer, load_policy, run_sft
    from perceptrl.wiring import load_config

    bc_cfg = load_config(ROOT / "configs" / f"{bc_recipe}.yaml", bc_overrides)
    bc_s = None
    if bc_model is None:
        t0 = time.perf_counter()
        run_sft(bc_cfg, out / "bc")
        bc_s = time.perf_counter() - t0
        bc_model = last_model(out / "bc")
    before = success(load_policy(bc_model), bc_cfg.env, episodes)
    print(f"{out.name}: BC {bc_model} -> {before}", flush=True)
    grpo_cfg = load_config(
        ROOT / "configs" / f"{grpo_recipe}.yaml",
        [f"model.path={bc_model}", f"train.time_limit_min={minutes}", "train.steps=100000",
         "checkpoint.every=0", *grpo_overrides],
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer = build_trainer(grpo_cfg, out / "grpo")
    trainer.fit()
    grpo_s = time.perf_counter() - t0
    trainer.source.close()
    return {
        "bc_cfg": bc_cfg, "grpo_cfg": grpo_cfg, "bc_seconds": bc_s, "grpo_seconds": grpo_s,
        "before": before, "after": success(trainer.policy, grpo_cfg.env, episodes),
        "steps": [r for r in metrics(out / "grpo") if "time/step" in r],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="perceptrl/Pick-v0")
    ap.add_argument("--policy", choices=sorted(RECIPES), default="compact")
    ap.add_argument("--bc-steps", type=int, default=60, help="behaviour-cloning steps")
    ap.add_argument("--minutes", type=float, default=12.0, help="GRPO wall time")
    ap.add_argument("--episodes", type=int, default=200, help="held-out evaluation episodes")
    ap.add_argument("--out", default="runs/bench_vla_grpo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bc-model", type=Path, default=None,
                    help="a saved warm start to begin from (no BC here)")  # fmt: skip
    ap.add_argument("--bc-note", default="", help="how --bc-model was trained (for the report)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for the GRPO recipe")
    args = ap.parse_args(argv)

    from perceptrl.vla.evaluate import task_name

    out = Path(args.out)
    task = task_name(args.task)
    common = [f"env.id={args.task}", f"train.seed={args.seed}", "log.progress=false",
              "log.tensorboard=false"]  # fmt: skip
    bc_recipe, grpo_recipe = RECIPES[args.policy]
    run = bc_then_grpo(
        out, bc_recipe,
        [*common, f"train.steps={args.bc_steps}", "train.eval_every=0", "checkpoint.every=0"],
        grpo_recipe, [*common, *args.overrides], args.minutes, args.episodes, args.bc_model,
    )  # fmt: skip
    grpo_cfg, steps = run["grpo_cfg"], run["steps"]
    before, after, bc_s, grpo_s = (
        run["before"],
        run["after"],
        run["bc_seconds"],
        run["grpo_seconds"],
    )
    curve = [
        {"step": r["step"], "success": r["eval/success_rate"]}
        for r in metrics(out / "grpo")
        if "eval/success_rate" in r
    ]
    data = {
        "machine": machine(),
        "task": args.task,
        "policy": args.policy,
        "settings": {
            "bc_steps": args.bc_steps,
            "bc_model": str(args.bc_model) if args.bc_model else None,
            "bc_note": args.bc_note,
            "grpo_minutes": args.minutes,
            "episodes": args.episodes,
            "eval_seed": grpo_cfg.env.eval_seed,
            "seed": args.seed,
            "overrides": args.overrides,
            "group_size": grpo_cfg.rollout.group_size,
            "groups_per_step": grpo_cfg.rollout.prompts_per_step,
        },  # fmt: skip
        "bc_seconds": None if bc_s is None else round(bc_s, 1),
        "grpo_seconds": round(grpo_s, 1),
        "grpo_steps": len(steps),
        "success_before": before,
        "success_after": after,
        "gain_points": {k: round(100 * (after[k] - before[k]), 1) for k in before},
        "train_success_curve": [
            {"step": r["step"], "success": r.get("rollout/success_rate", r.get("reward/mean"))}
            for r in steps
        ],
        "eval_curve": curve,
        "mean_step_s": round(sum(r["time/step"] for r in steps) / max(len(steps), 1), 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    m = data["machine"]
    bc_text = (f"{args.bc_steps} steps, {bc_s / 60:.1f} min" if bc_s is not None
               else args.bc_note or str(args.bc_model))  # fmt: skip
    md = [
        f"# GRPO from a behaviour-cloning warm start: {task}"
        + (" (token VLA)" if args.policy == "token" else ""),
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores (shared with other work during the run), "
        f"torch {m['torch']}.",
        "",
        f"Held-out success, {args.episodes} episodes from seed {grpo_cfg.env.eval_seed}, with "
        f"{DETERMINISTIC[args.policy]} (deterministic) and with sampled actions:",
        "",
        "| model | deterministic | sampled actions |",
        "|---|---|---|",
        f"| BC warm start ({bc_text}) | {before['deterministic']:.3f} | {before['sampled']:.3f} |",
        f"| + GRPO ({len(steps)} steps, {grpo_s / 60:.1f} min) | {after['deterministic']:.3f} | "
        f"{after['sampled']:.3f} |",
        "",
        f"Gain: **{data['gain_points']['deterministic']:+.1f} points** deterministic, "
        f"**{data['gain_points']['sampled']:+.1f}** sampled. GRPO: {data['settings']['groups_per_step']} "
        f"initial states x {data['settings']['group_size']} episodes per step, sparse success "
        f"reward, dynamic sampling; mean step {data['mean_step_s']} s; peak RSS "
        f"{data['peak_rss_mb']} MB.",
    ]
    if curve:
        md += ["", "| GRPO step | held-out success, deterministic (eval_episodes) |", "|---|---|"]
        md += [f"| {c['step']} | {c['success']:.3f} |" for c in curve]
    name = "vla_grpo_" + ("token_" if args.policy == "token" else "") + task.lower()
    seeds = {"train": [args.seed], "eval": grpo_cfg.env.eval_seed}
    js, mdp = write_results(name, data, "\n".join(md), seeds=seeds)
    print("\n".join(md))
    print(f"\nwrote {js} and {mdp}")


if __name__ == "__main__":
    main()
