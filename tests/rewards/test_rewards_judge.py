"""judge: verdict parsing by hand, prompt building, and an end-to-end call with a tiny random VLM;
the rollout source hands token lengths and group ids to the composite."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from perceptrl.rewards import build_reward, get_reward
from perceptrl.rewards.judge import (
    DEFAULT_RUBRIC,
    JUDGE_SYSTEM_PROMPT,
    build_judge_sample,
    load_judge,
    parse_score,
)
from perceptrl.rewards.shaping import overlong_penalty
from perceptrl.trainer.config import RolloutConfig
from perceptrl.vlm import rollout
from perceptrl.vlm.policy import VLMPolicy
from perceptrl.vlm.prompts import PromptConfig, encode_prompts
from perceptrl.vlm.source import VLMRolloutSource
from perceptrl.vlm.tiny import build_tiny


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("judge") / "tiny", seed=1)


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


def test_judge_end_to_end_with_tiny_random_vlm(judge_dir, samples):
    comps = ["<think>it is red</think><answer>red</answer>", "", "<answer>green</answer>", None]
    ss = [samples[0], samples[1], samples[1], samples[0]]
    fn = get_reward("judge")
    load_judge.cache_clear()
    got = fn(comps, ss, model=str(judge_dir), max_new_tokens=12, batch_size=2)
    assert len(got) == 4 and all(0.0 <= v <= 1.0 for v in got)
    assert got[1] == 0.0 and got[3] == 0.0  # empty / non-text: not judged
    # the scores are the parsed greedy verdicts of the judge on the rubric prompts
    jm, proc = load_judge(str(judge_dir.resolve()), "cpu", "float32")
    cfg = PromptConfig(system_prompt=JUDGE_SYSTEM_PROMPT, max_prompt_length=4096)
    js = [build_judge_sample(comps[i], ss[i]) for i in (0, 2)]
    enc, _ = encode_prompts(proc, js, cfg)
    assert enc[0].num_vision_tokens > 0  # the image reached the judge
    verdicts = [m["completion"] for m in rollout.greedy(jm, proc, enc, 12).meta]
    assert [got[0], got[2]] == [parse_score(v) for v in verdicts]
    # loaded once: a second call hits the cache
    fn(comps[:1], ss[:1], model=str(judge_dir), max_new_tokens=4)
    assert load_judge.cache_info().misses == 1 and load_judge.cache_info().hits >= 2
    assert DEFAULT_RUBRIC.count("{scale}") >= 1


def test_judge_in_composite_counts_errors_and_never_raises(judge_dir, samples):
    reward = build_reward({"judge": {"model": str(judge_dir), "max_new_tokens": 4}})
    totals, parts, stats = reward(["<answer>red</answer>", "x"], samples)
    assert len(totals) == 2 and stats["reward/errors"] == 0
    # a judge that cannot load fails when the reward is built, naming the directory
    with pytest.raises(ValueError, match="model directory .*nope.* does not exist"):
        build_reward({"judge": {"model": str(judge_dir / "nope")}})
    with pytest.raises(ValueError, match="judge needs model="):
        build_reward(["judge"])
    with pytest.raises(ValueError, match="judge needs model="):
        get_reward("judge")(["a"], samples[:1])
    # an error at call time (an unreadable image) is counted, not raised
    bad = {**samples[0], "images": [str(judge_dir / "missing.png")]}
    totals, _, stats = reward(["<answer>red</answer>"], [bad])
    assert totals == [0.0] and stats["reward/errors/judge"] == 1


def test_rollout_source_passes_lengths_and_group_ids(judge_dir, samples):
    torch.manual_seed(0)
    policy = VLMPolicy.from_pretrained(judge_dir)
    cfg = RolloutConfig(prompts_per_step=2, group_size=3, max_new_tokens=6)
    reward = build_reward({"overlong": {"max_len": 6, "cache_len": 4}, "majority": 1.0})
    src = VLMRolloutSource(samples, reward, cfg, seed=3)
    batch, metrics = src.collect(policy, step=0)
    lengths = batch.mask.sum(1).long().tolist()
    comps = [m["completion"] for m in batch.meta]
    got = reward(comps, [m["sample"] for m in batch.meta], lengths=lengths,
                 group_ids=batch.group_id.tolist())  # fmt: skip
    assert batch.rewards.tolist() == pytest.approx(got[0])
    assert got[1]["overlong"] == pytest.approx([overlong_penalty(n, 6, 4) for n in lengths])
    assert metrics["reward/errors"] == 0
