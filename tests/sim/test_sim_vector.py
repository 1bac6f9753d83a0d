"""Sync and async vector envs, the batched helper and the shared-memory instruction space."""

from __future__ import annotations

import copy

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from perceptrl.sim import ENV_IDS
from perceptrl.sim.vector import BatchedEnv, make_vec

KW = {"width": 32, "height": 32}


@pytest.mark.parametrize("async_", [False, True])
def test_batched_env_gives_arrays_and_live_instructions(async_):
    env = BatchedEnv(ENV_IDS["pick"], 2, async_=async_, **KW)
    batch, infos = env.reset(options={"task_id": [4, 5], "trial_id": [0, 0]})
    assert batch.images["agentview"].shape == (2, 32, 32, 3)
    assert batch.images["wrist"].dtype == np.uint8 and batch.proprio.shape == (2, 8)
    assert all(batch.instructions) and batch.instructions[0] != batch.instructions[1]
    ref = gym.make(ENV_IDS["pick"], **KW)
    obs0, _ = ref.reset(options={"task_id": 4, "trial_id": 0})
    assert batch.instructions[0] == obs0["instruction"]
    assert np.array_equal(batch.images["agentview"][0], obs0["agentview"])
    first = list(batch.instructions)
    batch, infos = env.reset(options={"task_id": [9, 9], "trial_id": [1, 2]})
    assert batch.instructions[0] == batch.instructions[1] != first[0]
    actions = np.zeros((2, 5), np.float32)
    batch, rew, term, trunc, infos = env.step(actions)
    assert rew.shape == (2,) and term.dtype == bool and infos["success"].shape == (2,)
    with pytest.raises(ValueError, match="shape"):
        env.step(np.zeros((3, 5)))
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
def test_batched_env_masked_reset_spaces_and_sub_envs(async_):
    env = BatchedEnv(ENV_IDS["push"], 3, async_=async_, obs_mode="state")
    assert env.single_observation_space["objects"].shape[0] > 0
    assert env.single_action_space.shape == (5,)
    first, _ = env.reset(seed=0)
    again, _ = env.reset(mask=np.array([False, True, False]), seed=[None, 7, None])
    assert np.array_equal(again.objects[[0, 2]], first.objects[[0, 2]])  # untouched
    assert not np.array_equal(again.objects[1], first.objects[1])
    ref = gym.make(ENV_IDS["push"], obs_mode="state")
    assert np.array_equal(again.objects[1], ref.reset(seed=7)[0]["objects"])
    ref.close()
    with pytest.raises(ValueError, match="at least one True"):
        env.reset(mask=np.zeros(3, bool))
    if async_:
        assert len(env.processes) == 3
        with pytest.raises(RuntimeError, match="async_=False"):
            env.envs  # noqa: B018
    else:
        assert env.processes == [] and [e.unwrapped.cfg.vector_index for e in env.envs] == [0, 1, 2]
    env.close()


@pytest.mark.parametrize("async_", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_batched_env_state_round_trip_continues_exactly(async_):
    """A snapshot of every sub-env (physics, layout, RNG, time-limit count) restored into a
    fresh vector env continues the episodes as the original does, through the time limit."""
    kw = dict(obs_mode="state", max_episode_steps=6, autoreset_mode=AutoresetMode.DISABLED)
    a = BatchedEnv(ENV_IDS["push"], 2, async_=async_, **kw)
    b = BatchedEnv(ENV_IDS["push"], 2, async_=async_, **kw)
    actions = np.random.default_rng(1).uniform(-1, 1, (9, 2, 5)).astype(np.float32)
    try:
        a.reset(seed=0)
        for x in actions[:4]:
            a.step(x)
        b.reset(seed=50)
        b.set_state(a.get_state())
        for k, x in enumerate(actions[4:6]):
            ra, rb = a.step(x), b.step(x)
            assert np.array_equal(ra[0].objects, rb[0].objects)
            assert np.array_equal(ra[0].proprio, rb[0].proprio)
            for i in (1, 2, 3):
                assert np.array_equal(ra[i], rb[i])
            assert ra[3].all() == (k == 1)  # the time limit (6 steps) falls at the same step
        ra, rb = a.reset(), b.reset()  # the layouts np_random draws next
        assert np.array_equal(ra[0].objects, rb[0].objects)
    finally:
        a.close()
        b.close()


@pytest.mark.slow  # the collectors' tests go through the same path in `make test`
def test_a_worker_that_raises_or_dies_is_an_env_worker_error():
    from perceptrl.sim.vector import EnvWorkerError

    env = BatchedEnv(ENV_IDS["reach"], 2, async_=True, obs_mode="state")
    try:
        env.reset(seed=0)
        # a ValueError raised inside worker 1's reset (its options list is too short) ends it
        with pytest.raises(EnvWorkerError, match="died or raised") as err:
            env.reset(options={"task_id": [3], "trial_id": [0]})
        assert isinstance(err.value.__cause__, ValueError)
    finally:
        env.close()
    env = BatchedEnv(ENV_IDS["reach"], 2, async_=True, obs_mode="state")
    try:
        env.reset(seed=0)
        env.processes[0].kill()
        env.processes[0].join(timeout=10)
        with pytest.raises(EnvWorkerError):
            env.reset(mask=np.array([True, False]))
    finally:
        env.close()
    sync = BatchedEnv(ENV_IDS["reach"], 2, obs_mode="state")
    with pytest.raises(ValueError, match="vector_index"):  # in-process: the error itself
        sync.reset(options={"task_id": [3], "trial_id": [0]})
    sync.close()
