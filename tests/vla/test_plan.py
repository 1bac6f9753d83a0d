"""Reason, then act: the planner's episode environment with the oracle and a VLA executor,
invalid plans, physics blow-ups, forks, the plan rewards, the generator, and the ``plan`` side
end to end through the trainer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from perceptrl.datasets.plan_tasks import SPLIT_BASE, generate, reasoning_trace
from perceptrl.rewards import RewardContext, build_reward
from perceptrl.trainer.batch import GUIDE
from perceptrl.trainer.config import ConfigError
from perceptrl.trainer.metrics import read_metrics
from perceptrl.trainer.segments import OBSERVATION
from perceptrl.vla.executors import OracleExecutor
from perceptrl.vla.plan_env import INVALID, PlanEnv, PlanSettings
from perceptrl.vlm.run_plan import resolve
from perceptrl.wiring import load_config, side

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_scenes import TINY, oracle_plan_texts, scene_sample  # noqa: E402


def test_the_oracle_plan_completes_the_task_and_invalid_turns_change_nothing():
    env = PlanEnv(PlanSettings(OracleExecutor()))
    env.reset([scene_sample()])
    first, second = oracle_plan_texts(env, 0)
    start = env.rows[0].state
    bad = [
        ("<think>hmm</think>", "write the next subgoal"),
        ("<subgoal>put the magenta block in the red bowl</subgoal>", "no magenta block"),
        ("<subgoal>dance</subgoal>", "not a subgoal I can execute"),
    ]
    for text, says in bad:
        obs = env.respond(0, text)
        assert obs.error == INVALID and says in obs.text and not obs.images
        assert env.rows[0].state is start  # the scene did not move
    obs = env.respond(0, f"<think>first the bowl</think><subgoal>{first}</subgoal>")
    assert obs.error is None and obs.text.startswith("The robot did") and len(obs.images) == 1
    assert obs.info["planner/progress"] == 0.5 and obs.info["planner/success"] == 0.0
    again = env.respond(0, f"<subgoal>{first}</subgoal>")  # already done: invalid now
    assert again.error == INVALID and "already done" in again.text
    obs = env.respond(0, f"<subgoal>{second}</subgoal>")
    rec = obs.info
    assert rec["planner/success"] == 1.0 and rec["planner/progress"] == 1.0
    assert rec["planner/subgoals"] == 6 and rec["planner/valid"] == 2
    assert rec["planner/invalid"] == 4 and rec["planner/executed"] == 2
    assert rec["planner/env_steps"] > 0 and rec["planner/unstable"] == 0
    assert env.respond(0, "<done/>") is None


def test_rows_of_a_group_and_forks_are_independent_episodes():
    env = PlanEnv(PlanSettings(OracleExecutor()))
    s = scene_sample("put_two", 5)
    env.reset([s, s])
    first, second = oracle_plan_texts(env, 0)
    env.respond(0, f"<subgoal>{first}</subgoal>")
    env.fork(0, 2)  # a branch after the first subgoal
    done = env.respond(2, f"<subgoal>{second}</subgoal>")
    assert done.info["planner/success"] == 1.0
    other = env.respond(1, f"<subgoal>{second}</subgoal>")  # row 1 never did the first
    assert other.info["planner/progress"] == 0.0 and other.info["planner/executed"] == 1
    back = env.respond(0, f"<subgoal>{first}</subgoal>")  # row 0 did not see row 2's second
    assert back.error == INVALID and "already done" in back.text
    assert env.rows[0].record["planner/progress"] == 0.5


def test_a_remembered_subgoal_replays_exactly_what_simulating_it_did():

    def episode(env, row, turns):
        return [env.respond(row, t) for t in turns]

    s = scene_sample("put_then_stack", 7)
    plain = PlanEnv(PlanSettings(OracleExecutor(), memo=0))
    plain.reset([s])
    first, second = oracle_plan_texts(plain, 0)
    turns = [f"<subgoal>{first}</subgoal>", f"<subgoal> {second}</subgoal>"]
    want = episode(plain, 0, turns)
    env = PlanEnv(PlanSettings(OracleExecutor()))
    env.reset([s, s, s])
    for row in range(3):  # the group agrees on the plan: simulated once, replayed twice
        got = episode(env, row, turns)
        for a, b in zip(got, want, strict=True):
            assert a.text == b.text and a.info == b.info
            np.testing.assert_array_equal(np.asarray(a.images[0]), np.asarray(b.images[0]))
    assert env.memo_hits == 4 and plain.memo_hits == 0
    e = env.scene(2).unwrapped
    assert e.subgoals_done() == 2
    # the same subgoal after another history is a new path: simulated
    env.reset([s])
    assert env.respond(0, f"<subgoal>{second}</subgoal>").error is None
    assert env.memo_hits == 4


def test_plan_rewards_read_the_episode_record():
    reward = build_reward({"plan_success": 1.0, "plan_progress": 0.5, "plan_validity": 0.2,
                           "subgoal_cost": 0.02})  # fmt: skip
    rec = {"planner/success": 1.0, "planner/progress": 1.0, "planner/subgoals": 4.0,
           "planner/valid": 2.0}  # fmt: skip
    half = {"planner/success": 0.0, "planner/progress": 0.5, "planner/subgoals": 1.0,
            "planner/valid": 1.0}  # fmt: skip
    ctx = RewardContext(episodes=[{"info": rec}, {"info": half}, None])
    totals, comps, _ = reward(["a", "b", "c"], [{}, {}, {}], ctx)
    assert totals == pytest.approx([1 + 0.5 + 0.1 - 0.08, 0.25 + 0.2 - 0.02, 0.0])
    assert comps["plan_validity"] == pytest.approx([0.5, 1.0, 0.0])


def test_the_generator_writes_disjoint_splits_with_the_oracle_plan(tmp_path):
    paths = generate(tmp_path, {"train": 4, "val": 2}, seed=3, image_size=64)
    rows = {k: [json.loads(x) for x in open(p)] for k, p in paths.items()}
    assert [r["family"] for r in rows["train"]] == [
        "put_two",
        "put_then_stack",
        "push_then_put",
        "put_three",
    ]
    ids = {k: {r["meta"]["scene"]["task_id"] for r in v} for k, v in rows.items()}
    assert ids["train"] == set(range(4)) and ids["val"] == {
        SPLIT_BASE["val"],
        SPLIT_BASE["val"] + 1,
    }
    r = rows["train"][3]
    assert (tmp_path / r["images"][0]).exists() and len(r["meta"]["plan"]) == 3
    for row in rows["train"]:  # each subgoal in the words of the instruction (a copyable clause)
        assert all(step in row["question"] for step in row["meta"]["plan"])
    turns = reasoning_trace(r)
    assert turns[-1] == "<done/>" and turns[0] == f"<subgoal> {r['meta']['plan'][0]}</subgoal>"
    env = PlanEnv(PlanSettings(OracleExecutor()))
    env.reset([r])
    assert [env.respond(0, t) for t in turns][-1] is None
    assert env.rows[0].record["planner/success"] == 1.0


def test_the_plan_side_trains_and_scores_with_the_simulator(tmp_path):
    cfg = load_config("configs/plan_grpo.yaml", TINY)
    trainer = side(cfg).build_trainer(cfg, tmp_path)
    trainer.fit()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    train = next(r for r in rows if "reward/plan_success" in r)
    # 8 new tokens cannot close a <subgoal> turn: the episodes end at the turn limit, with no
    # subgoal run (what the planner records look like is in the tests above)
    assert train["episode/stop/turn_length"] == 1.0 and train["reward/plan_success"] == 0.0
    assert {"reward/plan_progress", "reward/plan_validity", "reward/subgoal_cost"} <= set(train)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals and "eval/reward/plan_success" in evals[-1]


def test_oracle_traces_are_executed_as_sft_targets(tmp_path):
    """The warm start records the oracle plans with the executor really running them: every
    trace ends with the task done, and the observations (new images) sit between the turns."""
    from perceptrl.vlm.builder import build_policy, load_data
    from perceptrl.vlm.episode import forced_batch

    plan = resolve(load_config("configs/plan_grpo.yaml", TINY))
    data = load_data(plan.data, tmp_path)
    policy = build_policy(plan, tmp_path)
    batch = forced_batch(policy, data.train[:2], [reasoning_trace(s) for s in data.train[:2]])
    for m in batch.meta:
        assert m["episode"]["info"]["planner/success"] == 1.0
    assert batch.segments.mask(OBSERVATION).sum() > 0 and all(
        v is not None for v in batch.segments.row_vision()["pixel_values"]
    )


def test_guide_rows_are_executed_oracle_plans_and_training_raises_them(tmp_path):
    """``rollout.guide=1`` on the planner: one member of each group is the oracle plan, its
    subgoals run by the executor (the task done); the planner's own episodes (8 tokens cannot
    close a turn) score less, so the update raises the plans' likelihood."""
    from perceptrl.vlm.episode import forced_batch

    cfg = load_config("configs/plan_grpo.yaml", [
        *TINY, "rollout.guide=1", "rollout.episode.max_turns=4", "train.steps=3",
        "train.lr=1.0e-3", "train.eval_every=0",
    ])  # fmt: skip
    trainer = side(cfg).build_trainer(cfg, tmp_path)
    src, policy = trainer.source, trainer.policy
    batch, m = src.collect(policy, 0)
    assert batch.group_id.tolist() == [0, 0, 1, 1]
    guide = (batch.origin == GUIDE).nonzero().squeeze(1).tolist()
    assert guide == [1, 3]
    for i in guide:
        e = batch.meta[i]["episode"]
        assert e["texts"] == reasoning_trace(batch.meta[i]["sample"])
        assert e["info"]["planner/success"] == 1.0
    assert m["episode/stop/turn_length"] == 1.0  # the sampled rows only
    assert m["rollout/guide_rows"] == 2.0 and m["reward/guide_mean"] > m["reward/sampled_mean"]

    samples = [src.samples[0], src.samples[1]]
    plans = forced_batch(policy, samples, [reasoning_trace(s) for s in samples])

    def likelihood() -> float:
        with torch.no_grad():
            logp = policy.evaluate(plans).logp
        return float((logp * plans.mask).sum() / plans.mask.sum())

    before = likelihood()
    trainer.fit()
    assert likelihood() > before + 0.3  # -1.15 to -0.34 here; without guide rows unchanged


