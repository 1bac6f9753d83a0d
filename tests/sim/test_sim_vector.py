"""The vector envs: gymnasium's (`make_vec`, per-env options through the slots), the one layer
`VecEnv` (masked resets, chunks, snapshots, worker faults) and the shared-memory instructions."""

from __future__ import annotations

import copy

import gymnasium as gym
import numpy as np
import pytest

from perceptrl.sim import ENV_IDS
from perceptrl.sim.backends import PER_ENV, make_vec
from perceptrl.sim.vector import EnvRestarted, VecEnv

KW = {"width": 32, "height": 32}


def _indexed(*ids: int, trial: int = 0) -> list[dict]:
    return [{"task_id": i, "trial_id": trial} for i in ids]


@pytest.mark.parametrize("async_", [False, True])
def test_vec_env_gives_arrays_and_live_instructions(async_):
    env = VecEnv(ENV_IDS["pick"], 2, async_=async_, **KW)
    batch = env.reset(options=_indexed(4, 5))
    assert batch.images["agentview"].shape == (2, 32, 32, 3)
    assert batch.images["wrist"].dtype == np.uint8 and batch.proprio.shape == (2, 8)
    assert all(batch.instructions) and batch.instructions[0] != batch.instructions[1]
    ref = gym.make(ENV_IDS["pick"], **KW)
    obs0, _ = ref.reset(options={"task_id": 4, "trial_id": 0})
    assert batch.instructions[0] == obs0["instruction"]
    assert np.array_equal(batch.images["agentview"][0], obs0["agentview"])
    first = list(batch.instructions)
    batch = env.reset(options=[{"task_id": 9, "trial_id": 1}, {"task_id": 9, "trial_id": 2}])
    assert batch.instructions[0] == batch.instructions[1] != first[0]
    res = env.step(np.zeros((2, 1, 5), np.float32))
    assert (
        res.reward.shape == (2,)
        and res.terminated.dtype == bool
        and res.env_steps.tolist() == [1, 1]
    )
    with pytest.raises(ValueError, match="expects actions"):
        env.step(np.zeros((3, 1, 5)))
    with pytest.raises(ValueError, match="one entry"):
        env.reset(options=_indexed(3))
    env.close()
    ref.close()


def test_sync_vector_matches_single_env_loop():
    vec = make_vec(ENV_IDS["push"], 2, obs_mode="state")
    vobs, _ = vec.reset(seed=10)
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, (5, 2, 5)).astype(np.float32)
    vsteps = [vec.step(a) for a in actions]
    vec.close()
    for i in range(2):
        env = gym.make(ENV_IDS["push"], obs_mode="state")
        obs, _ = env.reset(seed=10 + i)
        assert np.array_equal(obs["objects"], vobs["objects"][i])
        for a, (vo, vr, *_rest) in zip(actions, vsteps, strict=True):
            obs, r, *_ = env.step(a[i])
            assert np.array_equal(obs["objects"], vo["objects"][i]) and r == vr[i]
        env.close()


def test_each_sub_env_takes_its_own_reset_options():
    """gymnasium hands every sub-env the same options; the slots give each its own entry."""
    vec = make_vec(ENV_IDS["put"], 3, obs_mode="state")
    obs, infos = vec.reset(options={PER_ENV: [*_indexed(3, 4), None]}, seed=[None, None, 7])
    ref = gym.make(ENV_IDS["put"], obs_mode="state")
    for i, (opts, seed) in enumerate([({"task_id": 3, "trial_id": 0}, None),
                                      ({"task_id": 4, "trial_id": 0}, None), (None, 7)]):  # fmt: skip
        want, _ = ref.reset(seed=seed, options=opts)
        assert np.array_equal(obs["objects"][i], want["objects"])
    assert infos["task_id"].tolist()[:2] == [3, 4] and not infos["_task_id"][2]
    assert [e.index for e in vec.envs] == [0, 1, 2]
    with pytest.raises(ValueError, match="one entry per env"):
        vec.reset(options={PER_ENV: _indexed(3, 4)})
    vec.close()
    ref.close()


def test_async_state_mode_runs_through_autoreset():
    vec = make_vec(ENV_IDS["reach"], 2, async_=True, obs_mode="state")
    obs, _ = vec.reset(seed=0)
    steps = gym.spec(ENV_IDS["reach"]).max_episode_steps + 3
    ended = np.zeros(2, bool)
    for _ in range(steps):
        obs, _, term, trunc, _ = vec.step(np.zeros((2, 5), np.float32))
        ended |= term | trunc
        assert all(obs["instruction"])
    assert ended.all()
    vec.close()


