"""judge: verdict parsing by hand, prompt building, and the whole path with a judge whose verdicts
are known — a tiny VLM rigged to answer ``<score>7</score>`` — in its worker process: judge
prompt -> worker -> generate -> parse -> composite -> ``VLMRolloutSource.collect``; the real
worker killed at the time limit (stopped with SIGSTOP: it cannot answer) and killed mid-call is
restarted, counted and scores as expected. The rollout source hands token lengths and group ids
to the composite."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from PIL import Image

from perceptrl.registry import REWARDS, STEP_REWARDS
from perceptrl.rewards import RewardContext, build_reward
from perceptrl.rewards.judge import (
    DEFAULT_RUBRIC,
    JUDGE_SYSTEM_PROMPT,
    build_judge_sample,
    close_judges,
    judge_worker,
    parse_score,
)
from perceptrl.rewards.shaping import overlong_penalty
from perceptrl.vlm import rollout
from perceptrl.vlm.config import RolloutConfig
from perceptrl.vlm.model import load_vlm
from perceptrl.vlm.policy import VLMPolicy
from perceptrl.vlm.prompts import PromptConfig, encode_prompts
from perceptrl.vlm.source import VLMRolloutSource
from perceptrl.vlm.tiny import build_tiny

VERDICT = "<score>7</score>"


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("judge") / "tiny", seed=1)


@pytest.fixture(scope="module")
def rigged_dir(tmp_path_factory):
    """A tiny judge whose greedy answer to any prompt is exactly ``<score>7</score>``.

    With every attention and MLP output projection zeroed, each position's last hidden state is
    its own token embedding. All embeddings are e0 except that of an added token ``VERDICT``
    (e1); the LM head maps e0 to ``VERDICT`` and e1 to ``<|im_end|>``. So after any prompt the
    judge writes ``VERDICT`` and then stops."""
    d = build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("rigged") / "judge", seed=2,
                   tie_word_embeddings=False)  # fmt: skip
    model, proc = load_vlm(d)
    proc.tokenizer.add_tokens([VERDICT])
    model.resize_token_embeddings(len(proc.tokenizer), pad_to_multiple_of=64, mean_resizing=False)
    v, end = proc.tokenizer.convert_tokens_to_ids([VERDICT, "<|im_end|>"])
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        for name, m in model.named_modules():
            if name.endswith(("o_proj", "down_proj")):
                m.weight.zero_()
        emb.zero_()
        emb[:, 0] = 1.0
        emb[v] = torch.nn.functional.one_hot(torch.tensor(1), emb.shape[1]).float()
        head.zero_()
        head[v, 0], head[end, 1] = 10.0, 10.0
    model.save_pretrained(d)
    proc.save_pretrained(d)
    yield d
    close_judges()


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge_images")
    out = []
    for i, colour in enumerate([(200, 40, 40), (40, 40, 200)]):
        p = root / f"im{i}.png"
        Image.new("RGB", (112, 112), colour).save(p)
        out.append({"id": f"j{i}", "images": [str(p)], "question": "What colour is the square?",
                    "answer": ["red", "blue"][i], "reward": "rouge_l", "meta": {}})  # fmt: skip
    return out


@pytest.mark.parametrize(
    "text,scale,expected",
    [
        ("<score>7</score>", 10, 0.7),
        ("The response is right. <score> 10 </score>", 10, 1.0),
        ("<score>0</score>", 10, 0.0),
        ("<score>2.5</score>", 5, 0.5),
        ("<score>3/5</score>", 5, 0.6),
        ("<SCORE>4</SCORE>", 10, 0.4),
        ("<score>1</score> then <score>9</score>", 10, 0.9),  # the last verdict counts
        ("<score>3/10</score>", 5, 0.0),  # another scale
        ("<score>11</score>", 10, 0.0),  # off the scale
        ("<score>-1</score>", 10, 0.0),
        ("<score>seven</score>", 10, 0.0),
        ("<score>7", 10, 0.0),
        ("score: 7", 10, 0.0),
        ("", 10, 0.0),
        (None, 10, 0.0),
    ],
)
def test_parse_score(text, scale, expected):
    assert parse_score(text, scale) == pytest.approx(expected)


def test_judge_prompt_holds_question_reference_response_and_images(samples):
    js = build_judge_sample("<answer>red</answer>", samples[0], scale=5)
    assert js["images"] == samples[0]["images"]
    q = js["question"]
    assert "What colour is the square?" in q and "Reference answer: red" in q
    assert "Response: <answer>red</answer>" in q and "0 to 5" in q and "<score>N</score>" in q
    assert build_judge_sample("x", samples[0], with_images=False)["images"] == []
    assert (
        "Response: abc\n"
        in build_judge_sample("abcdef", samples[0], max_response_chars=3)["question"]
    )


def test_rigged_judge_writes_the_known_verdict_in_process(rigged_dir, samples):
    """The construction itself, without the worker: greedy decoding gives VERDICT and stops."""
    jm, proc = load_vlm(rigged_dir)
    cfg = PromptConfig(system_prompt=JUDGE_SYSTEM_PROMPT, max_prompt_length=4096)
    js = [build_judge_sample(c, s) for c, s in zip(["<answer>red</answer>", "blue"], samples)]
    enc, _ = encode_prompts(proc, js, cfg)
    assert enc[0].num_vision_tokens > 0  # the image is in the judge's prompt
    batch = rollout.greedy(jm, proc, enc, 12)
    assert [m["completion"] for m in batch.meta] == [VERDICT, VERDICT]
    assert batch.mask.sum(1).tolist() == [2, 2]  # VERDICT, <|im_end|>


def test_judge_in_worker_scores_known_verdicts_through_the_rollout_source(
    rigged_dir, judge_dir, samples
):
    reward = build_reward({"judge": {"model": str(rigged_dir), "max_new_tokens": 8}}, timeout_s=120)
    worker = judge_worker(model=str(rigged_dir))
    assert worker.pid not in (None, os.getpid())  # started by build_reward, in a child process
    comps = ["<think>it is red</think><answer>red</answer>", "", "<answer>green</answer>", None]
    ss = [samples[0], samples[1], samples[1], samples[0]]
    totals, parts, stats = reward(comps, ss)
    assert totals == pytest.approx([0.7, 0.0, 0.7, 0.0])  # empty / non-text: not judged
    assert stats["reward/errors"] == 0 and stats["reward/restarts/judge"] == 0
    # the whole path: policy samples -> composite -> judge worker -> rewards on the batch
    torch.manual_seed(0)
    policy = VLMPolicy.from_pretrained(judge_dir)
    cfg = RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=6)
    batch, metrics = VLMRolloutSource(samples, reward, cfg, seed=3).collect(policy, step=0)
    texts = [m["completion"] for m in batch.meta]
    expected = [0.7 if t.strip() else 0.0 for t in texts]
    assert any(expected) and batch.rewards.tolist() == pytest.approx(expected)
    assert metrics["reward/judge"] == pytest.approx(sum(expected) / len(expected))
    assert metrics["reward/restarts/judge"] == 0 and metrics["reward/timeouts/judge"] == 0
    assert worker.restarts == 0


@pytest.mark.slow  # two model-process restarts; fast stand-in: test_rewards_judge_worker.py
def test_judge_worker_hang_and_death_restart_count_and_score(rigged_dir, samples):
    spec = {"judge": {"model": str(rigged_dir), "max_new_tokens": 8}}
    reward, hasty = build_reward(spec, timeout_s=120), build_reward(spec, timeout_s=1.0)
    worker = judge_worker(model=str(rigged_dir))
    comps, ss = ["<answer>red</answer>", "<answer>blue</answer>"], samples
    # hang: a stopped worker cannot answer; it is killed at the limit, its samples score 0
    hung = worker.pid
    os.kill(hung, signal.SIGSTOP)
    totals, _, stats = hasty(comps, ss)
    assert totals == [0.0, 0.0] and stats["reward/timeouts/judge"] == 2
    assert stats["reward/restarts/judge"] == 1 and worker.pid != hung
    # death mid-call: the worker is stopped, then killed while the call waits; the call's
    # samples are retried one by one on the restarted worker and get their verdicts
    reward(comps[:1], ss[:1])  # the replacement has loaded
    dead = worker.pid
    os.kill(dead, signal.SIGSTOP)
    threading.Timer(0.5, os.kill, (dead, signal.SIGKILL)).start()
    totals, _, stats = reward(comps, ss)
    assert totals == pytest.approx([0.7, 0.7]) and stats["reward/errors/judge"] == 0
    assert stats["reward/restarts/judge"] == 1 and worker.pid != dead
    assert worker.restarts == 2


def test_judge_errors_are_counted_and_bad_settings_fail_at_build(rigged_dir, judge_dir, samples):
    reward = build_reward({"judge": {"model": str(rigged_dir), "max_new_tokens": 8}}, timeout_s=120)
    # an error at call time (an unreadable image) is counted, not raised; the worker stays up
    pid = judge_worker(model=str(rigged_dir)).pid
    bad = {**samples[0], "images": [str(judge_dir / "missing.png")]}
    totals, _, stats = reward(["<answer>red</answer>", "<answer>red</answer>"], [bad, samples[0]])
    assert totals == pytest.approx([0.0, 0.7]) and stats["reward/errors/judge"] == 1
    assert judge_worker(model=str(rigged_dir)).pid == pid
    # settings that cannot work fail when the reward is built, naming what to change
    with pytest.raises(ValueError, match="model directory .*nope.* does not exist"):
        build_reward({"judge": {"model": str(judge_dir / "nope")}})
    with pytest.raises(ValueError, match="judge needs model="):
        build_reward(["judge"])
    with pytest.raises(ValueError, match="judge needs model="):
        REWARDS.get("judge")(["a"], samples[:1], RewardContext())
    with pytest.raises(ValueError, match="time limit per call is the composite's"):
        build_reward({"judge": {"model": str(rigged_dir), "timeout_s": 5}})
    starve = r"while starting: .*; the judge's memory_limit_gb \(now 0.3"
    with pytest.raises(RuntimeError, match=starve):
        build_reward({"judge": {"model": str(rigged_dir), "memory_limit_gb": 0.3}})
    assert DEFAULT_RUBRIC.count("{scale}") >= 1


def test_rollout_source_passes_lengths_and_group_ids(judge_dir, samples):
    torch.manual_seed(0)
    policy = VLMPolicy.from_pretrained(judge_dir)
    cfg = RolloutConfig(prompts_per_step=2, group_size=3, max_new_tokens=6)
    reward = build_reward({"overlong": {"max_len": 6, "cache_len": 4}, "majority": 1.0})
    src = VLMRolloutSource(samples, reward, cfg, seed=3)
    batch, metrics = src.collect(policy, step=0)
    lengths = batch.mask.sum(1).long().tolist()
    comps = [m["completion"] for m in batch.meta]
    ctx = RewardContext(lengths=lengths, group_ids=batch.group_id.tolist())
    got = reward(comps, [m["sample"] for m in batch.meta], ctx)
    assert batch.rewards.tolist() == pytest.approx(got[0])
    assert got[1]["overlong"] == pytest.approx([overlong_penalty(n, 6, 4) for n in lengths])
    assert metrics["reward/errors"] == 0


def test_split_steps_reads_the_sentences_of_the_reasoning():
    from perceptrl.rewards.judge import split_steps

    text = "<think>red: 2. blue: 1.\nTotal 3</think><answer>3. done.</answer>"
    spans = split_steps(text)
    assert [text[a:b].strip() for a, b in spans] == ["red: 2.", "blue: 1.", "Total 3"]
    assert split_steps("no think tags. two steps", max_steps=1) == [(0, len("no think tags."))]


def test_judge_steps_grades_every_step_in_one_worker_call(rigged_dir, samples, monkeypatch):
    """The rigged judge answers 7 to every prompt: each of a completion's k steps scores
    0.7 / k at the step's end; a completion without reasoning has no steps."""
    fn = STEP_REWARDS.get("judge_steps")
    worker = judge_worker(model=str(rigged_dir))
    requests = []
    real_call = worker.call
    monkeypatch.setattr(worker, "call", lambda r, t: requests.append(r) or real_call(r, t))
    texts = ["<think>red: 2. blue: 1.</think><answer>3</answer>", "<answer>3</answer>", ""]
    ctx = RewardContext(timeout_s=120)
    out = fn(texts, [samples[0]] * 3, ctx, model=str(rigged_dir), max_new_tokens=8)
    ends = [texts[0].index("2.") + 2, texts[0].index("1.") + 2]
    assert [s.end for s in out[0]] == ends
    assert [s.score for s in out[0]] == pytest.approx([0.35, 0.35])
    assert out[1:] == [[], []]
    assert len(requests) == 1 and len(requests[0]["samples"]) == 2  # both steps, one request
