"""Does a zoom tool in multi-turn episodes beat the same budget without tools?

Multi-turn episodes with the zoom tool versus the same budget without tools (issue 14).

Task: ``datasets/zoom.py``, 448-px images seen at 112 px; ``small_tile`` questions ask for the
colours of a checkered tile that the downscaled view renders as uniform grey (only a zoom can
read it), ``large_tile`` is the control that the view resolves. Two arms, each in its own
processes, at equal wall time from the shipped base (assets/vlm_base):

* tools: SFT warm start on tool-use traces (``--sft-minutes``) -> GRPO on episodes with the
  zoom tool (``--grpo-minutes``), recipe ``configs/vlm_zoom.yaml``;
* plain: SFT on the same questions answered in one turn -> GRPO without tools, the same recipe
  with ``rollout.episode.tools=[]``.

Every model is scored greedily on held-out questions (a data seed no arm trained on), the tool
models in greedy episodes with the tool. Also measured: turns per episode, the valid-call rate,
and the cost of an episode relative to a single turn (greedy wall time per question of the tool
model with and without its tool).

    python bench/bench_vlm_zoom.py [--sft-minutes 8] [--grpo-minutes 10] [--n-test 200]

Writes bench/results/vlm_zoom.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import arm_runner, machine, metrics, write_results

RESULT = Path(__file__).resolve().parent / "results" / "vlm_zoom.json"
NO_TOOLS = ["rollout.episode.tools=[]"]
SFT_ARGS = ["train.lr=1.0e-3", "train.warmup_steps=20"]
GOALS = {"tools_minus_plain": 0.15, "grpo_minus_sft": 0.10}


def build(model: Path, tools: bool, out: Path):
    """The recipe's policy on ``model`` (with or without the zoom tool) and its config."""
    from perceptrl.cli import CONFIGS
    from perceptrl.vlm.builder import build_policy
    from perceptrl.vlm.run_plan import resolve
    from perceptrl.wiring import load_config

    cfg = load_config(
        CONFIGS / "vlm_zoom.yaml", [f"model.path={model}", *([] if tools else NO_TOOLS)]
    )
    return build_policy(resolve(cfg), out), cfg


def score(model: Path, tools: bool, samples: list[dict], out: Path) -> dict:
    """Greedy accuracy per family (episodes with the tool when ``tools``) and seconds per
    question."""
    from perceptrl.rewards import build_reward
    from perceptrl.vlm.source import evaluate_accuracy

    policy, cfg = build(model, tools, out)
    t = time.perf_counter()
    m = evaluate_accuracy(
        policy, samples, build_reward({"accuracy": 1.0}), batch_size=50,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )  # fmt: skip
    m["seconds_per_question"] = (time.perf_counter() - t) / len(samples)
    return m


