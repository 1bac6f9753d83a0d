"""TokenVLA: a tiny Qwen2.5-VL acting through masked action tokens, through the real Trainer."""

from __future__ import annotations

import dataclasses
import json
import math
import os

os.environ.setdefault("MUJOCO_GL", "egl")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from perceptrl.trainer.batch import RolloutBatch  # noqa: E402
from perceptrl.vla.builder import build_trainer, load_policy  # noqa: E402
from perceptrl.vla.envs import make_envs  # noqa: E402
from perceptrl.vla.token_vla import TokenSpec, TokenVLA, action_block  # noqa: E402
from perceptrl.vlm.tiny import build_tiny  # noqa: E402
from perceptrl.wiring import load_config  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QUIET = ["log.tensorboard=false", "log.progress=false", "train.device=cpu"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("tiny"), layers=2, vision_depth=1)


@pytest.fixture(scope="module")
def env_cfg():
    cfg = load_config(
        CONFIGS / "vla_grpo.yaml",
        ["env.id=perceptrl/Reach-v0", "env.obs_mode=rgb", "env.num_envs=2", "env.image_size=56",
         "env.max_episode_steps=3", "env.eval_episodes=0", "vla.encoder=cnn", *QUIET],
    )  # fmt: skip
    return cfg.env


def test_action_block_avoids_special_tokens(tiny_dir):
    policy = TokenVLA.from_pretrained(tiny_dir, TokenSpec(action_dim=5))
    proc = policy.vlm.processor
    ids = set(policy.tokenizer.ids)
    assert len(ids) == 256
    assert not ids & set(proc.tokenizer.all_special_ids)
    assert proc.image_token_id not in ids
    vocab = int(policy.vlm.model.get_output_embeddings().weight.shape[0])
    assert max(ids) < vocab
    with pytest.raises(ValueError, match="consecutive free ids"):
        action_block(proc, vocab, bins=vocab)


@pytest.mark.parametrize("cameras", [["agentview"], ["agentview", "wrist"]])
def test_act_and_evaluate_agree_under_the_mask(tiny_dir, env_cfg, cameras):
    torch.manual_seed(0)
    policy = TokenVLA.from_pretrained(tiny_dir, TokenSpec(action_dim=5, chunk=2))
    cfg = dataclasses.replace(env_cfg, cameras=cameras)
    runner = make_envs(cfg, seed=3)
    try:
        obs = policy.observe(runner.reset())
    finally:
        runner.close()
    assert [len(g) for g in obs["image_grid_thw"]] == [len(cameras)] * 2  # one image per camera
    actions, logp, _ = policy.act(obs)  # (2, 10) bin centres
    assert actions.shape == (2, 10) and torch.isfinite(actions).all()
    assert actions.abs().max() < 1.0
    # executed actions re-encode to the sampled tokens; evaluate re-scores them identically
    batch = RolloutBatch(
        tokens=actions[:, None, :], mask=torch.ones(2, 1), group_id=torch.arange(2),
        inputs={k: [torch.stack([v[i]]) for i in range(2)] for k, v in obs.items()},
    )  # fmt: skip
    ev = policy.evaluate(batch)
    new_logp, entropy, value = ev.logp, ev.entropy, ev.value
    assert value is None
    torch.testing.assert_close(new_logp[:, 0], logp, atol=1e-4, rtol=1e-4)
    assert (entropy > 0).all() and (entropy <= 10 * math.log(256) + 1e-3).all()
    # the mask: probability mass on non-action ids is zero
    flat = policy.flat_batch(batch)
    with torch.no_grad():
        probs = policy.vlm.completion_logits(flat).float().softmax(-1)  # (2, 10, V)
    outside = probs.clone()
    outside[..., list(policy.tokenizer.ids)] = 0
    assert float(outside.sum(-1).max()) < 1e-6
    # the action ids depend on the image (the tower is not blind)
    other = {k: list(v) for k, v in obs.items()}
    other["pixel_values"] = [torch.zeros_like(x) for x in other["pixel_values"]]
    other_batch = RolloutBatch(
        tokens=actions[:, None, :], mask=torch.ones(2, 1), group_id=torch.arange(2),
        inputs={k: [torch.stack([v[i]]) for i in range(2)] for k, v in other.items()},
    )  # fmt: skip
    assert not torch.allclose(policy.evaluate(other_batch).logp, new_logp)