def test_live_texts_freeze_on_copy():
    vec = make_vec(ENV_IDS["reach"], 2, async_=True, obs_mode="state")
    vec.copy = False  # observations are then live views of the shared buffer
    obs, _ = vec.reset(options={"task_id": 0})
    frozen = copy.deepcopy(obs["instruction"])
    assert isinstance(frozen, tuple) and frozen == tuple(obs["instruction"])
    vec.reset(options={"task_id": 1})
    assert tuple(obs["instruction"]) != frozen  # the live view followed the buffer
    vec.close()


@pytest.mark.parametrize("async_", [False, True])
def test_masked_reset_spaces_and_sub_envs(async_):
    env = VecEnv(ENV_IDS["push"], 3, async_=async_, obs_mode="state")
    assert env.observation_space["objects"].shape[0] > 0
    assert env.action_space.shape == (5,) and env.action_dim == 5
    first = env.reset(seeds=0)
    again = env.reset(mask=np.array([False, True, False]), seeds=[None, 7, None])
    assert np.array_equal(again.objects[[0, 2]], first.objects[[0, 2]])  # untouched
    assert not np.array_equal(again.objects[1], first.objects[1])
    ref = gym.make(ENV_IDS["push"], obs_mode="state")
    assert np.array_equal(again.objects[1], ref.reset(seed=7)[0]["objects"])
    assert np.array_equal(first.objects[2], ref.reset(seed=2)[0]["objects"])  # seed + i
    ref.close()
    assert env.reset(mask=np.zeros(3, bool)) is again  # nobody to reset
    with pytest.raises(ValueError, match="mask must be"):
        env.reset(mask=np.array([True, False]))
    if async_:
        assert len(env.env.processes) == 3
        with pytest.raises(RuntimeError, match="async_=False"):
            env.envs  # noqa: B018
    else:
        assert [e.index for e in env.envs] == [0, 1, 2]
    env.close()


def test_a_first_masked_reset_resets_every_env_first():
    env = VecEnv(ENV_IDS["reach"], 2, seed=5, obs_mode="state")
    batch = env.reset(mask=np.array([False, True]), seeds=[None, 9])
    ref = gym.make(ENV_IDS["reach"], obs_mode="state")
    assert np.array_equal(batch.objects[0], ref.reset(seed=5)[0]["objects"])
    assert np.array_equal(batch.objects[1], ref.reset(seed=9)[0]["objects"])
    env.close()
    ref.close()


@pytest.mark.parametrize("async_", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_state_round_trip_continues_exactly(async_):
    """A snapshot of every env (physics, layout, RNG, time-limit count, last observations)
    restored into fresh envs continues the episodes as the original does, through the time
    limit and the next resets."""
    kw = dict(obs_mode="state", max_episode_steps=6)
    a = VecEnv(ENV_IDS["push"], 2, async_=async_, **kw)
    b = VecEnv(ENV_IDS["push"], 2, seed=50, async_=async_, **kw)
    actions = np.random.default_rng(1).uniform(-1, 1, (9, 2, 1, 5)).astype(np.float32)
    try:
        a.reset()
        for x in actions[:4]:
            a.step(x)
        b.reset()
        b.set_state(a.get_state())
        np.testing.assert_array_equal(a.batch.objects, b.batch.objects)
        for k, x in enumerate(actions[4:6]):
            ra, rb = a.step(x), b.step(x)
            np.testing.assert_array_equal(ra.batch.objects, rb.batch.objects)
            np.testing.assert_array_equal(ra.batch.proprio, rb.batch.proprio)
            for f in ("reward", "terminated", "truncated", "success"):
                np.testing.assert_array_equal(getattr(ra, f), getattr(rb, f))
            assert ra.truncated.all() == (k == 1)  # the time limit (6 steps) falls at the same step
        ra, rb = a.reset(), b.reset()  # the layouts np_random draws next
        assert np.array_equal(ra.objects, rb.objects)
    finally:
        a.close()
        b.close()


@pytest.mark.slow  # the collectors' tests go through the same path in `make test`
def test_a_worker_that_raises_or_dies_restarts_the_envs():
    env = VecEnv(ENV_IDS["reach"], 2, async_=True, obs_mode="state")
    try:
        env.reset()
        # a ValueError raised inside worker 1's reset (a task id that is no number) ends it
        with pytest.raises(EnvRestarted, match="ValueError"):
            env.reset(options=[None, {"task_id": "x"}])
        assert env.counters == {"bad_actions": 0, "dropped_episodes": 2, "env_restarts": 1}
        env.env.processes[0].kill()
        env.env.processes[0].join(timeout=10)
        with pytest.raises(EnvRestarted):
            env.reset(mask=np.array([True, False]))
        assert env.counters["env_restarts"] == 2
        assert env.step(np.zeros((2, 1, 5), np.float32)).env_steps.tolist() == [1, 1]
    finally:
        env.close()
    sync = VecEnv(ENV_IDS["reach"], 2, obs_mode="state")
    with pytest.raises(ValueError, match="invalid literal"):  # in process: the error itself
        sync.reset(options=[None, {"task_id": "x"}])
    sync.close()
