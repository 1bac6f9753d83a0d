"""Gymnasium API, determinism, indexed initial states, observations and rewards."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from perceptrl.schema import ConfigError
from perceptrl.sim import ENV_IDS, TASKS

IDS = sorted(ENV_IDS.values())


def test_every_task_is_registered_with_a_time_limit():
    assert set(ENV_IDS) >= {"reach", "push", "pick", "put", "stack", "pick_clutter"}
    assert ENV_IDS["pick_clutter"] == "perceptrl/PickClutter-v0"
    for name, gid in ENV_IDS.items():
        assert gym.spec(gid).max_episode_steps == TASKS.get(name).max_episode_steps


@pytest.mark.parametrize("env_id", IDS)
def test_check_env(env_id):
    env = gym.make(env_id, width=48, height=48, render_mode="rgb_array")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # clean means no checker warning either
        check_env(env.unwrapped)
    env.close()


@pytest.mark.parametrize("env_id", IDS)
def test_check_env_state_mode(env_id):
    env = gym.make(env_id, obs_mode="state")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped, skip_render_check=True)
    env.close()


def _rollout(env_id, seed, steps=8, **kw):
    env = gym.make(env_id, **kw)
    obs, _ = env.reset(seed=seed)
    rng = np.random.default_rng(123)
    out = [obs]
    rewards = []
    for _ in range(steps):
        obs, r, _, _, info = env.step(rng.uniform(-1, 1, 5).astype(np.float32))
        out.append(obs)
        rewards.append((r, sorted((k, v) for k, v in info.items() if k.startswith("reward/"))))
    env.close()
    return out, rewards


@pytest.mark.parametrize("env_id", ["perceptrl/Put-v0", "perceptrl/Stack-v0"])
def test_same_seed_same_observations_and_rewards(env_id):
    a_obs, a_rew = _rollout(env_id, 7, width=32, height=32, reward_mode="dense")
    b_obs, b_rew = _rollout(env_id, 7, width=32, height=32, reward_mode="dense")
    c_obs, _ = _rollout(env_id, 8, steps=0, width=32, height=32)
    assert a_rew == b_rew
    for x, y in zip(a_obs, b_obs, strict=True):
        for key in x:
            assert np.array_equal(np.asarray(x[key]), np.asarray(y[key])), key
    assert not np.array_equal(a_obs[0]["agentview"], c_obs[0]["agentview"])


def test_indexed_initial_states_replay_exactly():
    env = gym.make("perceptrl/Put-v0", obs_mode="state")
    first, info = env.reset(seed=1, options={"task_id": 3, "trial_id": 11})
    env.reset(seed=99)
    again, info2 = env.reset(options={"task_id": 3, "trial_id": 11})
    other, _ = env.reset(options={"task_id": 3, "trial_id": 12})
    assert np.array_equal(first["objects"], again["objects"])
    assert (info["task_id"], info["trial_id"]) == (3, 11)
    assert first["instruction"] == again["instruction"] == other["instruction"]  # task fixes words
    assert not np.array_equal(first["objects"], other["objects"])  # trial moves things
    env.close()


def test_instructions_use_paraphrases_and_colours():
    env = gym.make("perceptrl/Pick-v0", obs_mode="state")
    texts = {env.reset(seed=s)[0]["instruction"] for s in range(40)}
    templates = {t.split(" {")[0] for t in TASKS.get("pick").templates}
    assert len({next(p for p in templates if t.startswith(p)) for t in texts}) >= 3
    assert len(texts) >= 10
    env.close()


def test_observation_layout():
    env = gym.make("perceptrl/Stack-v0", width=40, height=32)
    obs, _ = env.reset(seed=0)
    assert obs["agentview"].shape == (32, 40, 3) and obs["agentview"].dtype == np.uint8
    assert obs["wrist"].shape == (32, 40, 3)
    assert obs["agentview"].std() > 5  # an actual picture, not a blank frame
    assert obs["proprio"].shape == (8,) and abs(np.linalg.norm(obs["proprio"][3:7]) - 1) < 1e-5
    env.close()
    state = gym.make("perceptrl/Stack-v0", obs_mode="state")
    obs, _ = state.reset(seed=0)
    task = TASKS.get("stack")
    assert obs["objects"].shape == (7 * (task.n_blocks + task.n_bowls),)
    assert np.allclose(obs["objects"][2], 0.02, atol=1e-3)  # block0 resting on the table
    state.close()


def test_privileged_state_adds_true_poses_to_pixel_observations():
    pix = gym.make("perceptrl/Reach-v0", width=32, height=32, privileged_state=True)
    state = gym.make("perceptrl/Reach-v0", obs_mode="state")
    obs, _ = pix.reset(seed=3)
    ref, _ = state.reset(seed=3)
    assert {"agentview", "wrist", "objects"} <= set(obs)
    np.testing.assert_array_equal(obs["objects"], ref["objects"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(pix.unwrapped, skip_render_check=True)
    pix.close()
    state.close()


def test_dense_reward_adds_shaping_terms():
    env = gym.make("perceptrl/Reach-v0", obs_mode="state", reward_mode="dense")
    env.reset(seed=0)
    _, r, _, _, info = env.step(np.zeros(5, np.float32))
    assert r == pytest.approx(info["reward/reach"] + info["reward/success"])
    assert 0.0 < info["reward/reach"] < 1.0
    env.close()


def test_options_are_checked_by_the_one_option_loader():
    """Unknown options name the nearest one; values must fit their types and choices."""
    with pytest.raises(ConfigError, match="did you mean 'reward_mode'"):
        gym.make("perceptrl/Reach-v0", reward_mod="dense")
    with pytest.raises(ConfigError, match="obs_mode='depth' is not a valid value"):
        gym.make("perceptrl/Reach-v0", obs_mode="depth")
    with pytest.raises(ConfigError, match="width: expected int"):
        gym.make("perceptrl/Reach-v0", width=32.5)
    env = gym.make("perceptrl/Reach-v0", cameras=["wrist"], max_qvel=10)
    assert env.unwrapped.cfg.cameras == ("wrist",) and env.unwrapped.cfg.max_qvel == 10.0
    env.close()


def test_joint_control_passes_check_env():
    env = gym.make("perceptrl/Pick-v0", obs_mode="state", control="joint")
    assert env.action_space.shape == (8,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped, skip_render_check=True)
    env.close()


@pytest.mark.parametrize("task", ["push", "put", "stack"])
def test_instruction_names_the_subject_and_goal_colours(task):
    env = gym.make(ENV_IDS[task], obs_mode="state")
    spec = TASKS.get(task)
    for seed in range(5):
        obs, _ = env.reset(seed=seed)
        colours = env.unwrapped.layout.colours
        words = obs["instruction"].split()
        assert colours[spec.subject][0] in words
        assert colours[spec.goal[0]][spec.goal[1]] in words
        named = [c for kind in colours.values() for c in kind]
        assert len(named) == len(set(named))  # every entity has its own colour
    env.close()


def test_sim_is_a_leaf_package():
    """sim/ imports neither torch nor the trainer, VLM, VLA or dataset code of perceptrl."""
    import subprocess
    import sys

    code = (
        "import sys, perceptrl.sim, perceptrl.sim.vector, perceptrl.sim.focus, perceptrl.sim.demonstrations, "
        "perceptrl.sim.showcase\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.split('.')[:2] in "
        "(['perceptrl', 'trainer'], ['perceptrl', 'vlm'], ['perceptrl', 'vla'], "
        "['perceptrl', 'datasets'])]\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _same_step(a, b) -> None:
    """Two step (or reset) results are identical, observations bit for bit."""
    obs_a, obs_b = a[0], b[0]
    assert obs_a.keys() == obs_b.keys()
    for key in obs_a:
        assert np.array_equal(np.asarray(obs_a[key]), np.asarray(obs_b[key])), key
    assert a[1:-1] == b[1:-1]
    assert a[-1] == b[-1]  # infos: reward terms, success, sim_unstable


@pytest.mark.parametrize("mode", ["state", "rgb"])
def test_snapshot_continues_the_episode_bit_for_bit(mode):
    """get_state/set_state into an env with another history (mid-episode, right after a
    reset, after a blow-up restored the initial state): the same observations, rewards and
    infos afterwards, and the same next layouts from np_random."""
    kw = dict(obs_mode=mode, width=32, height=32, reward_mode="dense", max_episode_steps=60)
    a, b = (gym.make("perceptrl/Pick-v0", **kw) for _ in range(2))
    actions = np.random.default_rng(0).uniform(-1, 1, (40, 5)).astype(np.float32)
    a.reset(seed=3)
    b.reset(seed=99)
    for x in actions[:9]:
        b.step(x)
    for at in ("mid-episode", "after reset", "after blow-up"):
        if at == "mid-episode":
            for x in actions[:7]:
                a.step(x)
        elif at == "after reset":
            a.reset()
        else:
            a.unwrapped.data.qvel[:] = 1e12
            assert a.step(actions[0])[-1]["sim_unstable"]
        b.unwrapped.set_state(a.unwrapped.get_state())
        b.set_wrapper_attr("_elapsed_steps", a.get_wrapper_attr("_elapsed_steps"))
        for x in actions[7:27]:
            _same_step(a.step(x), b.step(x))
        _same_step(a.reset(), b.reset())  # the layouts np_random draws next
    a.close()
    b.close()


def test_snapshot_of_an_env_never_reset_is_none():
    env = gym.make("perceptrl/Reach-v0", obs_mode="state")
    assert env.unwrapped.get_state() is None
    env.unwrapped.set_state(None)  # leaves it as it is
    env.close()
