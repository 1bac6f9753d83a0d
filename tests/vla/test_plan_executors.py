"""Reason, then act: the planner's executors in its episode environment: the oracle and saved
VLAs, the home pose between subgoals, physics blow-ups, non-finite actions, the oracle plan with
retries, a round's subgoals side by side, and executors that do not fit refused."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import perceptrl.sim as sim
from perceptrl.sim.expert import HOME_TOLERANCE
from perceptrl.sim.vector import idle_action
from perceptrl.trainer.config import ConfigError
from perceptrl.vla.compact import build_compact, spec_from_config
from perceptrl.vla.config import VLAConfig
from perceptrl.vla.executors import OracleExecutor, PolicyExecutor, load_executor
from perceptrl.vla.plan_env import INVALID, PlanEnv, PlanSettings, plan_settings
from perceptrl.vla.run_plan import resolve_executor
from perceptrl.wiring import load_config, side

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_scenes import TINY, oracle_plan_texts, scene_sample  # noqa: E402


def test_a_policy_executor_s_subgoals_start_at_the_home_pose():
    """A cloned policy only saw episodes that start at home: after a subgoal the arm returns
    there (the scripted experts' subgoals start where the last one ended)."""
    assert PolicyExecutor.from_home and not OracleExecutor.from_home
    after = {}
    for home in (None, True):  # the oracle's default; sent home as a policy executor's arm
        env = PlanEnv(PlanSettings(OracleExecutor(), home=home))
        env.reset([scene_sample()])
        first, second = oracle_plan_texts(env, 0)
        assert env.respond(0, f"<subgoal>{first}</subgoal>").info["planner/progress"] == 0.5
        robot = env.scene(0).unwrapped.robot
        at = robot.home_pose()[0]
        after[home] = float(np.linalg.norm(robot.tcp_pos(env.scene(0).unwrapped.data) - at))
        obs = env.respond(0, f"<subgoal>{second}</subgoal>")
        assert obs.info["planner/success"] == 1.0  # going home disturbs nothing
    assert after[True] < HOME_TOLERANCE < 0.1 < after[None]
    recipe = "configs/plan_grpo.yaml"
    settings = lambda *o: plan_settings(resolve_executor(load_config(recipe, o)))  # noqa: E731
    assert settings().home is None  # the executor's own default
    assert settings("plan.home=always").home is True
    assert settings("plan.home=never").home is False


def test_a_blow_up_fails_the_subgoal_and_restores_the_scene():
    env = PlanEnv(PlanSettings(OracleExecutor(), subgoal_steps=30))
    env.reset([scene_sample("put_two", 1)])
    first, _ = oracle_plan_texts(env, 0)
    e = env.scene(0).unwrapped
    e.cfg = dataclasses.replace(e.cfg, max_qvel=1e-4)  # any motion counts as a blow-up
    blocks = e.world().blocks.copy()
    obs = env.respond(0, f"<subgoal>{first}</subgoal>")
    assert "simulation failed" in obs.text and obs.info["planner/unstable"] == 1
    assert obs.info["planner/executed"] == 0 and obs.info["planner/progress"] == 0.0
    e.set_state(env.rows[0].state)
    torch.testing.assert_close(torch.as_tensor(e.world().blocks), torch.as_tensor(blocks))


class NaNExecutor:
    def can(self, family):
        return True

    def start(self, env):
        return lambda obs: torch.full((1, 5), float("nan")).numpy()


def test_non_finite_executor_actions_become_no_ops_and_are_counted():
    env = PlanEnv(PlanSettings(NaNExecutor(), subgoal_steps=12))
    env.reset([scene_sample("put_two", 1)])
    first, _ = oracle_plan_texts(env, 0)
    obs = env.respond(0, f"<subgoal>{first}</subgoal>")
    assert "did not finish" in obs.text and obs.info["planner/env_steps"] == 12
    assert env.counters["bad_actions"] == 12


class FlakyExecutor(OracleExecutor):
    """Holds still on every other subgoal it is asked to run, and is the oracle on the rest."""

    calls = 0

    def start(self, env):
        self.calls += 1
        if self.calls % 2:
            return lambda obs: idle_action(5, "ee")[None]
        return super().start(env)


def test_the_oracle_plan_with_retries_issues_a_failed_subgoal_again():
    from perceptrl.vla.plan_eval import oracle_plan

    sample = scene_sample("put_two", 1)
    env = PlanEnv(PlanSettings(OracleExecutor()))
    env.reset([sample])
    sample["meta"]["plan"] = oracle_plan_texts(env, 0)
    scores, records = oracle_plan(PlanSettings(FlakyExecutor(), subgoal_steps=80), [sample])
    assert scores["accuracy"] == 0.0 and "retries" not in scores
    scores, records = oracle_plan(PlanSettings(FlakyExecutor(), subgoal_steps=80), [sample], 2)
    # each subgoal: the first attempt holds still, the retry is the oracle's and finishes
    assert scores["accuracy"] == 1.0
    assert scores["retries"] == 2.0 and scores["retries/finished"] == 2.0
    assert scores["executor/put"] == 0.0 and scores["count/executor/put"] == 2.0
    texts = records[sample["id"]]["texts"]
    assert len(texts) == 5 and texts[0] == texts[1] and texts[2] == texts[3]
    assert texts[-1] == "<done/>"


def test_a_saved_state_vla_executes_subgoals_of_a_larger_scene(tmp_path):
    """A compact VLA sized for the primitive put scene (2 blocks, 2 bowls) acts in put_three (4
    blocks, 3 bowls): the focused view's entity poses are cut to the primitive's."""
    put = gym.make(sim.env_id("put"), obs_mode="state")
    spaces = {"action": put.action_space, "observation": put.observation_space}
    vla = dataclasses.replace(VLAConfig(), encoder="state", hidden=32)
    build_compact(spec_from_config(vla, spaces, 1, 64)).save(tmp_path / "put")
    executor = load_executor("policy", {"put": str(tmp_path / "put")})
    env = PlanEnv(PlanSettings(executor, subgoal_steps=5))
    env.reset([scene_sample("put_three", 2)])
    first = oracle_plan_texts(env, 0)[0]
    obs = env.respond(0, f"<subgoal>{first}</subgoal>")
    assert obs.error is None and obs.info["planner/env_steps"] == 5
    env.reset([scene_sample("put_then_stack", 0)])  # no stack executor: refused like a bad plan
    obs = env.respond(0, f"<subgoal>{oracle_plan_texts(env, 0)[1]}</subgoal>")
    assert obs.error == INVALID and "no skill to stack" in obs.text


def test_an_executor_cloned_on_another_task_is_refused_when_the_run_is_built(tmp_path):
    """A put-sized policy (4 entity poses) given as the stack executor (3 blocks): a clear
    error when the run is built and the directory is read, not a shape error in the middle of a
    rollout; a key that names no family is refused when the recipe loads."""
    put = gym.make(sim.env_id("put"), obs_mode="state")
    spaces = {"action": put.action_space, "observation": put.observation_space}
    vla = dataclasses.replace(VLAConfig(), encoder="state", hidden=32)
    build_compact(spec_from_config(vla, spaces, 1, 64)).save(tmp_path / "put")
    with pytest.raises(ValueError, match="reads 4 entity poses, but the stack task's scene has 3"):
        load_executor("policy", {"stack": str(tmp_path / "put")})
    with pytest.raises(ValueError, match="not a subgoal family"):
        load_executor("policy", {"pick": str(tmp_path / "put")})
    with pytest.raises(ConfigError, match="not a subgoal family"):
        load_config("configs/plan_grpo.yaml", ["plan.executor=policy", "plan.policies.pick=x"])
    cfg = load_config("configs/plan_grpo.yaml", [*TINY, "plan.executor=policy",
                                                 f"plan.policies.stack={tmp_path / 'put'}"])  # fmt: skip
    with pytest.raises(ConfigError, match="trained on another task"):
        side(cfg).build_trainer(cfg, tmp_path / "run")


def test_a_round_s_subgoals_run_side_by_side_as_they_would_one_by_one(tmp_path):
    """`PlanEnv.prepare` (the rollout hands it a round's turns) executes the subgoals in one
    simulator each with one policy forward per scene size and step: `respond` then answers
    exactly what executing them one at a time gives, without simulating again; turns that
    name nothing executable and group members that agree are left to `respond`."""
    put = gym.make(sim.env_id("put"), obs_mode="state")
    spaces = {"action": put.action_space, "observation": put.observation_space}
    vla = dataclasses.replace(VLAConfig(), encoder="state", hidden=32)
    build_compact(spec_from_config(vla, spaces, 1, 64)).save(tmp_path / "put")
    executor = load_executor("policy", {"put": str(tmp_path / "put")})
    policy = executor.policies["put"]
    calls = {"n": 0}
    act = policy.act

    def counted(obs, **kw):
        calls["n"] += 1
        return act(obs, **kw)

    policy.act = counted
    three, two = scene_sample("put_three", 2), scene_sample("put_two", 5)
    samples = [three, two, three, three, two]

    def turns(env):
        a, b = oracle_plan_texts(env, 0)[:2], oracle_plan_texts(env, 1)[0]
        return [f"<subgoal>{a[0]}</subgoal>", f"<subgoal>{b}</subgoal>",
                f"<subgoal>{a[1]}</subgoal>", f"<subgoal>{a[0]}</subgoal>",
                "<subgoal>put the magenta block in the red bowl</subgoal>"]  # fmt: skip

    answers, counts = {}, {}
    for mode in ("one_by_one", "side_by_side"):
        env = PlanEnv(PlanSettings(executor, subgoal_steps=12))
        env.reset(samples)
        texts = turns(env)
        calls["n"] = 0
        if mode == "side_by_side":
            env.prepare(list(range(5)), texts)
            counts["prepare"] = calls["n"]
        answers[mode] = [env.respond(row, t) for row, t in enumerate(texts)]
        counts[mode] = calls["n"]
        states = [env.rows[r].state["physics"] for r in range(5)]
    for a, b in zip(answers["one_by_one"], answers["side_by_side"], strict=True):
        assert a.text == b.text and a.info == b.info and a.error == b.error
        if a.images:
            np.testing.assert_array_equal(np.asarray(a.images[0]), np.asarray(b.images[0]))
    assert answers["side_by_side"][4].error == INVALID
    assert answers["side_by_side"][3].info["planner/env_steps"] == 12
    # three distinct subgoals, 12 steps each: put_three's two share a forward per step
    assert counts["one_by_one"] == 36 and counts["prepare"] == 24
    assert counts["side_by_side"] == 24  # respond simulated nothing more
    np.testing.assert_array_equal(states[0], states[3])  # the duplicate replayed the first
