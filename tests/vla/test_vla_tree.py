"""VLA GRPO trees: groups that branch from saved simulator states (`GRPOCollector` with
``branches``), and the runner's branch points (step cap, snapshot, restore)."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from perceptrl.sim.vector import VecEnv  # noqa: E402
from perceptrl.vla.collect import GRPOCollector, _give_back, _Node, _split  # noqa: E402
from perceptrl.vla.compact import CompactSpec, CompactVLA  # noqa: E402
from perceptrl.vla.config import EnvConfig, VLAConfig  # noqa: E402
from perceptrl.vla.envs import make_envs  # noqa: E402
from perceptrl.vla.episode_runner import CUT, Actor, EpisodeRunner, EpisodeSpecs  # noqa: E402


def env_cfg(**kw) -> EnvConfig:
    base = dict(id="perceptrl/Reach-v0", num_envs=3, obs_mode="state", max_episode_steps=10)
    return EnvConfig(**{**base, **kw})


def policy_for(runner: VecEnv) -> CompactVLA:
    torch.manual_seed(0)
    obj = runner.observation_space["objects"].shape[0]
    return CompactVLA(CompactSpec(5, objects_dim=obj, vla=VLAConfig(encoder="state", hidden=32)))


def test_branch_point_restores_the_exact_state():
    """An episode stopped at the cap and continued from its snapshot in another env follows the
    same physics as the uninterrupted one under the same actions."""
    cfg = env_cfg(num_envs=2)
    runner = make_envs(cfg, seed=0)
    policy = policy_for(runner)
    actions = torch.linspace(-0.6, 0.6, 5).repeat(2, 1)  # the same action every step, both envs

    def act(obs):
        return actions[: len(obs["proprio"])], None, None

    loop = EpisodeRunner(runner)
    res = loop.episodes(
        Actor(policy.observe, act), EpisodeSpecs.indexed([0], [5], [7]), max_steps=4
    )
    assert len(res.cut) == 1 and res.rows.end.tolist() == [CUT] and len(res.episodes.spec) == 0
    spec, snap = res.cut[0]
    assert spec == 0 and snap["length"] == 4
    cont = loop.episodes(Actor(policy.observe, act), EpisodeSpecs.branched([0, 0], [snap, snap]))
    full = loop.episodes(Actor(policy.observe, act), EpisodeSpecs.indexed([0], [5], [7]))
    a, b, whole = (
        cont.rows.inputs["proprio"][0],
        cont.rows.inputs["proprio"][1],
        full.rows.inputs["proprio"][0],
    )
    torch.testing.assert_close(a, b)  # both copies of the snapshot: one physics
    torch.testing.assert_close(a, whole[4:])  # and the uninterrupted episode's
    assert cont.episodes.length.tolist() == [10, 10]  # the time limit counts the trunk's steps
    runner.close()


def test_tree_groups_share_trunks_and_keep_group_size_leaves():
    cfg = env_cfg(num_envs=3)
    runner = make_envs(cfg, seed=1)
    policy = policy_for(runner)
    col = GRPOCollector(cfg, groups=2, group_size=4, seed=1, runner=runner, branches=[2, 2],
                        segment_steps=3)  # fmt: skip
    batch, m = col.collect(policy, 0)
    assert len(batch) == 8 and batch.group_id.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert batch.segments is not None and batch.tokens.shape[-1] == 5
    for g in (0, 1):
        rows = (batch.group_id == g).nonzero().flatten().tolist()
        root = {int(batch.segments.node[r, 0]) for r in rows}
        assert len(root) == 1  # one root segment per group
        for r in rows:  # every leaf: 3 root steps, 3 middle steps, then its own, 10 in all
            assert int(batch.mask[r].sum()) == 10
            assert len(torch.unique_consecutive(batch.segments.node[r, :10])) == 3
        first = rows[0]
        for r in rows[1:]:  # the trunk's actions and observations are shared
            torch.testing.assert_close(batch.tokens[r, :3], batch.tokens[first, :3])
            torch.testing.assert_close(
                batch.inputs["objects"][r][:4], batch.inputs["objects"][first][:4]
            )
        mids = {int(batch.segments.node[r, 3]) for r in rows}
        assert len(mids) == 2  # two middle nodes, two leaves each
        # siblings start from the same saved state and then differ (independent sampling)
        assert not torch.equal(batch.tokens[rows[0], 6:], batch.tokens[rows[1], 6:])
        torch.testing.assert_close(
            batch.inputs["proprio"][rows[0]][6], batch.inputs["proprio"][rows[1]][6]
        )
    # 2 roots x 3 + 4 middle x 3 + 8 leaves x 4 env steps, every episode accounted once
    assert m["rollout/env_steps"] == 2 * 3 + 4 * 3 + 8 * 4 and m["rollout/episodes"] == 8
    runner.close()


def test_fallback_gives_an_ended_branch_budget_to_running_ones():
    nodes = [_Node(None, 0, 4), _Node(0, 0, 2), _Node(0, 0, 2), _Node(None, 1, 2)]
    _give_back(nodes, ended=[1, 3], running=[2])
    assert [n.budget for n in nodes] == [4, 1, 3, 1]  # group 1 has nothing running: 1 leaf
    assert _split(3, 2) == [2, 1] and _split(4, 4) == [1, 1, 1, 1]


def test_bad_tree_settings_are_named():
    with pytest.raises(ValueError, match="product"):
        GRPOCollector(env_cfg(), groups=1, group_size=4, branches=[3], runner=object())


def test_grpo_trains_on_a_vla_tree(tmp_path):
    from pathlib import Path

    from perceptrl.vla.builder import build_trainer
    from perceptrl.wiring import load_config

    configs = Path(__file__).resolve().parents[2] / "configs"
    cfg = load_config(
        configs / "vla_grpo.yaml",
        ["env.id=perceptrl/Reach-v0", "env.max_episode_steps=12", "env.num_envs=4",
         "env.eval_episodes=0", "rollout.prompts_per_step=2", "rollout.group_size=4",
         "rollout.tree.branches=[4]", "rollout.tree.segment_tokens=4", "algo.adv_estimator=treepo",
         "algo.dynamic_sampling=false", "train.steps=2", "log.tensorboard=false",
         "log.progress=false"],
    )  # fmt: skip
    trainer = build_trainer(cfg, tmp_path)
    trainer.fit()
    assert trainer.step == 2
    trainer.source.close()
    assert np.isfinite(trainer.last_eval.get("eval/success_rate", 0.0))