def test_policy_gradient_step_raises_logp(tiny_dir, env_cfg):
    torch.manual_seed(1)
    policy = TokenVLA.from_pretrained(tiny_dir, TokenSpec(action_dim=5))
    runner = make_envs(env_cfg, seed=5)
    try:
        obs = policy.observe(runner.reset())
    finally:
        runner.close()
    actions, _, _ = policy.act(obs)
    batch = RolloutBatch(
        tokens=actions[:, None, :], mask=torch.ones(2, 1), group_id=torch.arange(2),
        inputs={k: [torch.stack([v[i]]) for i in range(2)] for k, v in obs.items()},
    )  # fmt: skip
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    before = policy.evaluate(batch).logp.detach()
    loss = -policy.evaluate(batch).logp.sum()
    loss.backward()
    opt.step()
    after = policy.evaluate(batch).logp.detach()
    assert (after > before).all()


def test_grpo_trains_token_vla_end_to_end(tiny_dir, tmp_path):
    cfg = load_config(
        CONFIGS / "vla_grpo.yaml",
        ["vla.policy=token", f"model.path={tiny_dir}", "env.id=perceptrl/Reach-v0",
         "env.obs_mode=rgb", "env.image_size=56", "env.num_envs=2", "env.max_episode_steps=3",
         "env.eval_episodes=2", "rollout.prompts_per_step=1", "rollout.group_size=2",
         "algo.dynamic_sampling=false", "algo.entropy_coef=0.01", "train.steps=2",
         "train.lr=1e-3", "train.eval_every=0", "checkpoint.every=0", *QUIET],
    )  # fmt: skip
    trainer = build_trainer(cfg, tmp_path)
    assert isinstance(trainer.policy, TokenVLA)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    last = trainer.fit()
    trainer.source.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/episodes" in r]
    assert len(steps) == 2 and all(r["rollout/episodes"] == 2 for r in steps)
    assert all("rollout/success_rate" in r for r in steps)
    assert all(math.isfinite(r["actor/pg_loss"]) and r["actor/entropy"] > 0 for r in steps)
    assert "eval/success_rate" in last
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    saved = sorted((tmp_path / "checkpoints").iterdir())[-1] / "model"
    reloaded = load_policy(saved)
    assert isinstance(reloaded, TokenVLA) and reloaded.spec == trainer.policy.spec
    first = next(iter(trainer.policy.state_dict()))
    torch.testing.assert_close(reloaded.state_dict()[first], trainer.policy.state_dict()[first])


def bc_token(tiny_dir: Path, run_dir: Path, *overrides: str) -> Path:
    """`perceptrl sft vla_bc_token` on two envs from ``tiny_dir``; the last model's directory."""
    from perceptrl.vla.builder import run_sft

    cfg = load_config(
        CONFIGS / "vla_bc_token.yaml",
        [f"model.path={tiny_dir}", "env.num_envs=2", "env.steps_per_rollout=4",
         "env.eval_episodes=0", *overrides, *QUIET],
    )  # fmt: skip
    run_sft(cfg, run_dir)
    return sorted((run_dir / "checkpoints").iterdir())[-1] / "model"


def test_bc_into_token_vla_with_chunked_targets(tiny_dir, tmp_path):
    """`perceptrl sft vla_bc_token`: expert chunks of 2 actions, binned, as token targets."""
    model = bc_token(tiny_dir, tmp_path, "env.action_chunk=2", "train.steps=2")
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["sft/loss"] for r in rows if "sft/loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    assert load_policy(model).spec.chunk == 2


def test_action_bins_from_the_recipe(tiny_dir, tmp_path, env_cfg):
    """`vla.action_bins` sets the tokenizer's resolution; a saved policy keeps its own and a
    recipe that disagrees is a config error, not a silent re-binning."""
    from perceptrl.trainer.config import ConfigError
    from perceptrl.vla.builder import build_token_policy
    from perceptrl.vla.run_plan import resolve

    model = bc_token(tiny_dir, tmp_path, "vla.action_bins=31", "train.steps=1")
    policy = load_policy(model)
    assert policy.spec.bins == 31
    runner = make_envs(env_cfg, seed=3)
    try:
        actions, _, _ = policy.act(policy.observe(runner.reset()), deterministic=True)
        again = load_config(CONFIGS / "vla_grpo_token.yaml", [f"model.path={model}", *QUIET])
        with pytest.raises(ConfigError, match="31 action bins.*vla.action_bins=256"):
            build_token_policy(resolve(again).policy, runner, torch.device("cpu"))
        with pytest.raises(ConfigError, match=">= 2 bins"):  # when the recipe loads
            load_config(
                CONFIGS / "vla_grpo_token.yaml", [f"model.path={model}", "vla.action_bins=1"]
            )
    finally:
        runner.close()
    centres = torch.linspace(-1, 1, 32)[:-1] + 1 / 31  # the 31 bin centres, 0 among them
    assert torch.isclose(actions.flatten()[:, None], centres[None]).any(-1).all()
    assert torch.isclose(centres, torch.tensor(0.0), atol=1e-6).any()
