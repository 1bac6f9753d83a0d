"""An executor that reads its instruction: entity features and subgoal episodes in the sim, the
entity reader of the compact VLA, one policy executing every subgoal family of a plan, and the
executor alone on a long instruction (the planners' baseline)."""

from __future__ import annotations

import dataclasses

import gymnasium as gym
import numpy as np
import pytest
import torch

import perceptrl.sim as sim
from perceptrl.sim.composite import ENTITY_KINDS, ENTITY_SIZE, POSE_SIZE, parse_subgoal
from perceptrl.sim.expert import ScriptedExpert
from perceptrl.sim.focus import SubgoalFocus, make_env
from perceptrl.sim.scene import COLOURS
from perceptrl.trainer.config import ConfigError
from perceptrl.vla.compact import EntityReader, build_compact, spec_from_config
from perceptrl.vla.config import VLAConfig
from perceptrl.vla.executors import OracleExecutor, load_executor
from perceptrl.vla.language import InstructionEncoder, encode_words
from perceptrl.vla.plan_env import PlanEnv, PlanSettings
from perceptrl.vla.plan_eval import executor_alone
from perceptrl.wiring import load_config

READER = dict(encoder="entities", instruction_encoder="gru", max_words=40, hidden=32)


def _sample(task: str, tid: int = 0, trial: int = 0) -> dict:
    return {
        "id": f"{task}-{tid}",
        "family": task,
        "meta": {"scene": {"task": task, "task_id": tid, "trial_id": trial}},
    }


def _reader(path, task: str = "skills", **vla) -> str:
    env = gym.make(sim.env_id(task), obs_mode="state", entity_features=True)
    spaces = {"action": env.action_space, "observation": env.observation_space}
    cfg = dataclasses.replace(VLAConfig(), **{**READER, **vla})
    build_compact(spec_from_config(cfg, spaces, 1, 64)).save(path)
    return str(path)


def test_entity_features_name_each_entity_s_kind_and_colour():
    env = gym.make(sim.env_id("put_then_stack"), obs_mode="state", entity_features=True)
    obs, _ = env.reset(options={"task_id": 4, "trial_id": 1})
    u = env.unwrapped
    rows = obs["objects"].reshape(-1, ENTITY_SIZE)
    kinds = [k for k in ENTITY_KINDS for _ in u.layout.colours.get(k, [])]
    colours = [c for k in ENTITY_KINDS for c in u.layout.colours.get(k, [])]
    assert len(rows) == len(kinds) == u.n_entities
    for row, kind, colour in zip(rows, kinds, colours, strict=True):
        onehots = row[POSE_SIZE:]
        assert onehots.sum() == 2.0
        assert ENTITY_KINDS[int(onehots[: len(ENTITY_KINDS)].argmax())] == kind
        assert list(COLOURS)[int(onehots[len(ENTITY_KINDS) :].argmax())] == colour
    np.testing.assert_allclose(rows[1, :3], u.data.qpos[u.block_qadr[1] : u.block_qadr[1] + 3])
    # a focus lists the entities in its view's order, as it does the plain poses (the subject
    # first: the auxiliary loss's target); the entity reader is blind to the order
    stack = u.task.subgoals[1]
    focused = SubgoalFocus(env).focus(stack)["objects"].reshape(-1, ENTITY_SIZE)
    plain = SubgoalFocus(gym.make(sim.env_id("put_then_stack"), obs_mode="state"))
    plain.reset(options={"task_id": 4, "trial_id": 1})
    poses = plain.focus(stack)["objects"].reshape(-1, POSE_SIZE)
    np.testing.assert_array_equal(focused[:, :POSE_SIZE], poses)
    np.testing.assert_array_equal(focused[0], rows[stack.subject])
    np.testing.assert_array_equal(focused[1], rows[stack.goal])


