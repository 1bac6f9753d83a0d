"""Does a flow-matching action head beat the Gaussian head, after BC and after GRPO?

Flow-matching action head against the Gaussian head: behaviour cloning, then GRPO, same budget.

One arm = one head on one task with one seed, run in its own process (one torch thread, so two
arms share a 2-core machine side by side):

1. Behaviour cloning of the scripted expert for ``--bc-steps`` steps, on targets of
   ``--chunk`` actions (``configs/vla_bc_flow.yaml`` for the flow head, flow matching;
   ``configs/vla_bc_pick.yaml`` for the Gaussian, its likelihood).
2. Held-out success on ``--episodes`` seeds from ``env.eval_seed`` (never used in training),
   deterministic (the flow's ODE from x_0 = 0 / the Gaussian's mean) and sampled (the
   flow's stochastic sampler / Gaussian samples; seeded).
3. GRPO from those weights for ``--minutes`` of wall time (``configs/vla_grpo_flow.yaml`` /
   ``configs/vla_grpo.yaml``: 8 indexed initial states x 8 episodes, sparse success, dynamic
   sampling), then the same held-out evaluation.

    MUJOCO_GL=egl python bench/bench_vla_flow.py arm --head flow --task perceptrl/Pick-v0 --seed 0
    python bench/bench_vla_flow.py report      # every arm under --out -> bench/results/vla_flow.*

Each arm's ``arm.json`` records its command; the report lists them with the arms.

Writes ``<out>/<task>_<head>_bc<steps>_m<minutes>_s<seed>/arm.json`` (head
``flow-<noise>-<logp>`` or ``gaussian``) per arm and, with ``report``,
bench/results/vla_flow.{json,md}. ``make bench-vla-flow`` runs the committed result's arms.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_vla_grpo import bc_then_grpo  # noqa: E402
from common import command_line, machine, peak_rss_mb, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "flow": ("vla_bc_flow", "vla_grpo_flow"),
    "gaussian": ("vla_bc_pick", "vla_grpo"),
    "token": ("vla_bc_token", "vla_grpo_token"),
}
"""head -> (BC recipe, GRPO recipe); the token VLA's arms are reported apart (vla_token.*)"""


def run_arm(args) -> dict:
    from perceptrl.vla.evaluate import task_name

    torch.set_num_threads(1)
    task = task_name(args.task)
    head = f"flow-{args.noise}-{args.logp}" if args.head == "flow" else args.head
    tag = f"-{args.tag}" if args.tag else ""
    out = Path(args.out) / f"{task}_{head}{tag}_bc{args.bc_steps}_m{args.minutes:g}_s{args.seed}"
    bc_recipe, rl_recipe = RECIPES[args.head]
    common = [f"env.id={args.task}", f"train.seed={args.seed}", f"env.action_chunk={args.chunk}",
              "log.progress=false", "log.tensorboard=false", *args.overrides]  # fmt: skip
    if args.head == "flow":
        common += [f"vla.flow_noise={args.noise}", f"vla.flow_logp={args.logp}"]
    run = bc_then_grpo(
        out, bc_recipe,
        [*common, f"train.steps={args.bc_steps}", "train.eval_every=0", "checkpoint.every=0"],
        rl_recipe, [*common, "train.eval_every=0"], args.minutes, args.episodes,
    )  # fmt: skip
    before, after, steps = run["before"], run["after"], run["steps"]
    arm = {
        "task": task, "head": args.head, "seed": args.seed, "chunk": args.chunk,
        "noise": args.noise if args.head == "flow" else None,
        "logp": args.logp if args.head == "flow" else None, "bc_steps": args.bc_steps,
        "bc_seconds": round(run["bc_seconds"], 1), "grpo_seconds": round(run["grpo_seconds"], 1),
        "grpo_steps": len(steps), "episodes": args.episodes,
        "eval_seed": run["grpo_cfg"].env.eval_seed,
        "overrides": args.overrides, "tag": args.tag, "before": before, "after": after,
        "train_success": [round(r.get("rollout/success_rate", float("nan")), 3) for r in steps],
        "mean_step_s": round(float(np.mean([r["time/step"] for r in steps])), 2) if steps else None,
        "peak_rss_mb": round(peak_rss_mb(), 1), "command": command_line(),
    }  # fmt: skip
    (out / "arm.json").write_text(json.dumps(arm, indent=1))
    print(json.dumps(arm), flush=True)
    return arm


