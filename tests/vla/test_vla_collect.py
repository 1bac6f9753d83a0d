"""Collectors: PPO segment layout and bootstrapping, GRPO groups, bad actions, dead workers."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from perceptrl.sim.vector import VecEnv  # noqa: E402
from perceptrl.vla.collect import GRPOCollector, PPOCollector  # noqa: E402
from perceptrl.vla.compact import CompactSpec, CompactVLA  # noqa: E402
from perceptrl.vla.config import (
    EnvConfig,  # noqa: E402
    VLAConfig,  # noqa: E402
)
from perceptrl.vla.envs import make_envs  # noqa: E402


def state_env(**kw) -> EnvConfig:
    base = dict(id="perceptrl/Reach-v0", num_envs=2, obs_mode="state", steps_per_rollout=12,
                max_episode_steps=5)  # fmt: skip
    return EnvConfig(**{**base, **kw})


def policy_for(runner: VecEnv, chunk: int = 1) -> CompactVLA:
    torch.manual_seed(0)
    obj = runner.observation_space["objects"].shape[0]
    return CompactVLA(
        CompactSpec(5, chunk=chunk, objects_dim=obj, vla=VLAConfig(encoder="state", hidden=32))
    )


class ExpertActions:
    """Test double: the CompactVLA's observations, the scripted expert's actions (to reach
    success and terminate quickly); values from the real policy."""

    def __init__(self, policy: CompactVLA, runner: VecEnv):
        from perceptrl.sim.expert import ScriptedExpert

        self.policy, self.runner = policy, runner
        self.experts = [ScriptedExpert(e) for e in runner.envs]
        self.observe, self.value = policy.observe, policy.value

    def act(self, obs, deterministic=False):
        _, logp, value = self.policy.act(obs)
        a = np.stack([ex.act() for ex in self.experts])
        return torch.from_numpy(a), logp, value


def test_ppo_segments_right_padded_with_bootstrap_on_truncation():
    cfg = state_env()
    runner = make_envs(cfg, seed=3)
    policy = policy_for(runner)
    col = PPOCollector(cfg, seed=3, runner=runner)
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
    cfg = state_env(max_episode_steps=0, steps_per_rollout=40)
    runner = make_envs(cfg, seed=1)
    policy = ExpertActions(policy_for(runner), runner)
    batch, m = PPOCollector(cfg, runner=runner).collect(policy, 0)
    term = [b for b, meta in enumerate(batch.meta) if meta["end"] == "terminated"]
    assert term and m["rollout/success_rate"] == 1.0
    assert (batch.bootstrap_value[term] == 0).all()
    for b in term:  # the success reward sits on the last valid step
        n = int(batch.mask[b].sum())
        assert batch.rewards[b, n - 1] == 1.0
    runner.close()


def test_action_chunks_execute_k_env_steps():
    cfg = state_env(action_chunk=3, max_episode_steps=7, steps_per_rollout=3)
    runner = make_envs(cfg)
    policy = policy_for(runner, chunk=3)
    batch, m = PPOCollector(cfg, runner=runner).collect(policy, 0)
    assert batch.tokens.shape[-1] == 15
    assert m["rollout/episode_length"] == 7  # 3 + 3 + 1 env steps, the chunk cut by the limit
    assert sorted(int(x) for x in batch.mask.sum(1)) == [3, 3]
    runner.close()


def test_grpo_groups_share_initial_state():
    cfg = state_env(num_envs=3)
    runner = make_envs(cfg, seed=0)
    policy = policy_for(runner)
    col = GRPOCollector(cfg, groups=2, group_size=3, runner=runner)
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


def test_grpo_with_fewer_episodes_than_envs():
    """The envs left without an episode wait (no-op steps) in a valid state."""
    cfg = state_env(num_envs=4, max_episode_steps=4)
    runner = make_envs(cfg, seed=0)
    col = GRPOCollector(cfg, groups=1, group_size=2, runner=runner)
    try:
        batch, m = col.collect(policy_for(runner), 0)
    finally:
        runner.close()
    assert len(batch) == 2 and m["rollout/episodes"] == 2


def test_nan_action_replaced_counted_and_never_sent(caplog):
    import dataclasses

    cfg = state_env()
    runner = make_envs(cfg, seed=0)
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
    cfg = state_env(async_envs=True, steps_per_rollout=4)
    runner = make_envs(cfg, seed=0)
    policy = policy_for(runner)
    col = PPOCollector(cfg, runner=runner)
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
    cfg = state_env()
    runner = make_envs(cfg, seed=0)
    runner.reset()
    with pytest.raises(ValueError, match="expects actions"):
        runner.step(np.zeros((2, 5), np.float32))
    runner.close()


def test_state_critic_without_poses_stops_ppo_collection_with_the_setting():
    cfg = EnvConfig(id="perceptrl/Reach-v0", num_envs=1, obs_mode="rgb", image_size=32,
                    steps_per_rollout=2, max_episode_steps=4)  # fmt: skip
    runner = make_envs(cfg, seed=0)
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


# ---------------------------------------------------------------------- resume
def _same_batches(a, b) -> None:
    """Two (batch, metrics) results are identical (wall-clock metrics aside)."""
    (ba, ma), (bb, mb) = a, b
    for key in ("tokens", "mask", "rewards", "logp_old", "values_old", "bootstrap_value",
                "group_id"):  # fmt: skip
        x, y = getattr(ba, key), getattr(bb, key)
        assert (x is None) == (y is None), key
        if x is not None:
            assert torch.equal(x, y), key
    assert ba.meta == bb.meta and ba.inputs.keys() == bb.inputs.keys()
    for k in ba.inputs:
        assert all(torch.equal(x, y) for x, y in zip(ba.inputs[k], bb.inputs[k], strict=True)), k
    ma, mb = dict(ma), dict(mb)
    ma.pop("rollout/env_steps_per_s"), mb.pop("rollout/env_steps_per_s")
    assert ma == mb


def _collect(col, policy, steps) -> list:
    out = []
    for s in steps:
        torch.manual_seed(1000 + s)  # the trainer restores the global RNG on resume
        out.append(col.collect(policy, s))
    return out


def _through_checkpoint(state: dict, tmp_path) -> dict:
    """What `trainer/checkpoint.py` does with the source state: torch.save, weights_only load."""
    torch.save({"source": state}, tmp_path / "state.pt")
    return torch.load(tmp_path / "state.pt", weights_only=True)["source"]


@pytest.mark.parametrize("async_", [False, True])
def test_ppo_resume_continues_the_episodes_in_flight_exactly(async_, tmp_path):
    """A collector restored from a checkpoint in another runner (another process's envs)
    continues the episodes in flight: the same batches as the uninterrupted collector."""
    cfg = state_env(steps_per_rollout=3, max_episode_steps=5, async_envs=async_)
    a = PPOCollector(cfg, seed=4)
    policy = policy_for(a.runner)
    b = None
    try:
        _collect(a, policy, [0, 1])  # episodes of 5 steps are in flight at 3 and 6
        state = _through_checkpoint(a.state_dict(), tmp_path)
        want = _collect(a, policy, [2, 3])
        b = PPOCollector(cfg, seed=4)
        b.load_state_dict(state)
        got = _collect(b, policy, [2, 3])
        for x, y in zip(want, got, strict=True):
            _same_batches(x, y)
        # an episode that began before the checkpoint ended after it, at its time limit
        assert any(m["end"] == "truncated" and n < 5 for batch, _ in got
                   for m, n in zip(batch.meta, batch.mask.sum(1).tolist()))  # fmt: skip
    finally:
        a.close()
        if b is not None:
            b.close()


def test_grpo_resume_is_exact_once_the_rng_is_restored(tmp_path):
    cfg = state_env(num_envs=2, max_episode_steps=4)
    a = GRPOCollector(cfg, groups=2, group_size=2, seed=5)
    policy = policy_for(a.runner)
    try:
        _collect(a, policy, [0])
        state = _through_checkpoint(a.state_dict(), tmp_path)
        want = _collect(a, policy, [1, 2])
        b = GRPOCollector(cfg, groups=2, group_size=2, seed=5)
        b.load_state_dict(state)
        for x, y in zip(want, _collect(b, policy, [1, 2]), strict=True):
            _same_batches(x, y)
        b.close()
    finally:
        a.close()


# ---------------------------------------------------------------------- physics blow-ups
class BlowsUp:
    """The policy, plus a physics explosion injected into env 0 before its ``at``-th act
    (so the step that acts then blows up); records the values it gave."""

    def __init__(self, policy, runner: VecEnv, at: int):
        self.policy, self.runner, self.at, self.calls, self.values = policy, runner, at, 0, []
        self.observe, self.value = policy.observe, policy.value

    def act(self, obs, deterministic=False):
        self.calls += 1
        if self.calls == self.at:
            self.runner.envs[0].unwrapped.data.qvel[:] = 1e12
        out = self.policy.act(obs)
        self.values.append(out[2].detach().clone())
        return out


def test_blow_up_is_cut_before_its_step_without_bootstrapping_from_the_restored_state(caplog):
    cfg = state_env(steps_per_rollout=6, max_episode_steps=50)
    runner = make_envs(cfg, seed=2)
    actor = BlowsUp(policy_for(runner), runner, at=4)  # steps 0-2 fine, step 3 blows up
    col = PPOCollector(cfg, seed=2, runner=runner)
    try:
        with caplog.at_level("WARNING"):
            batch, m = col.collect(actor, 0)
    finally:
        col.close()
    ends = [meta["end"] for meta in batch.meta]
    assert ends.count("unstable") == 1 and "truncated" not in ends
    b = ends.index("unstable")
    assert int(batch.mask[b].sum()) == 3  # the step that blew up carries no data
    # bootstrapped with V(obs the blow-up step acted on), not V(the restored initial state)
    assert batch.bootstrap_value[b] == actor.values[3][0]
    # env 0 then runs a fresh episode (steps 4-5) cut by the horizon; env 1 never stopped
    assert sorted(int(n) for n in batch.mask.sum(1)) == [2, 3, 6]
    assert m["rollout/sim_unstable"] == 1 and m["rollout/sim_unstable_frac"] == 1.0
    assert m["rollout/episodes"] == 1
    assert "physics blow-up" in caplog.text and "env.control=ee" in caplog.text


# ---------------------------------------------------------------------- dead or raising workers
def sabotage(runner: VecEnv, fault: str, nth: int) -> list:
    """Make the ``nth`` reset of ``runner``'s current backend fail in a worker: worker 0 is
    killed just before it (``"kill"``), or every reset worker raises ValueError inside its
    reset (``"raise"``: a task id that is no number). The rebuilt backend is not sabotaged.
    Returns the list of reset masks seen."""
    env, calls = runner.env, []
    real = env.reset

    def reset(mask, options, seeds):
        calls.append(mask)
        if len(calls) == nth:
            if fault == "kill":
                env.processes[0].kill()
                env.processes[0].join(timeout=10)
            else:
                options = [{"task_id": "x"}] * len(options)
        return real(mask, options, seeds)

    env.reset = reset
    return calls


def _async(**kw) -> EnvConfig:
    return state_env(async_envs=True, **kw)


@pytest.mark.parametrize(
    "fault, which",
    [("kill", "ppo-first"), ("raise", "ppo-masked"),
     pytest.param("raise", "ppo-first", marks=pytest.mark.slow),
     pytest.param("kill", "ppo-masked", marks=pytest.mark.slow),
     pytest.param("kill", "ppo-park", marks=pytest.mark.slow),
     pytest.param("raise", "ppo-park", marks=pytest.mark.slow)],
)  # fmt: skip
def test_ppo_worker_failing_in_a_reset_is_restarted_and_counted(fault, which):
    """The first reset, the masked reset after an episode ended, and the park of an env whose
    episode ended mid-chunk: a worker that dies or raises there is restarted and counted, and
    the collection goes on (the episodes in flight are cut, never a crash)."""
    chunk = 2 if which == "ppo-park" else 1
    cfg = _async(steps_per_rollout=4, max_episode_steps=3, action_chunk=chunk)
    runner = make_envs(cfg)
    policy = policy_for(runner, chunk=chunk)
    col = PPOCollector(cfg, runner=runner)
    try:
        # resets: 1 the first, 2 the park of the envs that just ended (in VecEnv.step),
        # 3 the runner's masked reset into their next episodes
        nth = {"ppo-first": 1, "ppo-park": 2, "ppo-masked": 3}[which]
        calls = sabotage(runner, fault, nth)
        batch, m = col.collect(policy, 0)
        assert len(calls) >= nth
        assert m["rollout/env_restarts"] == 1 and m["rollout/dropped_episodes"] == 2
        assert torch.isfinite(policy.evaluate(batch).logp).all()
        batch, m = col.collect(policy, 1)  # the rebuilt env keeps working
        assert m["rollout/env_restarts"] == 1 and batch.mask.sum() == 2 * 4
    finally:
        col.close()


@pytest.mark.parametrize("fault", ["kill", pytest.param("raise", marks=pytest.mark.slow)])
def test_grpo_worker_failing_in_a_reset_reruns_the_episodes_it_dropped(fault):
    cfg = _async(num_envs=2, max_episode_steps=3)
    runner = make_envs(cfg)
    col = GRPOCollector(cfg, groups=3, group_size=1, runner=runner)
    try:
        sabotage(runner, fault, nth=3)  # 1 assign, 2 park, 3 the third episode's assign
        batch, m = col.collect(policy_for(runner), 0)
        assert m["rollout/env_restarts"] == 1 and m["rollout/episodes"] == 3
        assert sorted(batch.group_id.tolist()) == [0, 1, 2]  # each initial state ran once
        assert all(int(n) == 3 for n in batch.mask.sum(1))  # whole episodes only
    finally:
        col.close()
