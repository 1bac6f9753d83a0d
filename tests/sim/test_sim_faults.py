"""Bad actions never reach the physics; a blow-up truncates the episode and nothing else."""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

from perceptrl.sim import ENV_IDS

PICK = ENV_IDS["pick"]


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """MuJoCo appends its instability warnings to MUJOCO_LOG.TXT in the working directory."""
    monkeypatch.chdir(tmp_path)


def _state_after(action, **kw):
    env = gym.make(PICK, obs_mode="state", **kw)
    env.reset(seed=3)
    obs, *_ = env.step(np.asarray(action, np.float32))
    env.close()
    return obs


def test_nan_and_out_of_range_actions_are_clipped():
    bad = _state_after([np.nan, 7.0, -3.0, np.inf, 0.5])
    good = _state_after([0.0, 1.0, -1.0, 0.0, 0.5])  # what "clip" must turn it into
    assert np.isfinite(bad["proprio"]).all()
    assert np.array_equal(bad["proprio"], good["proprio"])
    assert np.array_equal(bad["objects"], good["objects"])


@pytest.mark.parametrize("action", [[np.nan, 0, 0, 0, 0], [0, 0, 1.5, 0, 0]])
def test_invalid_actions_raise_when_asked(action):
    env = gym.make(PICK, obs_mode="state", invalid_action="raise")
    env.reset(seed=0)
    qpos = env.unwrapped.data.qpos.copy()
    with pytest.raises(ValueError, match="invalid action"):
        env.step(np.asarray(action, np.float32))
    assert np.array_equal(env.unwrapped.data.qpos, qpos)  # nothing was simulated
    env.close()


def test_wrong_action_shape_raises():
    env = gym.make(PICK, obs_mode="state")
    env.reset(seed=0)
    with pytest.raises(ValueError, match="shape"):
        env.step(np.zeros(8, np.float32))
    env.close()


def test_blow_up_truncates_and_next_episode_is_clean():
    env = gym.make(PICK, obs_mode="state")
    env.reset(seed=0)
    env.unwrapped.data.qvel[:] = 1e12  # inject an explosion
    obs, r, term, trunc, info = env.step(np.zeros(5, np.float32))
    assert trunc and not term and info["sim_unstable"] and r == 0.0
    assert np.isfinite(obs["objects"]).all() and env.observation_space.contains(obs)
    assert env.unwrapped.unstable_count == 1
    obs, info = env.reset(seed=1)
    for _ in range(5):
        obs, r, term, trunc, info = env.step(np.zeros(5, np.float32))
        assert not info["sim_unstable"] and not trunc
    env.close()


def test_nan_state_truncates():
    env = gym.make(PICK, obs_mode="state")
    env.reset(seed=0)
    env.unwrapped.data.qpos[3] = np.nan
    obs, r, term, trunc, info = env.step(np.zeros(5, np.float32))
    assert trunc and info["sim_unstable"] and np.isfinite(obs["proprio"]).all()
    env.close()


def test_sync_vector_env_keeps_running_after_a_blow_up():
    vec = SyncVectorEnv([functools.partial(gym.make, PICK, obs_mode="state")] * 2)
    vec.reset(seed=0)
    vec.envs[0].unwrapped.data.qvel[:] = 1e12
    _, _, term, trunc, infos = vec.step(np.zeros((2, 5), np.float32))
    assert trunc.tolist() == [True, False] and infos["sim_unstable"].tolist() == [True, False]
    for _ in range(3):  # env 0 autoresets, env 1 carries on
        obs, _, term, trunc, infos = vec.step(np.zeros((2, 5), np.float32))
        assert not trunc.any() and not infos["sim_unstable"].any()
        assert np.isfinite(obs["objects"]).all()
    vec.close()


def test_async_vector_env_keeps_running_with_an_unstable_worker():
    # worker 0 sees every motion as a blow-up (max_qvel=0): it truncates every other step
    gid = f"perceptrl.sim:{PICK}"  # the worker imports perceptrl.sim, which registers the ids
    fns = [
        functools.partial(gym.make, gid, obs_mode="state", max_qvel=0.0),
        functools.partial(gym.make, gid, obs_mode="state"),
    ]
    vec = AsyncVectorEnv(fns, shared_memory=True, context="forkserver")
    vec.reset(seed=0)
    unstable = np.zeros(2, int)
    for _ in range(6):
        obs, _, _, trunc, infos = vec.step(np.full((2, 5), 0.5, np.float32))
        unstable += infos.get("sim_unstable", np.zeros(2, bool))
        assert np.isfinite(obs["proprio"]).all()
    assert unstable[0] >= 3 and unstable[1] == 0
    vec.close()
