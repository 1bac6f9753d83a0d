"""Does off-policy learning need fewer env steps than PPO, and does DSRL lift a BC flow policy?

Three questions, each on held-out seeds (``env.eval_seed`` = `HELD_OUT`, never used in training
nor in choosing the settings, which were tuned on the recipes' default evaluation seeds):

1. **Reach from entity poses: env steps to 90% held-out success.** PPO
   (``configs/vla_ppo_reach_state.yaml``), SAC (``configs/vla_sac_reach_state.yaml``) and SAC
   with ``--demos`` scripted-expert episodes in the buffer (RLPD: half of every batch), each for
   ``--seeds`` training seeds, evaluated every ``--eval-every`` trainer steps on ``--episodes``
   held-out episodes until ``--ppo-steps`` / ``--sac-steps`` trainer steps. Reported: the env
   steps and wall minutes at the first evaluation at or above 90% (or the best success within
   the budget).
2. **Pick: DSRL on a behaviour-cloned flow policy.** Behaviour cloning of the scripted expert
   into the flow head (``configs/vla_bc_flow.yaml`` for ``--bc-steps``: a short warm start that
   succeeds sometimes), its held-out success (deterministic: the ODE from zero noise), then
   DSRL (``configs/vla_dsrl_pick.yaml``) for ``--dsrl-steps``, and held-out success again
   (deterministic: the actor's mean noise). The flow weights are checked bit-identical.
3. **Pick from entity poses with SAC and demonstrations** (``configs/vla_sac_pick.yaml``, RLPD
   from the start) for ``--sac-steps``, evaluated as in 1: does it learn pick without a
   behaviour-cloned warm start?

    MUJOCO_GL=egl python bench/bench_vla_offpolicy.py [--seeds 0 1]
        [--part reach|pick|sac-pick|all]
        [--reuse]     # keep the arms already finished under --out (a run cut short goes on)
        [--report]    # only re-render bench/results/vla_offpolicy.md from its JSON

Writes bench/results/vla_offpolicy.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import torch  # noqa: E402  (import torch before any rendering)
from common import (  # noqa: E402
    RESULTS,
    last_model,
    logged_seconds,
    machine,
    metrics,
    write_results,
)

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = 3_000_000
"""first held-out evaluation seed (the recipes' own evaluations, used for tuning, start at
``env.eval_seed`` = 1,000,000)"""
TARGET = 0.9
LEVELS = (0.25, 0.5, TARGET)
"""held-out success levels whose first env step the report gives"""
QUIET = ["log.progress=false", "log.tensorboard=false", "log.rollouts_every=0"]


def train(recipe: str, overrides: list[str], run_dir: Path):
    """``perceptrl train <recipe>`` in this process; the finished trainer and its seconds."""
    from perceptrl.vla.builder import build_trainer
    from perceptrl.wiring import load_config

    cfg = load_config(ROOT / "configs" / f"{recipe}.yaml", [*QUIET, *overrides])
    t0 = time.perf_counter()
    trainer = build_trainer(cfg, run_dir)
    trainer.fit()
    trainer.source.close()
    return trainer, time.perf_counter() - t0


def curve(run_dir: Path) -> list[dict]:
    """Held-out success at each evaluation with the env steps and seconds spent before it."""
    env_steps = seconds = 0.0
    out = []
    for r in metrics(run_dir):
        env_steps += r.get("rollout/env_steps", 0.0)
        seconds += r.get("time/step", 0.0)
        if "eval/success_rate" in r:
            out.append({"step": r["step"], "env_steps": int(env_steps),
                        "minutes": round(seconds / 60, 2), "success": r["eval/success_rate"]})  # fmt: skip
    return out


def critic(run_dir: Path, gamma: float, last: int = 40) -> dict | None:
    """SAC's critic against what the policy earns, over the run's last ``last`` update steps:
    the reward per stored transition, the discounted value a steady rate of it makes (reward /
    (1 - gamma)), the mean Q of the whole batch and, with demonstrations, of each half. Runs
    logged before ``sac/q_online`` existed take it from the whole-batch mean (demonstrations
    are half of every batch: q = (q_online + q_demo) / 2)."""
    rows = [r for r in metrics(run_dir) if "sac/q" in r][-last:]
    if not rows:
        return None

    def mean(key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    reward = mean("reward/mean")
    out = {"steps": len(rows), "reward": reward, "steady_value": reward / (1 - gamma),
           "q": mean("sac/q")}  # fmt: skip
    if "sac/q_demo" in rows[0]:
        out["q_demo"] = mean("sac/q_demo")
        logged = "sac/q_online" in rows[0]
        out["q_online"] = mean("sac/q_online") if logged else 2 * out["q"] - out["q_demo"]
    return {k: round(v, 3) for k, v in out.items()}


def finished(run_dir: Path, steps: int) -> bool:
    """The run under ``run_dir`` ran its ``steps`` (``--reuse`` keeps it)."""
    return (run_dir / "checkpoints" / f"step_{steps:06d}").is_dir()


def first_at(points: list[dict], target: float) -> dict | None:
    return next((p for p in points if p["success"] >= target), None)


ARMS = {
    # (task, arm): (recipe, its overrides)
    ("reach", "ppo"): ("vla_ppo_reach_state", []),
    ("reach", "sac"): ("vla_sac_reach_state", []),
    ("reach", "sac+demos"): ("vla_sac_reach_state", ["replay.demos={demos}"]),
    ("pick", "sac+demos"): ("vla_sac_pick", []),
}


def steps_arm(task: str, name: str, seed: int, steps: int, args, out: Path) -> dict:
    """One arm's run with held-out evaluations; its curve, the first one at `TARGET` and SAC's
    `critic` at the end."""
    from perceptrl.wiring import load_config

    recipe, extra = ARMS[task, name]
    extra = [x.format(demos=args.demos) for x in extra]
    every = args.eval_every if name != "ppo" else max(1, args.eval_every // 8)
    run_dir = out / f"{task}_{name}_{seed}"
    overrides = [f"train.seed={seed}", f"train.steps={steps}", f"train.eval_every={every}",
                 f"env.eval_seed={HELD_OUT}", f"env.eval_episodes={args.episodes}",
                 "checkpoint.every=0", *extra]  # fmt: skip
    if args.reuse and finished(run_dir, steps):
        seconds = logged_seconds(run_dir)
    else:
        _, seconds = train(recipe, overrides, run_dir)
    points = curve(run_dir)
    hit = first_at(points, TARGET)
    best = max(points, key=lambda p: p["success"])
    print(f"{task} {name} seed {seed}: {hit or best}", flush=True)
    gamma = load_config(ROOT / "configs" / f"{recipe}.yaml", overrides).algo.gamma
    return {"arm": name, "seed": seed, "seconds": round(seconds, 1), "curve": points,
            "at_target": hit, "final": points[-1]["success"],
            "critic": critic(run_dir, gamma)}  # fmt: skip


def held_out(policy, env_cfg, episodes: int) -> float:
    from perceptrl.vla.evaluate import evaluate_policy

    env = dataclasses.replace(env_cfg, eval_seed=HELD_OUT)
    return evaluate_policy(policy, env, episodes=episodes)["success_rate"]


def pick_arm(seed: int, args, out: Path) -> dict:
    """BC into the flow head, then DSRL on it; held-out success before and after."""
    from perceptrl.vla.builder import load_policy, run_sft
    from perceptrl.wiring import load_config

    bc_cfg = load_config(
        ROOT / "configs" / "vla_bc_flow.yaml",
        [*QUIET, f"train.seed={seed}", f"train.steps={args.bc_steps}", "train.eval_every=0",
         "checkpoint.every=0"],
    )  # fmt: skip
    bc_dir, dsrl_dir = out / f"pick_bc_{seed}", out / f"pick_dsrl_{seed}"
    t0 = time.perf_counter()
    if args.reuse and finished(bc_dir, args.bc_steps):
        bc_s = logged_seconds(bc_dir)
    else:
        run_sft(bc_cfg, bc_dir)
        bc_s = time.perf_counter() - t0
    bc = last_model(bc_dir)
    before = held_out(load_policy(bc), bc_cfg.env, args.episodes)
    if args.reuse and finished(dsrl_dir, args.dsrl_steps):
        dsrl, dsrl_s = load_policy(last_model(dsrl_dir)), logged_seconds(dsrl_dir)
    else:
        trainer, dsrl_s = train(
            "vla_dsrl_pick",
            [f"model.path={bc}", f"train.seed={seed}", f"train.steps={args.dsrl_steps}",
             f"train.eval_every={args.eval_every}", f"env.eval_seed={HELD_OUT}",
             f"env.eval_episodes={args.episodes}", "checkpoint.every=0"],
            dsrl_dir,
        )  # fmt: skip
        dsrl = trainer.policy
    flow = load_policy(bc).state_dict()
    frozen = all(torch.equal(dsrl.state_dict()[k].cpu(), v) for k, v in flow.items())
    after = held_out(dsrl, bc_cfg.env, args.episodes)
    print(f"pick seed {seed}: BC {before} -> DSRL {after} (flow frozen: {frozen})", flush=True)
    return {"seed": seed, "bc": before, "dsrl": after, "flow_bit_identical": frozen,
            "bc_seconds": round(bc_s, 1), "dsrl_seconds": round(dsrl_s, 1),
            "curve": curve(dsrl_dir)}  # fmt: skip


def steps_table(runs: list[dict]) -> list[str]:
    """Markdown rows of `steps_arm` results: env steps to each success level, final and best."""
    levels = " | ".join(f"env steps to {x:.0%}" for x in LEVELS)
    lines = [f"| arm | seed | {levels} | minutes to 90% | env steps run | final | best |",
             "|---|---|" + "---|" * (len(LEVELS) + 4)]  # fmt: skip
    for r in runs:
        hits = [first_at(r["curve"], x) for x in LEVELS]
        cells = " | ".join(f"{h['env_steps']:,}" if h else "not reached" for h in hits)
        best = max(p["success"] for p in r["curve"])
        minutes = hits[-1]["minutes"] if hits[-1] else "-"
        lines.append(f"| {r['arm']} | {r['seed']} | {cells} | {minutes} | "
                     f"{r['curve'][-1]['env_steps']:,} | {r['final']:.3f} | {best:.3f} |")  # fmt: skip
    sac = [r for r in runs if r.get("critic")]
    if sac:
        lines += ["", "SAC's critic over the last 40 trainer steps: mean Q against the value the "
                  "policy's reward makes at a steady rate (reward per transition / (1 - gamma)).",
                  "", "| arm | seed | reward per transition | reward / (1 - gamma) | Q (own "
                  "transitions) | Q (demonstrations) |", "|---|---|---|---|---|---|"]  # fmt: skip
        for r in sac:
            c = r["critic"]
            demo = f"{c['q_demo']:.2f}" if "q_demo" in c else "-"
            lines.append(f"| {r['arm']} | {r['seed']} | {c['reward']:.3f} | "
                         f"{c['steady_value']:.2f} | {c.get('q_online', c['q']):.2f} | {demo} |")  # fmt: skip
    return lines


def markdown(data: dict) -> str:
    lines = ["# vla_offpolicy: env steps to 90% held-out success (reach), DSRL on a BC flow and "
             "SAC with demonstrations (pick)", "",
             f"Machine: {data['machine']['cpu']}, {data['machine']['cores']} cores.", ""]  # fmt: skip
    if data["reach"]:
        lines += ["## Reach from entity poses", "", *steps_table(data["reach"])]
        lines += ["", data["reach_summary"], "",
                  "Minutes: the training steps' own time (collection and updates), evaluations "
                  "left out.", ""]  # fmt: skip
    if data["pick"]:
        lines += ["## Pick: DSRL on a behaviour-cloned flow policy", "","| pick seed | BC flow (held-out) | + DSRL | gain (points) | flow weights |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in data["pick"]:
            lines.append(f"| {r['seed']} | {r['bc']:.3f} | {r['dsrl']:.3f} | "
                         f"{100 * (r['dsrl'] - r['bc']):+.1f} | "
                         f"{'bit-identical' if r['flow_bit_identical'] else 'CHANGED'} |")  # fmt: skip
        lines.append("")
    if data.get("sac_pick"):
        lines += ["## Pick from entity poses: SAC with demonstrations from the start", "",
                  *steps_table(data["sac_pick"])]  # fmt: skip
    return "\n".join(lines)


def summary(reach: list[dict]) -> str:
    """Per success level: the median env steps each arm needed (when every seed reached it)
    and PPO's over the others'."""
    import statistics

    parts = []
    for level in LEVELS:
        steps: dict[str, list] = {}
        for r in reach:
            hit = first_at(r["curve"], level)
            steps.setdefault(r["arm"], []).append(hit["env_steps"] if hit else None)
        med = {a: statistics.median(v) for a, v in steps.items() if None not in v}
        line = ", ".join(f"{a} {m:,.0f}" for a, m in med.items()) or "no arm"
        if "ppo" in med:
            line += "".join(
                f"; PPO / {a} {med['ppo'] / m:.1f}x" for a, m in med.items() if a != "ppo"
            )
        missing = [a for a in steps if a not in med]
        if missing:
            line += f" (not every seed of {', '.join(missing)} reached it)"
        parts.append(f"to {level:.0%}: {line}")
    return "Median env steps " + "; ".join(parts) + "."


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("reach", "pick", "sac-pick", "all"), default="all")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--arms", nargs="+", default=["ppo", "sac", "sac+demos"])
    ap.add_argument("--ppo-steps", type=int, default=240, help="PPO trainer steps (512 env steps)")
    ap.add_argument("--sac-steps", type=int, default=400, help="SAC trainer steps (64 env steps)")
    ap.add_argument("--eval-every", type=int, default=40, help="SAC / DSRL steps per evaluation")
    ap.add_argument("--episodes", type=int, default=64, help="held-out episodes per evaluation")
    ap.add_argument("--demos", type=int, default=16, help="expert episodes for sac+demos")
    ap.add_argument("--bc-steps", type=int, default=100)
    ap.add_argument("--dsrl-steps", type=int, default=200)
    ap.add_argument("--out", default="runs/bench_vla_offpolicy")
    ap.add_argument("--report", action="store_true", help="re-render the committed result only")
    ap.add_argument("--reuse", action="store_true", help="keep the arms finished under --out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report:  # the markdown again from the JSON (its provenance kept)
        data = json.loads((RESULTS / "vla_offpolicy.json").read_text())
        data["reach_summary"] = summary(data["reach"]) if data["reach"] else ""
        write_results("vla_offpolicy", data, markdown(data), seeds=data["settings"]["seeds"],
                      keep_provenance=True)  # fmt: skip
        return
    data = {"machine": machine(), "settings": vars(args), "held_out_seed": HELD_OUT,
            "target": TARGET, "reach": [], "pick": [], "sac_pick": [], "reach_summary": ""}  # fmt: skip

    def save() -> None:  # after every arm: a run cut short keeps what it measured
        data["reach_summary"] = summary(data["reach"]) if data["reach"] else ""
        write_results("vla_offpolicy", data, markdown(data), seeds=args.seeds)

    if args.part in ("reach", "all"):
        for seed in args.seeds:
            for arm in args.arms:
                steps = args.ppo_steps if arm == "ppo" else args.sac_steps
                data["reach"].append(steps_arm("reach", arm, seed, steps, args, out))
                save()
    if args.part in ("pick", "all"):
        for seed in args.seeds:
            data["pick"].append(pick_arm(seed, args, out))
            save()
    if args.part in ("sac-pick", "all"):
        for seed in args.seeds:
            data["sac_pick"].append(steps_arm("pick", "sac+demos", seed, args.sac_steps, args, out))
            save()
    pick = data["pick"]
    print(
        json.dumps({"reach": data["reach_summary"], "pick": [(p["bc"], p["dsrl"]) for p in pick]})
    )
    print(f"wrote {RESULTS / 'vla_offpolicy.md'}")


if __name__ == "__main__":
    main()
