"""`SubgoalFocus`: a long-horizon task's subgoal as its primitive task, by a gymnasium wrapper."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import perceptrl.sim as sim
from perceptrl.sim.composite import COMPOSITES, SKILL_SCENES, Subgoal
from perceptrl.sim.expert import ScriptedExpert
from perceptrl.sim.focus import SubgoalFocus, focus_of, make_env
from perceptrl.sim.tasks import get_task

WRAPPED = ".*different from the unwrapped"
"""check_env's notice that it was handed a wrapper (it checks the wrapped env all the same)"""


def _checked(env) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # clean: no checker warning but the wrapper notice
        warnings.filterwarnings("ignore", message=WRAPPED)
        check_env(env, skip_render_check=True)


@pytest.mark.parametrize("task", sorted({**COMPOSITES, **SKILL_SCENES}))
def test_check_env_on_the_wrapped_env(task):
    env = make_env(sim.env_id(task), obs_mode="state", entity_features=True, subgoal_focus=True)
    _checked(env)
    env.close()


def test_check_env_with_a_focus_set_by_the_planner_and_pixels():
    env = SubgoalFocus(gym.make(sim.env_id("put_two"), width=32, height=32))
    _checked(env)
    env.reset(seed=0)
    env.focus(Subgoal("put", 1, 1))
    obs, *_ = env.step(np.zeros(5, np.float32))
    assert env.observation_space.contains(obs)
    env.close()


def test_a_focused_step_is_scored_by_the_primitive():
    """Reward, terminated and the reward terms are the primitive's on the focused view (dense:
    success + the mean shaping term), and the episode ends when the subgoal is done."""
    env = SubgoalFocus(gym.make(sim.env_id("put_two"), obs_mode="state", reward_mode="dense"))
    env.reset(options={"task_id": 3, "trial_id": 0})
    sub = env.unwrapped.task.subgoals[1]
    env.focus(sub)
    put = get_task("put")
    expert = ScriptedExpert(env)
    assert focus_of(env) == sub and expert.fn.__name__ == "put_expert"
    for _ in range(200):
        _, reward, terminated, truncated, info = env.step(expert.act())
        w = env.world()
        terms = put.shaping(w)
        assert set(info) == {*(f"reward/{k}" for k in terms), "reward/success", "success",
                             "sim_unstable"}  # fmt: skip
        assert reward == pytest.approx(float(put.success(w)) + np.mean(list(terms.values())))
        if terminated or truncated:
            break
    assert terminated and info["success"] and env.unwrapped.subgoals_done() == 0


def test_a_blow_up_under_a_focus_truncates_without_reward():
    env = SubgoalFocus(gym.make(sim.env_id("put_two"), obs_mode="state"))
    env.reset(seed=1)
    env.focus(Subgoal("put", 0, 0))
    env.unwrapped.data.qvel[:] = 1e12
    obs, reward, terminated, truncated, info = env.step(np.zeros(5, np.float32))
    assert truncated and not terminated and reward == 0.0 and info["sim_unstable"]
    assert obs["instruction"] == Subgoal("put", 0, 0).text(env.unwrapped.layout.colours)


def test_primitive_tasks_pass_through_unchanged():
    a = make_env(sim.env_id("put"), obs_mode="state", subgoal_focus=True)
    b = gym.make(sim.env_id("put"), obs_mode="state")
    for x, y in [(a.reset(seed=4), b.reset(seed=4))] + [
        (a.step(u), b.step(u)) for u in np.random.default_rng(0).uniform(-1, 1, (5, 5))
    ]:
        assert x[1:] == y[1:]
        assert all(np.array_equal(x[0][k], y[0][k]) for k in y[0])
    assert a.focused is None