def test_a_guide_trace_that_does_not_run_is_a_data_error(tmp_path):
    from perceptrl.datasets.loader import DataError

    cfg = load_config("configs/plan_grpo.yaml", [*TINY, "rollout.guide=1"])
    trainer = side(cfg).build_trainer(cfg, tmp_path)
    for s in trainer.source.samples:
        s["meta"]["plan"] = ["put the gold block in the silver bowl", "stack nothing"]
    with pytest.raises(DataError, match="reference trace does not run.*turn 1 fails"):
        trainer.source.collect(trainer.policy, 0)


def test_guide_rows_are_refused_where_they_cannot_be_built():
    """The recipe's rules when it loads; each sample's trace when the run is built."""
    from perceptrl.vlm.builder import guide_trace

    for extra, match in [
        (["rollout.guide=2"], "at least one sample"),
        (["rollout.guide=1", "algo.tis_cap=2.0"], "no sampling log-probs"),
        (["rollout.guide=1", "train.pipeline=async"], "train.pipeline=sync"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config("configs/plan_grpo.yaml", [*TINY, *extra])
    plan = resolve(load_config("configs/plan_grpo.yaml", [*TINY, "rollout.guide=1"]))
    with pytest.raises(ConfigError, match="sample lacks it"):
        guide_trace(plan, [{"id": "x", "meta": {}}])


def test_the_plan_side_needs_the_plan_environment():
    """Refused when the recipe loads (``perceptrl config`` too), before anything is built."""
    with pytest.raises(ConfigError, match="rollout.episode.env=plan"):
        load_config("configs/plan_grpo.yaml", [*TINY, "rollout.episode.env=tools"])
    with pytest.raises(ConfigError, match="plan.policies"):
        load_config("configs/plan_grpo.yaml", [*TINY, "plan.executor=policy"])


def test_the_held_out_score_reads_the_episodes(tmp_path, monkeypatch):
    """The evaluator scores planner episodes with plan_success from their records: greedy
    decoding replaced by the oracle traces (really executed), every episode succeeds."""
    from perceptrl.vlm import source
    from perceptrl.vlm.builder import build_evaluator, build_policy, load_data
    from perceptrl.vlm.episode import forced_batch

    plan = resolve(load_config("configs/plan_grpo.yaml", TINY))
    data = load_data(plan.data, tmp_path)
    policy = build_policy(plan, tmp_path)

    def oracle(policy, prompts, *_):
        samples = [p.sample for p in prompts]
        return forced_batch(policy, samples, [reasoning_trace(s) for s in samples])

    monkeypatch.setattr(source, "_greedy", oracle)
    metrics = build_evaluator(plan.evaluation, data.val)(policy)
    assert metrics["accuracy"] == 1.0 and metrics["reward/plan_success"] == 1.0
    assert metrics["planner/progress"] == 1.0 and metrics["count"] == 2


def test_an_episode_replays_into_a_video_with_its_subgoals(tmp_path):
    from perceptrl.sim.demonstrations import read_video
    from perceptrl.vla.plan_env import INVALID_FRAMES, replay_video

    env = PlanEnv(PlanSettings(OracleExecutor()))
    sample = scene_sample("put_two", 4)
    env.reset([sample])
    first, second = oracle_plan_texts(env, 0)
    turns = [
        "<subgoal>dance</subgoal>",
        f"<subgoal>{first}</subgoal>",
        f"<subgoal>{second}</subgoal>",
        "<done/>",
    ]
    rec = replay_video(PlanSettings(OracleExecutor()), sample, turns, tmp_path / "ep.mp4", size=96)
    frames = read_video(tmp_path / "ep.mp4")
    assert rec["planner/success"] == 1.0 and frames.shape[1:] == (96, 96, 3)
    # the start, the invalid turn, one frame per env step of both subgoals, the verdict
    assert len(frames) == INVALID_FRAMES * 2 + rec["planner/env_steps"] + 20


def test_pass_k_of_a_planner_counts_completed_tasks(tmp_path, monkeypatch):
    """`perceptrl eval plan_grpo --pass-k` through the plan side: sampling replaced by the oracle
    plan in the first of each question's two episodes and by an empty plan (done at once) in the
    second, all executed for real; task success scores them, so pass@1 = 0.5 and pass@2 = 1."""
    import torch

    from perceptrl.vlm.episode import forced_batch
    from perceptrl.vlm.sampler import Rollouts

    def half_oracle(rollouts, prompts, n, sp):
        samples = [p.sample for p in prompts for _ in range(n)]
        traces = [reasoning_trace(s) if j % n == 0 else ["<done/>"] for j, s in enumerate(samples)]
        b = forced_batch(rollouts.policy, samples, traces)
        b.group_id = torch.arange(len(prompts)).repeat_interleave(n)
        return b

    monkeypatch.setattr(Rollouts, "sample", half_oracle)
    cfg = load_config("configs/plan_grpo.yaml", TINY)
    side(cfg).run_pass_k({"oracle": cfg}, tmp_path, [1, 2], 2)
    saved = json.loads((tmp_path / "passk.json").read_text())["oracle"]
    assert saved["overall"] == {"1": 0.5, "2": 1.0} and saved["questions"] == 2


@pytest.mark.slow
def test_the_plan_side_trains_through_the_ray_pipeline(tmp_path):
    """`train.pipeline=one_step_off` on the plan side: the Ray worker process runs the plan
    side's worker function, so it imports `vla.plan_env` and finds the planner's environment."""
    pytest.importorskip("ray")
    import ray

    cfg = load_config("configs/plan_grpo.yaml", [
        *TINY, "train.steps=2", "train.eval_every=0", "train.pipeline=one_step_off",
        "rollout.workers=1", "train.device=cpu",
    ])  # fmt: skip
    trainer = side(cfg).build_trainer(cfg, tmp_path)
    try:
        trainer.fit()
    finally:
        trainer.source.close()
        ray.shutdown()
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "pipeline/staleness_max" in r]
    assert len(rows) == 2 and all(r["rollout/samples"] == 4.0 for r in rows)
    assert all("reward/plan_success" in r for r in rows)


def test_the_shipped_planner_base_copies_the_first_clause_of_an_instruction(tmp_path):
    """assets/vlm_plan_base (assets/build/make_plan_base.py) has learnt to name a subgoal in the
    instruction's words: greedy, from a text prompt, its first turn is the first subgoal of
    unseen layouts (the shipped tiny VLM it was made from writes none)."""

    from perceptrl.sim.composite import SubgoalError, parse_subgoal
    from perceptrl.sim.tasks import get_task, layout
    from perceptrl.vla.plan_env import SUBGOAL
    from perceptrl.vlm.builder import build_policy
    from perceptrl.vlm.prompts import build_messages

    cfg = load_config("configs/plan_grpo.yaml", ["log.tensorboard=false"])
    side(cfg)

    def first_turns(model_path: str) -> int:
        cfg2 = load_config("configs/plan_grpo.yaml", [f"model.path={model_path}"])
        policy = build_policy(resolve(cfg2), tmp_path)
        rng, right = np.random.default_rng(7), 0
        for k in range(8):
            task = get_task(("put_two", "put_then_stack", "push_then_put", "put_three")[k % 4])
            lay = layout(task, rng, rng)
            text = policy.processor.apply_chat_template(
                build_messages({"question": lay.instruction}, cfg.rollout.system_prompt),
                tokenize=False, add_generation_prompt=True,
            )  # fmt: skip
            ids = policy.processor.tokenizer(text, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                out = policy.model.generate(ids, max_new_tokens=40, do_sample=False)
            said = policy.processor.tokenizer.decode(out[0, ids.shape[1] :])
            m = SUBGOAL.search(said)
            try:
                right += (
                    m is not None and parse_subgoal(m.group(1), lay.colours) == task.subgoals[0]
                )
            except SubgoalError:
                pass
        return right

    assert first_turns("assets/vlm_plan_base") >= 6
    assert first_turns("assets/vlm_base") == 0


def test_planners_are_compared_with_the_oracle_plan_on_the_same_states(tmp_path, monkeypatch):
    """`perceptrl eval plan_grpo --model a=.. --model b=..`: greedy decoding replaced by the
    oracle traces for the first planner and by an empty plan (done at once) for the second, all
    executed for real; the table, chart, JSON and videos show each next to the oracle plan."""
    from perceptrl.sim.demonstrations import read_video
    from perceptrl.vlm import source
    from perceptrl.vlm.episode import forced_batch

    calls = []

    def first_oracle_then_nothing(policy, prompts, *_):
        calls.append(len(prompts))
        samples = [p.sample for p in prompts]
        plans = [reasoning_trace(s) if len(calls) == 1 else ["<done/>"] for s in samples]
        return forced_batch(policy, samples, plans)

    monkeypatch.setattr(source, "_greedy", first_oracle_then_nothing)
    cfgs = {n: load_config("configs/plan_grpo.yaml", [*TINY, "plan.eval_videos=1"])
            for n in ("follows", "quits")}  # fmt: skip
    result = side(cfgs["follows"]).run_compare(cfgs, tmp_path)
    assert calls == [2, 2]  # one batch of the same two held-out states per planner
    saved = json.loads((tmp_path / "compare.json").read_text())
    m = saved["metrics"]
    assert m["follows"]["accuracy"] == 1.0 and m["quits"]["accuracy"] == 0.0
    assert m["oracle_plan"]["accuracy"] == 1.0 and m["oracle_plan"]["count"] == 2
    tried = sum(v for k, v in m["oracle_plan"].items() if k.startswith("count/executor/"))
    assert tried == m["follows"]["planner/executed"] * 2  # every oracle subgoal, executed
    assert all(v == 1.0 for k, v in m["oracle_plan"].items() if k.startswith("executor/"))
    assert "| quits | 0.000 |" in result["table"] and "| oracle_plan | 1.000 |" in result["table"]
    names = {p.name for p in result["files"]}
    assert {"compare.md", "compare.png", "follows_0.mp4", "quits_0.mp4"} <= names
    assert read_video(tmp_path / "follows_0.mp4").shape[1:] == (256, 256, 3)
    # key frames: the start, the end of each executed subgoal, the outcome
    h, w = Image.open(tmp_path / "follows_0.png").size[::-1]
    assert h == 256 and (w + 4) % 260 == 0 and (w + 4) // 260 in (4, 5)  # 2-3 subgoals
    assert Image.open(tmp_path / "quits_0.png").size == (2 * 256 + 4, 256)  # start, outcome


def test_plan_turns_scores_each_turn_where_it_ends():
    """The per-turn process reward: progress made and invalid turns, at each turn's end in the
    joined policy text; the turn that ends the episode gets no step."""
    from perceptrl.rewards.plan_rewards import plan_turns

    env = PlanEnv(PlanSettings(OracleExecutor()))
    env.reset([scene_sample("put_two", 5)])
    first, second = oracle_plan_texts(env, 0)
    turns = ["<subgoal>put the magenta block in the red bowl</subgoal>",
             f"<subgoal>{first}</subgoal>", f"<subgoal>{second}</subgoal>", "<done/>"]  # fmt: skip
    for t in turns:
        obs = env.respond(0, t)
    record = {"texts": turns, "info": env.rows[0].record}
    assert record["info"]["planner/turn_progress"] == (0.0, 0.5, 0.5)
    assert record["info"]["planner/turn_invalid"] == (1.0, 0.0, 0.0) and obs is None
    assert record["info"]["planner/turn_match"] == (0.0, 1.0, 1.0)
    one = RewardContext(episodes=[record])
    (steps,) = plan_turns(["".join(turns)], [{}], one, invalid=-0.3)
    ends = [len("".join(turns[: k + 1])) for k in range(3)]
    assert [s.end for s in steps] == ends and [s.score for s in steps] == [-0.3, 0.5, 0.5]
    (steps,) = plan_turns(["".join(turns)], [{}], one, match=0.25)
    assert [s.score for s in steps] == [-0.2, 0.75, 0.75]
    # out of order: the second subgoal first is valid but not the next one; then the first is
    env.reset([scene_sample("put_two", 5)])
    for t in (second, first):
        env.respond(0, f"<subgoal>{t}</subgoal>")
    rec = env.rows[0].record
    assert rec["planner/turn_match"] == (0.0, 1.0) and rec["planner/on_plan"] == 1
    assert rec["planner/turn_progress"] == (0.0, 1.0) and rec["planner/success"] == 1.0
    assert plan_turns(["x"], [{}], RewardContext()) == [[]]  # no episode records: no steps
    # <done/> said while the task is not complete: scored on the done turn when asked
    early = {"texts": ["<done/>"], "stop": "answer", "info": {}}
    complete = {**record, "stop": "answer"}
    got = plan_turns(["<done/>", "".join(turns)], [{}, {}],
                     RewardContext(episodes=[early, complete]), early_done=-0.5)  # fmt: skip
    assert got[0] == [(len("<done/>"), -0.5)] and len(got[1]) == 3  # the complete one: none
    assert plan_turns(["<done/>"], [{}], RewardContext(episodes=[early])) == [[]]  # off by default


def test_per_turn_rewards_sit_on_each_turn_s_last_policy_token(tmp_path):
    """`RuleSteps` on episode rows: the step reward reads the joined policy turns and the
    records, and each score lands on the policy token that ends its turn (never on an
    observation); a plan recipe with ``rollout.process_reward=plan_turns`` trains."""
    from perceptrl.vlm.builder import build_policy, load_data
    from perceptrl.vlm.episode import forced_batch
    from perceptrl.vlm.process import RuleSteps

    plan = resolve(load_config("configs/plan_grpo.yaml", TINY))
    data = load_data(plan.data, tmp_path)
    policy = build_policy(plan, tmp_path)
    samples = [s for s in data.train if len(s["meta"]["plan"]) == 2][:2]
    batch = forced_batch(policy, samples, [reasoning_trace(s) for s in samples])
    steps, stats = RuleSteps("plan_turns", policy.processor.tokenizer)(
        batch, torch.ones(len(batch))
    )
    assert stats == {"process_errors": 0.0, "process_steps": 2.0}
    for b in range(len(batch)):
        at = steps[b].nonzero().flatten().tolist()
        assert len(at) == 2 and steps[b, at].tolist() == [0.5, 0.5]
        assert all(batch.mask[b, t] == 1 for t in at)
        assert batch.mask[b, at[0] + 2] == 0  # then the stop token, then the observation
    cfg = load_config("configs/plan_grpo.yaml", [*TINY, "rollout.process_reward=plan_turns",
                                                  "algo.adv_estimator=prime"])  # fmt: skip
    side(cfg).build_trainer(cfg, tmp_path / "run").fit()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert any("reward/process_mean" in r for r in rows)
