"""Long-horizon tasks: subgoal ground truth, the focused view a primitive executor sees, the
scripted oracle, validity and parsing of what a planner writes."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import perceptrl.sim as sim
from perceptrl.sim.composite import (
    COMPOSITES,
    Subgoal,
    SubgoalError,
    check_subgoal,
    holds,
    parse_subgoal,
)
from perceptrl.sim.expert import ScriptedExpert, rollout_expert
from perceptrl.sim.focus import SubgoalFocus
from perceptrl.sim.tasks import get_task


def _env(task: str, tid: int = 0, **kw):
    """(the env in a `SubgoalFocus`, the `ManipEnv`), reset to initial state (tid, 0)."""
    env = SubgoalFocus(gym.make(sim.env_id(task), obs_mode="state", **kw))
    env.reset(options={"task_id": tid, "trial_id": 0})
    return env, env.unwrapped


def _run(env, expert: ScriptedExpert, steps: int = 200) -> bool:
    for _ in range(steps):
        _, _, terminated, _, info = env.step(expert.act())
        if terminated:
            return bool(info["success"])
    return False


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_composites_are_registered_with_their_subgoals_in_the_instruction(name):
    task = get_task(name)
    assert task.family == "composite" and 2 <= len(task.subgoals) <= 4
    for tid in range(3):
        _, u = _env(name, tid)
        colours, text = u.layout.colours, u.layout.instruction
        words = text.split()
        at = -1
        for sub in task.subgoals:  # every subgoal's two colours appear, in subgoal order
            obj = colours["blocks"][sub.subject]
            goal = colours[sub.goal_kind][sub.goal]
            i = words.index(obj, at + 1)
            assert goal in words[i + 1 :]
            at = i
        assert len(text) <= sim.env.MAX_INSTRUCTION and set(text) <= set(sim.env.CHARSET)


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_every_paraphrase_of_a_subgoal_parses_back_to_it(name):
    _, u = _env(name)
    colours = u.layout.colours
    for sub in u.task.subgoals:
        for k in range(len(get_task(sub.family).templates)):
            text = sub.text(colours, k)
            assert parse_subgoal(text, colours) == sub
            assert parse_subgoal("  " + text.upper() + ". ", colours) == sub


def test_unparseable_or_absent_subgoals_say_what_is_wrong():
    _, u = _env("put_then_stack")
    colours = u.layout.colours
    absent = next(c for c in sim.scene.COLOURS if c not in sum(colours.values(), []))
    bowl, block = colours["bowls"][0], colours["blocks"][0]
    with pytest.raises(SubgoalError, match=f"no {absent} block"):
        parse_subgoal(f"put the {absent} block in the {bowl} bowl", colours)
    with pytest.raises(SubgoalError, match=f"no {absent} bowl"):
        parse_subgoal(f"put the {block} block in the {absent} bowl", colours)
    with pytest.raises(SubgoalError, match="not a subgoal I can execute"):
        parse_subgoal("wave at the camera", colours)


def test_focus_shows_the_subgoal_as_its_primitive_task():
    """The second subgoal of put_then_stack (stack block 1 on block 2): the state observation
    lists the subject then the base block first, the instruction is the subgoal's, and the
    focused world is what the primitive's success reads."""
    env, u = _env("put_then_stack", 1)
    sub = u.task.subgoals[1]
    raw = u.layout.blocks
    obs = env.focus(sub)
    objects = obs["objects"].reshape(-1, 7)
    np.testing.assert_allclose(objects[0, :3], raw[sub.subject], atol=1e-6)
    np.testing.assert_allclose(objects[1, :3], raw[sub.goal], atol=1e-6)
    assert obs["instruction"] == sub.text(u.layout.colours)
    assert env.active is get_task("stack") and env.focused == sub
    np.testing.assert_allclose(env.world().blocks[0], u.world().blocks[sub.subject])
    custom = env.focus(sub, "stack the pink cube on the blue one")  # the planner's words
    assert custom["instruction"] == "stack the pink cube on the blue one"
    plain = env.focus(None)
    assert env.active is u.task and plain["instruction"] == u.layout.instruction
    np.testing.assert_array_equal(plain["objects"], u.observe()["objects"])


def test_subgoals_count_in_order():
    """Doing only the second subgoal of put_then_stack makes it hold but counts no progress;
    then doing the first counts both, and the composite succeeds."""
    env, u = _env("put_then_stack", 0)
    first, second = u.task.subgoals
    env.focus(second)
    assert _run(env, ScriptedExpert(env))  # terminates on the subgoal's success
    w = u.world()
    assert holds(w, second) and not holds(w, first) and u.subgoals_done() == 0
    assert check_subgoal(w, second) == "it is already done"
    env.focus(first)
    assert _run(env, ScriptedExpert(env))
    assert u.subgoals_done() == 2 and u.task.success(u.world())


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_the_oracle_plan_with_the_scripted_executor_succeeds(name):
    env = gym.make(sim.env_id(name), obs_mode="state")
    results = [rollout_expert(env, options={"task_id": t, "trial_id": 0}) for t in (0, 1)]
    assert all(r["success"] for r in results), results


def test_subgoals_that_cannot_be_executed_now():
    env, u = _env("put_then_stack", 0)
    w = u.world()
    assert check_subgoal(w, Subgoal("stack", 1, 1)) == "a block cannot be stacked on itself"
    assert "not in the scene" in check_subgoal(w, Subgoal("put", 0, 7))
    assert check_subgoal(w, Subgoal("stack", 3, 2)) is None
    env.focus(Subgoal("stack", 1, 2))
    assert _run(env, ScriptedExpert(env))  # block 1 now lies on block 2
    w = u.world()
    assert check_subgoal(w, Subgoal("put", 2, 0)) == "another block lies on the block to move"
    assert check_subgoal(w, Subgoal("stack", 3, 2)) == "the block to stack on is not free"
    assert check_subgoal(w, Subgoal("stack", 0, 2)) == "the block to stack on is not free"
    assert check_subgoal(w, Subgoal("put", 1, 1)) is None  # the top block may move on


def test_a_pushed_block_must_rest_on_the_table():
    env, u = _env("push_then_put", 0)
    env.focus(Subgoal("put", 0, 0))
    expert = ScriptedExpert(env)
    for _ in range(80):  # until the block is carried
        env.step(expert.act())
        if expert.phase == 4:
            break
    assert expert.phase == 4
    w = u.world()
    assert (
        check_subgoal(w, Subgoal("push", 0, 0)) == "only a block resting on the table can be pushed"
    )


def test_a_snapshot_keeps_the_focus():
    env, u = _env("put_two", 2)
    sub = u.task.subgoals[1]
    env.focus(sub, "drop the x block in the y bowl")
    expert = ScriptedExpert(env)
    for _ in range(10):
        env.step(expert.act())
    state = env.get_state()
    other, v = _env("put_two", 5)
    other.set_state(state)
    assert other.focused == sub
    a = expert.act()
    got, want = other.step(a), env.step(a)  # the restored focus views and scores the steps
    assert got[0]["instruction"] == want[0]["instruction"] == "drop the x block in the y bowl"
    np.testing.assert_array_equal(got[0]["objects"], want[0]["objects"])
    assert got[1:] == want[1:]
    env.focus(None)
    other.set_state(env.get_state())
    assert other.focused is None
