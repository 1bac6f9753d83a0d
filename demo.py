"""``perceptrl demo``: the default job on the embedded default (tiny models, synthetic data, CPU).

Part 1 trains the shipped demo base with GRPO on synthetic counting (``configs/vlm_demo.yaml``)
and scores the base against the trained model on fresh held-out questions (the paired gain and
its standard error); part 2 trains the compact VLA with PPO on the MuJoCo reach task
(``configs/vla_ppo_reach_state.yaml``): its held-out success curve, evaluation videos and a
before/after video. Writes ``demo.json`` and ``demo.md`` in the output directory. (Not to be
confused with ``sim/showcase.py``, ``perceptrl sim demo``: videos of the scripted experts.)
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from . import wiring
from .trainer.config import ConfigError, save_config
from .wiring import CONFIGS, load_config, new_run_dir


def run_demo(
    out: Path, overrides: Sequence[str] = (), *, steps: int = 0, minutes: float = 0.0,
    test_questions: int = 500, vla_steps: int = 0, summary: Callable[[Path], None] | None = None,
) -> dict:  # fmt: skip
    """Both parts into ``out`` (see the module docstring).

    Args:
        overrides: dotted overrides of ``configs/vlm_demo.yaml``.
        steps, minutes: part 1's GRPO steps and time limit (0: the recipe's).
        test_questions: fresh held-out questions that score the base against the trained model.
        vla_steps: part 2's PPO steps (0: the recipe's).
        summary: prints a finished run's summary from its directory (the command's).

    Returns:
        ``{"vlm_grpo": {steps, train_seconds, held_out}, "vla_ppo_reach": demo_vla's}``, also
        written as ``demo.json``.
    """
    from .trainer.runtime import resolve_path
    from .vlm.builder import build_policy, held_out_gain
    from .vlm.run_plan import resolve

    limits = [f"train.steps={steps}"] if steps else []
    limits += [f"train.time_limit_min={minutes}"] if minutes else []
    cfg = load_config(CONFIGS / "vlm_demo.yaml", [*overrides, *limits])
    if not (resolve_path(cfg.model.path) / "config.json").exists():
        raise ConfigError(
            f"model.path={cfg.model.path}: no model there. The demo's base is committed in "
            "assets/vlm_demo_base; restore it (git checkout assets) or rebuild it with "
            "`make assets-demo-base` (assets/build/make_demo_base.py)."
        )
    run_dir = new_run_dir(out / "vlm_grpo")
    save_config(cfg, run_dir / "config.yaml")
    print(
        f"perceptrl demo [1/2]: GRPO on synthetic counting, {cfg.train.steps} steps from "
        f"{cfg.model.path} -> {run_dir}"
    )
    t0 = time.perf_counter()
    trainer = wiring.side(cfg).build_trainer(cfg, run_dir)
    trainer.fit()
    train_s = time.perf_counter() - t0
    if summary is not None:
        summary(run_dir)
    print(f"\nscoring the base and the trained model on {test_questions} fresh questions")
    plan = resolve(cfg)
    gain = held_out_gain(
        plan, build_policy(plan, out / "held_out"), trainer.policy, out / "held_out", test_questions
    )
    vlm = {"steps": trainer.step, "train_seconds": round(train_s, 1), "held_out": gain}
    print(f"\n{gain_table(gain)}")
    vla = demo_vla(out / "vla_ppo_reach", vla_steps)
    result = {"vlm_grpo": vlm, "vla_ppo_reach": vla}
    (out / "demo.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "demo.md").write_text(demo_markdown(result))
    print(f"\ndemo summary: {out / 'demo.md'}")
    return result


def gain_table(gain: dict) -> str:
    """The base against the trained model on the same held-out questions, per family."""
    lines = [f"{'held-out (greedy)':<24}{'questions':>10}{'base':>8}{'trained':>9}"]
    for fam, row in gain["families"].items():
        lines.append(f"{fam:<24}{row['questions']:>10.0f}{row['before']:>8.3f}{row['after']:>9.3f}")
    lines.append(
        f"{'all':<24}{gain['questions']:>10.0f}{gain['before']:>8.3f}{gain['after']:>9.3f}"
    )
    lines.append(
        f"gain {gain['gain']:+.3f} +/- {gain['se']:.3f} (paired standard error; "
        f"{gain['z']:.1f} SE; {gain['improved']:.0f} questions fixed, "
        f"{gain['regressed']:.0f} broken)"
    )
    return "\n".join(lines)


def demo_markdown(result: dict) -> str:
    """``demo.md``: what each part of the demo measured."""
    vlm, vla = result["vlm_grpo"], result["vla_ppo_reach"]
    curve = ", ".join(f"{s}: {v:.2f}" for s, v in vla["success_curve"])
    return (
        f"# perceptrl demo\n\nPart 1, VLM GRPO ({vlm['steps']} steps, "
        f"{vlm['train_seconds'] / 60:.1f} min including its evaluations):\n"
        f"```\n{gain_table(vlm['held_out'])}\n```\n\n"
        f"Part 2, VLA PPO on reach ({vla['steps']} steps, {vla['train_seconds'] / 60:.1f} min): "
        f"held-out success by step {curve}.\n"
    )


def demo_vla(run_dir: Path, steps: int = 0) -> dict:
    """Part 2: PPO trains the compact VLA on the reach task (``steps``, default the recipe's);
    success-rate curve and videos. Returns ``steps``, ``train_seconds`` and ``success_curve``
    ([step, held-out success] pairs)."""
    from .trainer.metrics import read_metrics
    from .vla.evaluate import compare_video, write_report

    cfg = load_config(CONFIGS / "vla_ppo_reach_state.yaml")
    if steps:
        cfg.train.steps = steps
    save_config(cfg, new_run_dir(run_dir) / "config.yaml")
    print(f"\nperceptrl demo [2/2]: PPO on the reach task ({cfg.train.steps} steps) -> {run_dir}")
    t0 = time.perf_counter()
    trainer = wiring.side(cfg).build_trainer(cfg, run_dir)
    before = copy.deepcopy(trainer.policy)
    trainer.fit()
    train_s = time.perf_counter() - t0
    curve = [
        [row["step"], row["eval/success_rate"]]
        for row in read_metrics(run_dir / "metrics.jsonl")
        if "eval/success_rate" in row
    ]
    print(f"\n{'step':>6}  held-out success ({cfg.env.eval_episodes} episodes, deterministic)")
    for step, rate in curve:
        print(f"{step:>6}  {rate:.3f}")
    cfg.env.eval_videos = 2
    report = write_report(trainer.policy, cfg.env, run_dir / "eval")
    for task, video in report["videos"].items():
        print(f"evaluation video ({task}): {video}")
    seeds = [cfg.env.eval_seed + j for j in range(cfg.env.eval_videos)]
    policies = {"before training": before, "after training": trainer.policy}
    video = compare_video(
        policies, cfg.env, cfg.env.id, seeds, run_dir / "eval" / "before_after.mp4"
    )
    print(f"before / after video: {video}")
    print(f"evaluation table: {run_dir / 'eval' / 'eval.md'}")
    return {"steps": trainer.step, "train_seconds": round(train_s, 1), "success_curve": curve}