def test_subgoal_episodes_start_on_an_executable_subgoal_drawn_with_the_layout():
    env = make_env(sim.env_id("skills"), obs_mode="state", entity_features=True,
                   subgoal_focus=True, max_episode_steps=150)  # fmt: skip
    u = env.unwrapped
    drawn = {}
    for tid in range(20):
        obs, info = env.reset(options={"task_id": tid, "trial_id": 0})
        sub = env.focused
        assert sub in u.task.subgoals and info["instruction"] == obs["instruction"]
        assert parse_subgoal(obs["instruction"], u.layout.colours) == sub
        again, _ = env.reset(options={"task_id": tid, "trial_id": 0})
        assert env.focused == sub and again["instruction"] == obs["instruction"]
        drawn.setdefault(sub.family, tid)
    assert set(drawn) == {"push", "put", "stack"}
    # the episode is the subgoal's: the scripted expert finishes it and the env says success
    env.reset(options={"task_id": drawn["stack"], "trial_id": 0})
    expert = ScriptedExpert(env)  # the env with its focus (the bare env is the whole task)
    for _ in range(150):
        _, reward, terminated, truncated, info = env.step(expert.act())
        if terminated or truncated:
            break
    assert terminated and info["success"] and reward == 1.0
    assert u.subgoals_done() == 0  # the scene's own first subgoal (push) is still undone


def _observation(env, tid: int) -> dict[str, torch.Tensor]:
    obs, _ = env.reset(options={"task_id": tid, "trial_id": 0})
    return {
        "objects": torch.as_tensor(obs["objects"])[None],
        "proprio": torch.as_tensor(obs["proprio"])[None],
        "instruction": obs["instruction"],
    }


