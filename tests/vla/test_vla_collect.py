"""Collectors: PPO segment layout and bootstrapping, GRPO groups, bad actions, dead workers."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from perceptrl.vla.collect import GRPOCollector, PPOCollector  # noqa: E402
from perceptrl.vla.compact import CompactSpec, CompactVLA  # noqa: E402
from perceptrl.vla.config import (
    EnvConfig,  # noqa: E402
    VLAConfig,  # noqa: E402
)
from perceptrl.vla.envs import VecRunner  # noqa: E402


def state_env(**kw) -> EnvConfig:
    base = dict(id="perceptrl/Reach-v0", num_envs=2, obs_mode="state", steps_per_rollout=12,
                max_episode_steps=5)  # fmt: skip
    return EnvConfig(**{**base, **kw})


def policy_for(runner: VecRunner, chunk: int = 1) -> CompactVLA:
    torch.manual_seed(0)
    obj = runner.observation_space["objects"].shape[0]
    return CompactVLA(
        CompactSpec(5, chunk=chunk, objects_dim=obj, vla=VLAConfig(encoder="state", hidden=32))
    )


class ExpertActions:
    """Test double: the CompactVLA's observations, the scripted expert's actions (to reach
    success and terminate quickly); values from the real policy."""

    def __init__(self, policy: CompactVLA, runner: VecRunner):
        from perceptrl.sim.expert import ScriptedExpert

        self.policy, self.runner = policy, runner
        self.experts = [ScriptedExpert(e) for e in runner.envs]
        self.observe, self.value = policy.observe, policy.value

    def act(self, obs, deterministic=False):
        _, logp, value = self.policy.act(obs)
        a = np.stack([ex.act() for ex in self.experts])
        return torch.from_numpy(a), logp, value


def test_ppo_segments_right_padded_with_bootstrap_on_truncation():
    runner = VecRunner(state_env(), seed=3)
    policy = policy_for(runner)
    col = PPOCollector(runner.cfg, seed=3, runner=runner)
    batch, m = col.collect(policy, 0)
    # 2 envs x 12 steps, episodes of 5: per env 2 truncated episodes + a cut segment of 2
    lens = sorted(int(x) for x in batch.mask.sum(1))
    assert lens == [2, 2, 5, 5, 5, 5] and batch.tokens.shape == (6, 5, 5)
    assert batch.rewards.shape == batch.mask.shape and batch.bootstrap_value.shape == (6,)
    for b, meta in enumerate(batch.meta):
        n = int(batch.mask[b].sum())
        assert batch.mask[b, :n].all() and not batch.mask[b, n:].any()
        assert all(x.shape[0] == n for xs in batch.inputs.values() for x in [xs[b]])
        assert meta["end"] in ("truncated", "cut") and batch.bootstrap_value[b] != 0
    assert m["rollout/episodes"] == 4 and m["rollout/episode_length"] == 5
    # the cut segments bootstrap from the state the next collection continues from
    _, _, v_now = policy.act(policy.observe(runner.batch))
    cut = [b for b, meta in enumerate(batch.meta) if meta["end"] == "cut"]
    torch.testing.assert_close(sorted(batch.bootstrap_value[cut].tolist()), sorted(v_now.tolist()))
    ev = policy.evaluate(batch)
    lp, v = ev.logp, ev.value
    assert torch.isfinite(lp).all()
    # the log-probs and values recorded while acting are what the trainer would recompute
    torch.testing.assert_close(batch.logp_old, lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch.values_old, v, rtol=1e-5, atol=1e-5)
    batch2, _ = col.collect(policy, 1)  # episodes continue: 3 steps left, 5, then 4 cut
    assert sorted(int(x) for x in batch2.mask.sum(1)) == [3, 3, 4, 4, 5, 5]
    col.close()


def test_ppo_terminal_segments_bootstrap_zero():
    runner = VecRunner(state_env(max_episode_steps=0, steps_per_rollout=40), seed=1)
    policy = ExpertActions(policy_for(runner), runner)
    batch, m = PPOCollector(runner.cfg, runner=runner).collect(policy, 0)
    term = [b for b, meta in enumerate(batch.meta) if meta["end"] == "terminated"]
    assert term and m["rollout/success_rate"] == 1.0
    assert (batch.bootstrap_value[term] == 0).all()
    for b in term:  # the success reward sits on the last valid step
        n = int(batch.mask[b].sum())
        assert batch.rewards[b, n - 1] == 1.0
    runner.close()


def test_action_chunks_execute_k_env_steps():
    runner = VecRunner(state_env(action_chunk=3, max_episode_steps=7, steps_per_rollout=3))
    policy = policy_for(runner, chunk=3)
    batch, m = PPOCollector(runner.cfg, runner=runner).collect(policy, 0)
    assert batch.tokens.shape[-1] == 15
    assert m["rollout/episode_length"] == 7  # 3 + 3 + 1 env steps, the chunk cut by the limit
    assert sorted(int(x) for x in batch.mask.sum(1)) == [3, 3]
    runner.close()


def test_grpo_groups_share_initial_state():
    runner = VecRunner(state_env(num_envs=3), seed=0)
    policy = policy_for(runner)
    col = GRPOCollector(runner.cfg, groups=2, group_size=3, runner=runner)
    batch, m = col.collect(policy, 0)
    assert len(batch) == 6 and batch.rewards.shape == (6,)
    assert m["rollout/episodes"] == 6
    first = torch.stack([x[0] for x in batch.inputs["objects"]])  # initial entity poses
    for g in batch.group_id.unique():
        rows = (batch.group_id == g).nonzero().flatten()
        assert len(rows) == 3
        assert len({(batch.meta[r]["task_id"], batch.meta[r]["trial_id"]) for r in rows}) == 1
        torch.testing.assert_close(first[rows], first[rows[:1]].expand(3, -1))
        words = [tuple(batch.inputs["words"][r][0].tolist()) for r in rows]
        assert len(set(words)) == 1
    g0, g1 = batch.group_id.unique()[:2]
    assert not torch.equal(first[batch.group_id == g0][0], first[batch.group_id == g1][0])
    # actions are sampled: members of a group diverge
    a = batch.tokens[batch.group_id == g0][:, 0]
    assert not torch.equal(a[0], a[1])
    runner.close()


def test_nan_action_replaced_counted_and_never_sent(caplog):
    import dataclasses

    runner = VecRunner(state_env(), seed=0)
    runner.reset()
    for env in runner.envs:  # the env itself would now raise on a NaN action
        env.unwrapped.cfg = dataclasses.replace(env.unwrapped.cfg, invalid_action="raise")
    tcp0 = runner.batch.proprio[:, :3].copy()
    actions = np.zeros((2, 1, 5), np.float32)
    actions[0, 0, 0] = np.nan
    actions[1, 0, :3] = 1.0
    with caplog.at_level("WARNING"):
        res = runner.step(actions)
    assert runner.counters["bad_actions"] == 1 and "non-finite" in caplog.text
    moved = np.linalg.norm(res.batch.proprio[:, :3] - tcp0, axis=1)
    assert moved[0] < 0.005 < moved[1]  # env 0 got a no-op, env 1 moved
    runner.close()


def test_dead_worker_restarts_and_counts_dropped_episodes():
    runner = VecRunner(state_env(async_envs=True, steps_per_rollout=4), seed=0)
    policy = policy_for(runner)
    col = PPOCollector(runner.cfg, runner=runner)
    try:
        col.collect(policy, 0)
        runner.env.processes[0].kill()
        runner.env.processes[0].join(timeout=10)
        batch, m = col.collect(policy, 1)
        assert m["rollout/env_restarts"] == 1 and m["rollout/dropped_episodes"] == 2
        assert torch.isfinite(policy.evaluate(batch).logp).all()
        batch, m = col.collect(policy, 2)  # the rebuilt env keeps working
        assert batch.mask.sum() == 2 * 4
    finally:
        runner.close()


def test_bad_shapes_are_rejected():
    runner = VecRunner(state_env(), seed=0)
    runner.reset()
    with pytest.raises(ValueError, match="expects actions"):
        runner.step(np.zeros((2, 5), np.float32))
    runner.close()


def test_state_critic_without_poses_stops_ppo_collection_with_the_setting():
    cfg = EnvConfig(id="perceptrl/Reach-v0", num_envs=1, obs_mode="rgb", image_size=32,
                    steps_per_rollout=2, max_episode_steps=4)  # fmt: skip
    runner = VecRunner(cfg, seed=0)
    torch.manual_seed(0)
    spec = CompactSpec(
        5,
        image_size=32,
        objects_dim=21,
        vla=VLAConfig(encoder="keypoint", channels=[4, 8, 8], hidden=16, critic="state"),
    )
    col = PPOCollector(cfg, seed=0, runner=runner)
    with pytest.raises(ValueError, match="env.privileged_state=true"):
        col.collect(CompactVLA(spec), 0)
    col.close()
