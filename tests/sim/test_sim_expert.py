"""Scripted experts solve every task (fast: a few seeds; slow: >= 90% over 50 seeds)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from perceptrl.sim import ENV_IDS
from perceptrl.sim.expert import ScriptedExpert, rollout_expert


@pytest.mark.parametrize("task", sorted(ENV_IDS))
def test_expert_solves_a_few_seeds(task):
    env = gym.make(ENV_IDS[task], obs_mode="state")
    results = [rollout_expert(env, seed=s) for s in range(3)]
    assert all(r["success"] for r in results), results
    env.close()


def test_random_actions_do_not_solve_stack():
    env = gym.make(ENV_IDS["stack"], obs_mode="state")
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(60):
        *_, info = env.step(rng.uniform(-1, 1, 5).astype(np.float32))
        assert not info["success"]
    env.close()


def test_expert_refuses_joint_control():
    env = gym.make(ENV_IDS["pick"], obs_mode="state", control="joint")
    env.reset(seed=0)
    with pytest.raises(ValueError, match="control='ee'"):
        ScriptedExpert(env)
    env.close()


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(ENV_IDS))
def test_expert_success_rate_over_50_seeds(task):
    env = gym.make(ENV_IDS[task], obs_mode="state")
    rate = np.mean([rollout_expert(env, seed=1000 + s)["success"] for s in range(50)])
    env.close()
    assert rate >= 0.9, f"{task}: expert success {rate:.2f} < 0.90"