def test_the_entity_reader_reads_words_not_the_order_of_the_entities():
    env = make_env(sim.env_id("skills"), obs_mode="state", entity_features=True,
                   subgoal_focus=True)  # fmt: skip
    spaces = {"action": env.action_space, "observation": env.observation_space}
    torch.manual_seed(0)
    policy = build_compact(spec_from_config(dataclasses.replace(VLAConfig(), **READER),
                                            spaces, 1, 64))  # fmt: skip
    o = _observation(env, 0)
    words = encode_words([o["instruction"]], policy.vocab, 40)
    perm = torch.randperm(len(o["objects"][0]) // ENTITY_SIZE)
    shuffled = o["objects"].reshape(1, -1, ENTITY_SIZE)[:, perm].reshape(1, -1)
    base = {"objects": o["objects"], "proprio": o["proprio"], "words": words}
    mean, _ = policy(base)
    same, _ = policy({**base, "objects": shuffled})
    torch.testing.assert_close(mean, same, rtol=1e-5, atol=1e-6)
    other = encode_words([_observation(env, 1)["instruction"]], policy.vocab, 40)
    assert not torch.allclose(mean, policy({**base, "words": other})[0])


def test_the_entity_reader_learns_to_find_the_block_the_words_name():
    """Regress the position of the block named by colour among four blocks and two bowls of
    random colours and positions: only reading the word finds it (the mean of the blocks, the
    best answer without the word, stays far off)."""
    gen = torch.Generator().manual_seed(0)
    names = list(COLOURS)
    vocab = {w: i + 2 for i, w in enumerate(["the", "block", *names])}

    def batch(n: int):
        ents = torch.zeros(n, 6, ENTITY_SIZE)
        ents[..., :3] = torch.rand(n, 6, 3, generator=gen) * 2 - 1
        ents[:, :4, POSE_SIZE] = 1.0  # blocks
        ents[:, 4:, POSE_SIZE + 1] = 1.0  # bowls
        colour = torch.stack([torch.randperm(len(names), generator=gen)[:6] for _ in range(n)])
        ents[torch.arange(n)[:, None], torch.arange(6), POSE_SIZE + len(ENTITY_KINDS) + colour] = 1
        named = torch.randint(0, 4, (n,), generator=gen)
        texts = [f"the {names[int(colour[i, named[i]])]} block" for i in range(n)]
        return ents, encode_words(texts, vocab, 4), ents[torch.arange(n), named, :3]

    torch.manual_seed(0)
    words, reader = InstructionEncoder(len(vocab) + 2, 32, "gru"), EntityReader(32, 64)
    head = torch.nn.Linear(64, 3)
    params = [*words.parameters(), *reader.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(400):
        ents, ids, target = batch(128)
        loss = (head(reader(ents, torch.zeros(len(ents), 3), words.encode(ids))) - target).square()
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
    ents, ids, target = batch(512)
    with torch.no_grad():
        err = (head(reader(ents, torch.zeros(len(ents), 3), words.encode(ids))) - target).norm(-1)
    blind = (ents[:, :4, :3].mean(1) - target).norm(dim=-1)
    assert err.mean() < 0.25 * blind.mean(), (err.mean(), blind.mean())


def test_the_entities_encoder_and_the_entity_features_come_together():
    base = ["train.steps=1", "env.num_envs=2", "env.id=perceptrl/Skills-v0", "env.obs_mode=state"]
    for extra, message in (
        (["env.entity_features=false"], "needs env.entity_features=true"),
        (["vla.encoder=state"], "no other encoder reads it"),
    ):
        with pytest.raises(ConfigError, match=message):  # when the recipe loads
            load_config("configs/plan_exec_reader.yaml", [*base, *extra])


def test_one_reading_policy_executes_every_family_and_the_long_instruction(tmp_path):
    executor = load_executor("policy", {"all": _reader(tmp_path / "reader")})
    assert executor.entity_features and all(executor.can(f) for f in ("put", "stack", "push"))
    env = PlanEnv(PlanSettings(executor, subgoal_steps=4))
    for task in ("push_then_put", "put_then_stack", "put_three"):  # other entity counts
        env.reset([_sample(task, 1)])
        e = env.scene(0).unwrapped
        for sub in e.task.subgoals[:2]:
            obs = env.respond(0, f"<subgoal>{sub.text(e.layout.colours)}</subgoal>")
            assert obs.error is None, obs.text
        assert env.rows[0].record["planner/env_steps"] == 8
    seen = []
    policy = executor.policies["all"]
    observe = policy.observe
    policy.observe = lambda batch: seen.append(batch.instructions[0]) or observe(batch)
    sample = _sample("put_three", 2)
    scores, records = executor_alone(PlanSettings(executor, subgoal_steps=3), [sample])
    assert scores["count"] == 1.0 and records[sample["id"]]["info"]["env_steps"] == 9
    env.reset([sample])
    assert set(seen) == {env.scene(0).unwrapped.layout.instruction}  # the whole long instruction


def test_the_executor_alone_scores_the_task_in_the_scene():
    """The scripted experts given the whole task (no focus: the composite expert runs its
    subgoals in order) complete it; an executor that holds still completes nothing."""
    samples = [_sample("put_two", 1), _sample("push_then_put", 2)]
    scores, records = executor_alone(PlanSettings(OracleExecutor()), samples)
    assert scores["accuracy"] == 1.0 and scores["progress"] == 1.0
    assert scores["accuracy/put_two"] == 1.0 and scores["accuracy/push_then_put"] == 1.0

    class Idle:
        def start(self, env):
            return lambda obs: np.zeros((1, 5), np.float32)

    scores, records = executor_alone(PlanSettings(Idle(), subgoal_steps=10), samples)
    assert scores["accuracy"] == 0.0 and scores["progress"] == 0.0
    assert records["put_two-1"]["info"]["env_steps"] == 20


def test_a_reading_policy_and_per_family_policies_are_not_mixed(tmp_path):
    put = gym.make(sim.env_id("put"), obs_mode="state")
    spaces = {"action": put.action_space, "observation": put.observation_space}
    vla = dataclasses.replace(VLAConfig(), encoder="state", hidden=32)
    build_compact(spec_from_config(vla, spaces, 1, 64)).save(tmp_path / "put")
    reader = _reader(tmp_path / "reader")
    with pytest.raises(ValueError, match="does not read its instruction"):
        load_executor("policy", {"all": str(tmp_path / "put")})
    with pytest.raises(ValueError, match="mixes instruction-reading policies"):
        load_executor("policy", {"put": str(tmp_path / "put"), "stack": reader})
    per_family = PlanSettings(load_executor("policy", {"put": str(tmp_path / "put")}))
    with pytest.raises(ValueError, match="needs one policy that reads it"):
        executor_alone(per_family, [_sample("put_two")])
