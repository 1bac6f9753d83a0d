"""EpisodeRunner: segments, bootstraps, queues and restarts on counter envs with known dynamics;
on the real sim, evaluation against a plain one-env loop, GRPO queues and the PPO bootstrap."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")


import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from perceptrl.sim.backends import split_obs  # noqa: E402
from perceptrl.sim.expert import ScriptedExpert  # noqa: E402
from perceptrl.sim.vector import Batch, EnvRestarted, StepResult, VecEnv  # noqa: E402
from perceptrl.vla.collect import GRPOCollector, PPOCollector  # noqa: E402
from perceptrl.vla.compact import CompactSpec, CompactVLA  # noqa: E402
from perceptrl.vla.config import (
    EnvConfig,  # noqa: E402
    VLAConfig,  # noqa: E402
)
from perceptrl.vla.envs import env_kwargs, make_envs  # noqa: E402
from perceptrl.vla.episode_runner import (  # noqa: E402
    CUT,
    END_NAMES,
    TERMINATED,
    TRUNCATED,
    UNSTABLE,
    Actor,
    EpisodeRunner,
    EpisodeSpecs,
)
from perceptrl.vla.evaluate import run_seeded  # noqa: E402

LIMIT = 4
"""time limit of the counter envs (policy steps)"""


class CounterEnvs:
    """N fake envs behind `VecEnv`'s surface. Env i observes ``(i, t, serial)``: t
    steps into its episode, serial = episodes it started. An episode terminates (success)
    after ``goal`` steps, from the reset option ``task_id`` (or the seed, or ``2 + serial % 4``
    for a plain reset), and is truncated at ``LIMIT``; step t's reward is ``0.1 * t``.
    ``fail_at``: the global step that raises `EnvRestarted` (all envs reset, as `VecEnv` does)."""

    def __init__(self, n: int, fail_at: int = -1):
        self.n, self.action_dim, self.env_id, self.time_limit = n, 1, "counter", LIMIT
        self.counters = {"bad_actions": 0, "dropped_episodes": 0, "env_restarts": 0}
        self.t, self.serial, self.goal = (np.zeros(n, np.int64) for _ in range(3))
        self.steps, self.fail_at, self.batch = 0, fail_at, None

    def _obs(self) -> Batch:
        x = np.stack([np.arange(self.n), self.t, self.serial], 1).astype(np.float32)
        return Batch(proprio=x, instructions=[""] * self.n)

    def reset(self, mask=None, options=None, seeds=None) -> Batch:
        mask = np.ones(self.n, bool) if mask is None else mask
        for i in np.flatnonzero(mask):
            self.serial[i] += 1
            self.t[i] = 0
            if options is not None:
                self.goal[i] = options[i]["task_id"]
            elif seeds is not None and seeds[i] is not None:
                self.goal[i] = seeds[i]
            else:
                self.goal[i] = 2 + (self.serial[i] + i) % 4
        self.batch = self._obs()
        return self.batch

    def noop(self) -> np.ndarray:
        return np.zeros((self.n, 1), np.float32)

    def step(self, actions: np.ndarray) -> StepResult:
        assert actions.shape == (self.n, 1, 1)
        self.steps += 1
        if self.steps == self.fail_at:
            self.counters["env_restarts"] += 1
            self.counters["dropped_episodes"] += self.n
            self.reset()
            raise EnvRestarted("counter envs restarted")
        self.t += 1
        term = self.t >= self.goal
        trunc = (self.t >= LIMIT) & ~term
        self.batch = self._obs()
        reward = (0.1 * self.t).astype(np.float32)
        return StepResult(self.batch, reward, term, trunc, term, np.ones(self.n, int))


def v_of(x: torch.Tensor) -> torch.Tensor:
    """The counter actor's critic: 100 env + 10 serial + t."""
    return 100 * x[:, 0] + 10 * x[:, 2] + x[:, 1]


def counter_actor(calls: dict | None = None) -> Actor:
    calls = {} if calls is None else calls

    def act(obs):
        calls["act"] = calls.get("act", 0) + 1
        x = obs["x"]
        return 0.01 * x[:, 1:2], -x[:, 1], v_of(x)

    observe = lambda b: {"x": torch.from_numpy(b.proprio.copy())}  # noqa: E731
    return Actor(observe, act, lambda obs: v_of(obs["x"]))


