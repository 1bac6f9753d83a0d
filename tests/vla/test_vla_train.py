"""The VLA side through the shared Trainer / SFT loop: PPO learns, GRPO and BC run, eval writes."""

from __future__ import annotations

import copy
import json
import os

os.environ.setdefault("MUJOCO_GL", "egl")

from pathlib import Path  # noqa: E402

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from perceptrl.vla.builder import build_trainer, run_sft  # noqa: E402
from perceptrl.wiring import load_config  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QUIET = ["log.tensorboard=false", "log.progress=false", "train.device=cpu"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_recipes_parse():
    for name in (
        "vla_ppo_reach",
        "vla_ppo_reach_state",
        "vla_grpo",
        "vla_bc_pick",
        "vla_bc_flow",
        "vla_grpo_flow",
        "vla_bc_token",
        "vla_grpo_token",
    ):
        cfg = load_config(CONFIGS / f"{name}.yaml")
        assert cfg.side == "vla"


def test_ppo_state_reach_improves(tmp_path):
    cfg = load_config(
        CONFIGS / "vla_ppo_reach_state.yaml",
        ["train.steps=60", "train.eval_every=0", *QUIET],
    )
    trainer = build_trainer(cfg, tmp_path)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    last = trainer.fit()
    evals = [m for m in _metrics(tmp_path) if "eval/success_rate" in m]
    first = evals[0]
    assert last["eval/return/Reach"] > 3 * first["eval/return/Reach"]
    assert last["eval/success_rate"] > first["eval/success_rate"]
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    trainer.source.close()


def test_grpo_step_with_dynamic_sampling(tmp_path):
    cfg = load_config(
        CONFIGS / "vla_grpo.yaml",
        ["env.id=perceptrl/Reach-v0", "env.max_episode_steps=30", "env.num_envs=4",
         "env.eval_episodes=0", "rollout.prompts_per_step=2", "rollout.group_size=4",
         "train.steps=2", *QUIET],
    )  # fmt: skip
    trainer = build_trainer(cfg, tmp_path)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    trainer.fit()
    rows = [m for m in _metrics(tmp_path) if "rollout/episodes" in m]
    assert len(rows) == 2 and rows[0]["rollout/episodes"] == 8
    assert all("dynamic_sampling/kept_frac" in r for r in rows)
    assert all(abs(r.get("actor/pg_loss", 0.0)) < 1e3 for r in rows)
    changed = any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    # GRPO moves the weights only when a group had both outcomes; the log says which
    assert changed or all(r.get("adv/abs_mean", 0) == 0 for r in rows)
    trainer.source.close()


def test_bc_loss_decreases_and_checkpoint_loads(tmp_path):
    cfg = load_config(
        CONFIGS / "vla_bc_pick.yaml",
        ["env.id=perceptrl/Reach-v0", "env.num_envs=4", "env.steps_per_rollout=16",
         "env.eval_episodes=0", "train.steps=40", *QUIET],
    )  # fmt: skip
    run_sft(cfg, tmp_path)
    losses = [m["sft/loss"] for m in _metrics(tmp_path) if "sft/loss" in m]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    from perceptrl.vla.compact import CompactVLA

    model = sorted((tmp_path / "checkpoints").iterdir())[-1] / "model"
    assert CompactVLA.from_pretrained(model).spec.vla.encoder == "state"


def test_pixel_ppo_step_and_eval_report(tmp_path):
    cfg = load_config(
        CONFIGS / "vla_ppo_reach.yaml",
        ["env.num_envs=2", "env.steps_per_rollout=6", "env.eval_episodes=2", "env.eval_videos=1",
         "env.max_episode_steps=8", "vla.channels=[8, 16, 16]", "vla.hidden=32",
         "train.steps=1", "train.time_limit_min=0", *QUIET],
    )  # fmt: skip
    trainer = build_trainer(cfg, tmp_path)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    before_policy = copy.deepcopy(trainer.policy)
    trainer.fit()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    assert list(trainer.source.runner.batch.images) == ["agentview", "wrist"]
    from perceptrl.sim.demonstrations import read_video
    from perceptrl.vla.evaluate import write_report

    rec = write_report(trainer.policy, cfg.env, tmp_path / "eval")
    assert rec["tasks"][0]["task"] == "Reach" and rec["tasks"][0]["episodes"] == 2
    frames = read_video(rec["videos"]["Reach"])
    # reset + 8 steps + half a second on the outcome, at 256 px whatever the policy's 64 px
    fps = gym.make("perceptrl/Reach-v0").metadata["render_fps"]
    assert frames.shape[0] == 9 + fps // 2 and frames.shape[1:] == (256, 256, 3)
    assert "| Reach | train | 2 |" in (tmp_path / "eval" / "eval.md").read_text()
    # before / after side by side: one 256-px panel per policy, labelled
    from perceptrl.vla.evaluate import compare_video

    seeds = [cfg.env.eval_seed]
    path = compare_video({"before": before_policy, "after": trainer.policy}, cfg.env,
                         cfg.env.id, seeds, tmp_path / "ba.mp4")  # fmt: skip
    both = read_video(path)
    assert both.shape[1:] == (256, 512, 3) and both.shape[0] == 9 + fps // 2
    assert not np.array_equal(both[0, :40, :256], both[0, :40, 256:])  # different labels
    trainer.source.close()


def test_pixel_ppo_with_state_critic_and_subject_auxiliary(tmp_path):
    cfg = load_config(
        CONFIGS / "vla_ppo_reach.yaml",
        ["env.num_envs=2", "env.steps_per_rollout=6", "env.eval_episodes=0",
         "env.max_episode_steps=8", "vla.channels=[8, 16, 16]", "vla.hidden=32",
         "vla.encoder=keypoint", "vla.critic=state", "vla.aux=subject",
         "env.privileged_state=true", "train.steps=2", "train.time_limit_min=0", *QUIET],
    )  # fmt: skip
    trainer = build_trainer(cfg, tmp_path)
    policy = trainer.policy
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    trainer.fit()
    changed = {n for n, p in policy.named_parameters() if not torch.equal(before[n], p)}
    assert {"critic.0.weight", "aux_head.weight", "convs.0.weight", "mean_head.weight"} <= changed
    assert not any(n.startswith("value_head.") for n in before)  # no unused shared head
    train_rows = [r for r in _metrics(tmp_path) if "aux/subject" in r]
    assert len(train_rows) == 2 and all(r["aux/subject"] > 0 for r in train_rows)
    assert all(r["time/old_logp"] < 0.05 for r in train_rows)  # collector's log-probs reused
    trainer.source.close()