def se(p: float, n: int) -> float:
    return float(np.sqrt(max(p * (1 - p), 1e-12) / n))


TITLES = {
    "vla_flow": "Flow-matching action head vs Gaussian head: BC, then GRPO with the same budget",
    "vla_token": "Token VLA (a VLM emitting action tokens): BC, then GRPO",
}


def report(args) -> None:
    arms = [json.loads(p.read_text()) for p in sorted(Path(args.out).glob("*/arm.json"))]
    if not arms:
        raise SystemExit(f"no arm.json under {args.out}; run `bench_vla_flow.py arm ...` first")
    for name in TITLES:
        part = [a for a in arms if (a["head"] == "token") == (name == "vla_token")]
        if part:
            write_report(name, part)


def write_report(name: str, arms: list[dict]) -> None:
    arms.sort(
        key=lambda a: (a["task"], a["bc_steps"], round(a["grpo_seconds"], -2), a["seed"],
                       a["head"] != "flow", a.get("tag") or "", a.get("logp") or "")
    )  # fmt: skip
    m = machine()
    md = [
        f"# {TITLES[name]}",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, two arms at a time, one torch thread each; "
        f"torch {m['torch']}. Command: `python bench/bench_vla_flow.py arm --head H --task T "
        "--seed S ...` per row, then `report`.",
        "",
        f"Held-out success on {arms[0]['episodes']} episodes from seed {arms[0]['eval_seed']} "
        "(never used in training or in choosing settings); deterministic = the flow's ODE from "
        "x_0 = 0 / the Gaussian's mean action; sampled = the stochastic policy GRPO trains. "
        "± is one binomial standard error.",
        "",
        "| task | head | seed | BC steps (s) | GRPO steps (s) | BC det. | BC sampled | "
        "+GRPO det. | +GRPO sampled | gain det. / sampled (points) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    n = arms[0]["episodes"]
    for a in arms:
        b, f = a["before"], a["after"]
        head = a["head"] + (f" ({a['noise']}, {a.get('logp', 'chain')})" if a["noise"] else "")
        head += f" [{a['tag']}: {' '.join(a['overrides'])}]" if a.get("tag") else ""
        md.append(
            f"| {a['task']} | {head} | {a['seed']} | {a['bc_steps']} ({a['bc_seconds']:.0f}) | "
            f"{a['grpo_steps']} ({a['grpo_seconds']:.0f}) | {b['deterministic']:.3f} | "
            f"{b['sampled']:.3f} | {f['deterministic']:.3f} ± {se(f['deterministic'], n):.3f} | "
            f"{f['sampled']:.3f} ± {se(f['sampled'], n):.3f} | "
            f"{100 * (f['deterministic'] - b['deterministic']):+.1f} / "
            f"{100 * (f['sampled'] - b['sampled']):+.1f} |"
        )
    data = {"machine": m, "arms": arms}
    seeds = {"train": sorted({a["seed"] for a in arms}), "eval": arms[0]["eval_seed"]}
    js, mdp = write_results(name, data, "\n".join(md), seeds=seeds)
    print("\n".join(md))
    print(f"\nwrote {js} and {mdp}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["arm", "report"])
    ap.add_argument("--head", choices=sorted(RECIPES), default="flow")
    ap.add_argument("--task", default="perceptrl/Pick-v0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=4, help="actions per policy step (both heads)")
    ap.add_argument("--noise", choices=["sde", "learned"], default="sde", help="flow RL sampler")
    ap.add_argument("--logp", choices=["step", "chain"], default="step",
                    help="flow: a ratio per denoising step or per chunk")  # fmt: skip
    ap.add_argument("--bc-steps", type=int, default=150)
    ap.add_argument("--minutes", type=float, default=8.0, help="GRPO wall time per arm")
    ap.add_argument("--episodes", type=int, default=200, help="held-out evaluation episodes")
    ap.add_argument("--out", default="runs/bench_vla_flow")
    ap.add_argument("--tag", default="", help="names a variant set by overrides (e.g. tree)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for both recipes")
    args = ap.parse_intermixed_args(argv)  # overrides may follow the options
    run_arm(args) if args.what == "arm" else report(args)


if __name__ == "__main__":
    main()