def check_rows(rows, envs: CounterEnvs) -> None:
    """Each row: one env's consecutive steps of one episode, right-padded, with the rewards,
    log-probs and values of those steps and the bootstrap its end calls for."""
    for b, n in enumerate(rows.lengths()):
        x = rows.inputs["x"][b]  # (n, 3)
        assert x.shape == (n, 3) and rows.mask[b, :n].all() and not rows.mask[b, n:].any()
        assert (x[:, 0] == x[0, 0]).all() and (x[:, 2] == x[0, 2]).all()
        t = x[:, 1]
        assert torch.equal(t, t[0] + torch.arange(n, dtype=t.dtype))
        torch.testing.assert_close(rows.rewards[b, :n], 0.1 * (t + 1))
        torch.testing.assert_close(rows.logp[b, :n], -t)
        torch.testing.assert_close(rows.value[b, :n], v_of(x))
        last = x[-1].clone()
        last[1] += 1  # the observation after the segment's last step
        if rows.end[b] == TERMINATED:
            assert rows.bootstrap[b] == 0 and rows.success[b]
        elif rows.end[b] == TRUNCATED:
            assert last[1] == LIMIT and not rows.success[b]
            assert rows.bootstrap[b] == v_of(last[None])[0]
        else:
            assert rows.end[b] == CUT and rows.bootstrap[b] == v_of(last[None])[0]


def test_horizon_segments_bootstraps_and_continuation():
    envs = CounterEnvs(3)
    calls: dict = {}
    loop = EpisodeRunner(envs)
    actor = counter_actor(calls)
    first = loop.horizon(actor, 6)
    assert calls["act"] == 6  # bootstraps never sample an action
    rows = first.rows
    check_rows(rows, envs)
    # goals 3, 4, 5 then 4, 5, 2: ordered by last step, horizon cuts last, then env
    env_of = [int(x[0, 0]) for x in rows.inputs["x"]]
    assert list(zip(env_of, rows.end.tolist(), rows.lengths())) == [
        (0, TERMINATED, 3), (1, TERMINATED, 4), (2, TRUNCATED, 4), (2, TERMINATED, 2),
        (0, CUT, 3), (1, CUT, 2),
    ]  # fmt: skip
    assert first.env_steps == 18 and rows.actions.shape == (6, 4, 1)
    # the horizon cuts bootstrap from the observation the next call continues from
    torch.testing.assert_close(rows.bootstrap[4:], v_of(torch.from_numpy(envs.batch.proprio))[:2])
    ep = first.episodes
    assert ep.success.tolist() == [True, True, False, True] and (ep.spec == -1).all()
    assert ep.length.tolist() == [3, 4, 4, 2]
    np.testing.assert_allclose(ep.ret[:2], [0.6, 1.0], rtol=1e-6)
    second = loop.horizon(actor, 6).rows
    check_rows(second, envs)
    heads = {int(x[0, 0]): x[0] for x in reversed(second.inputs["x"])}  # each env's first row
    torch.testing.assert_close(heads[0], torch.tensor([0.0, 3.0, 2.0]))  # episode continued
    torch.testing.assert_close(heads[1], torch.tensor([1.0, 2.0, 2.0]))
    torch.testing.assert_close(heads[2], torch.tensor([2.0, 0.0, 3.0]))  # fresh episode


def test_horizon_restart_cuts_with_the_value_of_the_failed_step():
    envs = CounterEnvs(2, fail_at=3)
    loop = EpisodeRunner(envs)
    res = loop.horizon(counter_actor(), 5)
    rows = res.rows
    check_rows(rows, envs)
    # steps 0-1 recorded, step 2 failed (no data), steps 3-4 of fresh episodes
    assert sum(rows.lengths()) == 2 * 4 and res.env_steps == 8
    assert len(res.episodes.spec) == int((rows.end != CUT).sum())