def grpo_summary(rows: list[dict]) -> dict:
    """Steps, time per step and its rollout share, training reward and accuracy in the first and
    last fifth of the steps, and the episode statistics of the last fifth."""
    steps = [r for r in rows if "actor/pg_loss" in r]
    out: dict = {"steps": len(steps)}
    for k in ("time/step", "time/collect", "time/rollout", "time/turn_1", "time/turn_2"):
        vals = [r[k] for r in steps if k in r]
        out[k.split("/")[1] + "_s"] = sum(vals) / len(vals) if vals else None
    k = max(1, len(steps) // 5)
    for key in ("reward/mean", "reward/accuracy", "episode/tool_calls_mean", "episode/turns_mean",
                "episode/valid_call_rate", "dynamic_sampling/kept_frac"):  # fmt: skip
        vals = [r[key] for r in steps if key in r]
        name = key.replace("/", "_")
        out[f"{name}_first"] = sum(vals[:k]) / len(vals[:k]) if vals else None
        out[f"{name}_last"] = sum(vals[-k:]) / len(vals[-k:]) if vals else None
    return out


def episode_cost(model: Path, samples: list[dict], out: Path) -> dict:
    """Greedy seconds per question of the tool model as episodes with the tool and as one turn
    (tools off, same prompts otherwise)."""
    with_tool = score(model, True, samples, out / "cost_tool")
    one_turn = score(model, False, samples, out / "cost_plain")
    return {
        "episode_s": with_tool["seconds_per_question"],
        "single_turn_s": one_turn["seconds_per_question"],
        "ratio": with_tool["seconds_per_question"] / one_turn["seconds_per_question"],
        "turns_mean": with_tool.get("episode/turns_mean"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-minutes", type=float, default=8.0)
    ap.add_argument("--grpo-minutes", type=float, default=10.0)
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-test", type=int, default=200)
    ap.add_argument("--base", default="assets/vlm_base")
    ap.add_argument("--out", default="runs/bench_vlm_zoom")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", action="store_true", help="rescore the arms already under --out")
    args = ap.parse_args()

    from perceptrl.datasets.loader import load_samples
    from perceptrl.datasets.zoom import generate
    from perceptrl.trainer.runtime import resolve_path

    out, base = Path(args.out), resolve_path(args.base)
    previous = json.loads(RESULT.read_text()) if args.reuse and RESULT.exists() else {}
    train, test_path = out / "data" / "train.jsonl", out / "eval_data" / "test.jsonl"
    if not (args.reuse and train.exists() and test_path.exists()):
        generate(out / "data", splits={"train": args.n_train}, seed=1)
        generate(out / "eval_data", splits={"test": args.n_test}, seed=1000 + args.seed)
    test = load_samples(test_path)[0]
    common = ["train.steps=100000", f"train.seed={args.seed}", "log.progress=false",
              "train.eval_every=0", "train.eval_samples=0", f"data.train={train.resolve()}",
              "checkpoint.every=0"]  # fmt: skip
    sft = [f"train.time_limit_min={args.sft_minutes}", *common, *SFT_ARGS]
    grpo = [f"train.time_limit_min={args.grpo_minutes}", *common]
    wall: dict[str, float] = {}

    arm = arm_runner(out, args.reuse, previous, wall)

    models = {"base": base}
    models["tools_sft"] = arm("tools_sft", ["sft", "vlm_zoom", *sft, f"model.path={base}"])
    models["tools_grpo"] = arm("tools_grpo", ["train", "vlm_zoom", *grpo,
                                              f"model.path={models['tools_sft']}"])  # fmt: skip
    models["plain_sft"] = arm(
        "plain_sft", ["sft", "vlm_zoom", *sft, *NO_TOOLS, f"model.path={base}"]
    )
    models["plain_grpo"] = arm("plain_grpo", ["train", "vlm_zoom", *grpo, *NO_TOOLS,
                                              f"model.path={models['plain_sft']}"])  # fmt: skip
    results = {
        name: score(path, name.startswith("tools"), test, out / "eval" / name)
        for name, path in models.items()
    }
    data = report_data(args, results, wall, out, len(test))
    data["episode_cost"] = episode_cost(models["tools_grpo"], test[:100], out / "eval")
    seeds = {"train": [args.seed], "train_data": 1, "eval_data": 1000 + args.seed}
    js, mdp = write_results("vlm_zoom", data, markdown(data), seeds=seeds)
    print(markdown(data))
    print(f"\nwrote {js} and {mdp}")


def report_data(args, results: dict, wall: dict, out: Path, n_test: int) -> dict:
    fams = ("small_tile", "large_tile")
    acc = {
        a: {"all": r["accuracy"], **{f: r[f"accuracy/{f}"] for f in fams}}
        for a, r in results.items()
    }
    gaps = {
        f: {"tools_minus_plain": acc["tools_grpo"][f] - acc["plain_grpo"][f],
            "grpo_minus_sft": acc["tools_grpo"][f] - acc["tools_sft"][f]}
        for f in ("all", *fams)
    }  # fmt: skip
    episodes = {
        a: {k: r[k] for k in r if k.startswith(("episode/", "tool/"))}
        for a, r in results.items() if a.startswith("tools")
    }  # fmt: skip
    return {
        "machine": machine(note="2 CPU cores; OMP_NUM_THREADS as listed"),
        "settings": {
            "sft_minutes": args.sft_minutes,
            "grpo_minutes": args.grpo_minutes,
            "n_train": args.n_train,
            "n_test": n_test,
            "train_data_seed": 1,
            "eval_data_seed": 1000 + args.seed,
            "seed": args.seed,
            "decoding": "greedy",
            "base": str(args.base),
            "sft_args": SFT_ARGS,
        },  # fmt: skip
        "wall_s": wall,
        "accuracy": acc,
        "gaps": gaps,
        "goals": {
            k: {
                "goal": v,
                "met_small_tile": gaps["small_tile"][k] >= v,
                "met_all": gaps["all"][k] >= v,
            }
            for k, v in GOALS.items()
        },  # fmt: skip
        "eval_episodes": episodes,
        "seconds_per_question": {a: r["seconds_per_question"] for a, r in results.items()},
        "grpo": {a: grpo_summary(metrics(out / a)) for a in ("tools_grpo", "plain_grpo")},
        "sft_steps": {
            a: len([r for r in metrics(out / a) if "sft/loss" in r])
            for a in ("tools_sft", "plain_sft")
        },  # fmt: skip
    }


def markdown(d: dict) -> str:
    s, acc, ep = d["settings"], d["accuracy"], d["eval_episodes"]
    arms = list(acc)
    md = [
        f"# Zoom tool vs no tools: SFT {s['sft_minutes']:g} min + GRPO {s['grpo_minutes']:g} min "
        "per arm",
        "",
        f"Machine: {d['machine']['cpu']}, {d['machine']['cores']} cores, torch "
        f"{d['machine']['torch']}, OMP_NUM_THREADS={d['machine']['OMP_NUM_THREADS'] or 'unset'}. "
        f"Greedy decoding on {s['n_test']} held-out questions (data seed {s['eval_data_seed']}). "
        "small_tile: the tile's colours are grey in the 112-px view (zooming is needed); "
        "large_tile: the control the view resolves. Chance is 0.25.",
        "",
        "| family | " + " | ".join(arms) + " |",
        "|---|" + "---|" * len(arms),
    ]
    for f in ("small_tile", "large_tile", "all"):
        md.append(f"| {f} | " + " | ".join(f"{acc[a][f]:.3f}" for a in arms) + " |")
    md += ["", "| goal | small_tile | all | goal |", "|---|---|---|---|"]
    for k, g in d["goals"].items():
        gap = d["gaps"]
        md.append(
            f"| {k} | {gap['small_tile'][k]:+.3f} ({'met' if g['met_small_tile'] else 'not met'}) "
            f"| {gap['all'][k]:+.3f} ({'met' if g['met_all'] else 'not met'}) | {g['goal']:+.2f} |"
        )
    md += ["", "Episodes of the tool arms on the held-out questions:", ""]
    for a, e in ep.items():
        md.append(
            f"- {a}: {e.get('episode/turns_mean', 0):.2f} turns, "
            f"{e.get('episode/tool_calls_mean', 0):.2f} calls per episode, valid-call rate "
            f"{e.get('episode/valid_call_rate', 0):.2f}, stop reasons "
            + ", ".join(f"{k.split('/')[-1]} {v:.2f}" for k, v in e.items() if "/stop/" in k and v)
        )
    c = d["episode_cost"]
    md += [
        "",
        f"Cost: a greedy episode of the tool model takes {c['episode_s']:.3f} s per question "
        f"({c['turns_mean']:.2f} turns) against {c['single_turn_s']:.3f} s answering in one turn "
        f"without the tool: {c['ratio']:.2f}x.",
    ]
    for a, g in d["grpo"].items():
        md.append(
            f"- {a}: {g['steps']} GRPO steps, {g['step_s']:.1f} s per step; training accuracy "
            f"{_f(g['reward_accuracy_first'])} -> {_f(g['reward_accuracy_last'])} (first/last "
            f"fifth of the steps), tool calls per episode {_f(g['episode_tool_calls_mean_first'])} "
            f"-> {_f(g['episode_tool_calls_mean_last'])}"
        )
    md.append(f"- SFT steps: {d['sft_steps']}; wall seconds per arm: "
              + ", ".join(f"{k} {v:.0f}" for k, v in d["wall_s"].items()))  # fmt: skip
    return "\n".join(md)


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


if __name__ == "__main__":
    main()