def test_episode_queue_longer_than_envs_runs_each_spec_once():
    goals = np.array([1, 5, 2, 3, 9, 2, 4])  # 5 and 9 hit the time limit
    specs = EpisodeSpecs.indexed(np.arange(7) // 2, goals, np.zeros(7))
    for fail_at in (-1, 4):
        envs = CounterEnvs(3, fail_at=fail_at)
        res = EpisodeRunner(envs).episodes(counter_actor(), specs)
        rows = res.rows
        check_rows(rows, envs)
        assert sorted(rows.spec.tolist()) == list(range(7))  # dropped episodes re-ran
        for b, j in enumerate(rows.spec):
            assert rows.lengths()[b] == min(goals[j], LIMIT)
            assert rows.inputs["x"][b][0, 1] == 0  # whole episodes only
            assert rows.success[b] == (goals[j] <= LIMIT)
        assert sorted(res.episodes.spec.tolist()) == list(range(7))
        assert envs.counters["env_restarts"] == (fail_at > 0)


def test_seeded_runs_without_rows_report_episodes_in_spec_order():
    envs = CounterEnvs(2)
    res = EpisodeRunner(envs, rows=False).episodes(counter_actor(), EpisodeSpecs.seeded([3, 1, 2]))
    assert res.rows is None
    order = np.argsort(res.episodes.spec)
    assert res.episodes.length[order].tolist() == [3, 1, 2]
    np.testing.assert_allclose(res.episodes.ret[order], [0.6, 0.1, 0.3], rtol=1e-6)
    assert res.episodes.success.all() and res.env_steps == 6


# ---------------------------------------------------------------------- the real sim
def state_env(**kw) -> EnvConfig:
    base = dict(id="perceptrl/Reach-v0", num_envs=3, obs_mode="state", steps_per_rollout=7,
                max_episode_steps=5)  # fmt: skip
    return EnvConfig(**{**base, **kw})


def small_policy(runner: VecEnv, chunk: int = 1) -> CompactVLA:
    torch.manual_seed(0)
    obj = runner.observation_space["objects"].shape[0]
    return CompactVLA(
        CompactSpec(5, chunk=chunk, objects_dim=obj, vla=VLAConfig(encoder="state", hidden=32))
    )


class NoisyExpert:
    """The scripted reach expert plus 3x the policy's mean action: episodes of varied length
    and outcome, deterministic given the seed."""

    def __init__(self, policy: CompactVLA, envs: list):
        self.policy, self.spec, self.observe = policy, policy.spec, policy.observe
        self.experts = [ScriptedExpert(e) for e in envs]

    def act(self, obs, deterministic=True):
        a, logp, v = self.policy.act(obs, deterministic=True)
        e = torch.from_numpy(np.stack([x.act() for x in self.experts])).repeat(1, self.spec.chunk)
        return e + 3.0 * a, logp, v


def reference_episode(policy: CompactVLA, cfg: EnvConfig, seed: int) -> tuple[float, float, int]:
    """One episode on one plain gymnasium env: (success, return, env steps)."""
    env = gym.make(cfg.id, **env_kwargs(cfg))
    actor = NoisyExpert(policy, [env])
    obs, _ = env.reset(seed=seed)
    ok, ret, n, done = False, 0.0, 0, False
    while not done:
        batch = split_obs(
            {k: [v] if k == "instruction" else np.asarray(v)[None] for k, v in obs.items()}
        )
        action, _, _ = actor.act(policy.observe(batch))
        for a in np.clip(action.numpy().reshape(-1, 5), -1, 1):
            obs, r, te, tr, info = env.step(a)
            ret, n = ret + float(r), n + 1
            ok |= bool(info["success"]) or te
            if te or tr:
                done = True
                break
    env.close()
    return float(ok), ret, n


def test_seeded_evaluation_matches_a_plain_one_env_loop():
    cfg = state_env(action_chunk=2, max_episode_steps=14, reward_mode="dense")
    runner = make_envs(cfg, seed=0)
    policy = small_policy(runner, chunk=2)
    seeds = [1_000_000 + j for j in range(5)]
    try:
        got = run_seeded(NoisyExpert(policy, runner.envs), runner, seeds)
    finally:
        runner.close()
    want = [reference_episode(policy, cfg, s) for s in seeds]
    assert got["success"] == [w[0] for w in want]
    assert got["length"] == [w[2] for w in want]
    np.testing.assert_allclose(got["return"], [w[1] for w in want], rtol=1e-6)
    assert 0 < sum(got["success"]) < len(seeds)  # the check sees both outcomes


def test_grpo_queue_longer_than_envs_starts_each_group_from_its_state():
    cfg = state_env(num_envs=2)
    runner = make_envs(cfg, seed=0)
    col = GRPOCollector(cfg, groups=3, group_size=3, runner=runner)
    try:
        batch, m = col.collect(small_policy(runner), 4)
    finally:
        runner.close()
    assert len(batch) == 9 and m["rollout/episodes"] == 9
    assert (
        batch.group_id.tolist() == [12] * 3 + [13] * 3 + [14] * 3
    )  # contiguous, step * groups + g
    ref = gym.make("perceptrl/Reach-v0", obs_mode="state")
    for b, meta in enumerate(batch.meta):
        obs, _ = ref.reset(options=meta)
        np.testing.assert_allclose(batch.inputs["objects"][b][0].numpy(), obs["objects"], atol=1e-6)
    ref.close()


class CountingPolicy:
    """A CompactVLA that counts its ``act`` calls."""

    def __init__(self, policy: CompactVLA):
        self.policy, self.acts = policy, 0
        self.observe, self.value = policy.observe, policy.value

    def act(self, obs, deterministic=False):
        self.acts += 1
        return self.policy.act(obs, deterministic=deterministic)


def test_ppo_bootstraps_read_the_critic_without_sampling():
    cfg = state_env()
    runner = make_envs(cfg, seed=1)
    policy = CountingPolicy(small_policy(runner))
    col = PPOCollector(cfg, seed=1, runner=runner)
    try:
        batch, m = col.collect(policy, 0)
        assert policy.acts == 7  # one act per policy step: none for the bootstraps
        assert m["rollout/episodes"] == 3  # each env truncated once at 5 steps
        cut = [b for b, x in enumerate(batch.meta) if x["end"] == "cut"]
        trunc = [b for b, x in enumerate(batch.meta) if x["end"] == "truncated"]
        assert len(cut) == len(trunc) == 3
        v_next = policy.value(policy.observe(runner.batch))
        torch.testing.assert_close(batch.bootstrap_value[cut].sort().values, v_next.sort().values)
        assert (batch.bootstrap_value[trunc] != 0).all()
    finally:
        runner.close()


class BlowUpOnce(CounterEnvs):
    """CounterEnvs whose env 0 blows up at step ``at`` of its first episode: truncated, with
    the observation of a restored initial state (t = 0), as ManipEnv does."""

    def __init__(self, n: int, at: int):
        super().__init__(n)
        self.at = at

    def step(self, actions: np.ndarray) -> StepResult:
        res = super().step(actions)
        res.unstable = np.zeros(self.n, bool)
        if self.serial[0] == 1 and self.t[0] == self.at and not res.terminated[0]:
            res.unstable[0] = res.truncated[0] = True
            res.reward[0] = 0.0
            self.t[0] = 0
            res.batch = self.batch = self._obs()
        return res


def test_blow_up_drops_its_step_and_bootstraps_from_the_state_it_acted_on():
    loop = EpisodeRunner(BlowUpOnce(1, at=2))
    res = loop.horizon(counter_actor(), 6)
    rows = res.rows
    # steps 0-1 of episode 1 (step 1 blew up: dropped), then episode 2 (goal 4): steps 2-5
    assert rows.end.tolist() == [UNSTABLE, TERMINATED] and rows.lengths() == [1, 4]
    assert [END_NAMES[e] for e in rows.end] == ["unstable", "terminated"]
    # V(obs at the blow-up step: env 0, serial 1, t 1), not V(the restored initial state)
    assert rows.bootstrap.tolist() == [11.0, 0.0]
    assert res.episodes.unstable.tolist() == [True, False]
    assert res.episodes.length.tolist() == [2, 4] and res.episodes.success.tolist() == [0, 1]
    # whole-episode schedules (GRPO, evaluation) report it too, with what it achieved
    specs = EpisodeSpecs.indexed([0, 1], [3, 3], [0, 0])
    res = EpisodeRunner(BlowUpOnce(1, at=2)).episodes(counter_actor(), specs)
    assert res.rows.spec.tolist() == [0, 1] and res.rows.lengths() == [1, 3]
    assert res.rows.end.tolist() == [UNSTABLE, TERMINATED]
    assert res.episodes.unstable.tolist() == [True, False]
    assert res.episodes.success.tolist() == [False, True]
