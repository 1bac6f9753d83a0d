"""overlong (DAPO), repetition, majority (TTRL), gating and context passing in the composite."""

from __future__ import annotations

import pytest

from perceptrl.registry import REWARDS
from perceptrl.rewards import RewardContext, build_reward
from perceptrl.rewards.group import answer_key
from perceptrl.rewards.shaping import overlong_penalty, repetition_fraction


def S(answer="3", reward: str = "numeric", sid: str = "s", **meta) -> dict:
    return {
        "id": sid,
        "images": [],
        "question": "q",
        "answer": answer,
        "reward": reward,
        "meta": meta,
    }


NO_CTX = RewardContext()


def score(name: str, completions: list, samples: list[dict], ctx=NO_CTX, **kw) -> list[float]:
    return REWARDS.get(name)(completions, samples, ctx, **kw)


@pytest.mark.parametrize(
    "length,expected",
    [(0, 0.0), (80, 0.0), (81, -1 / 20), (90, -0.5), (99, -19 / 20), (100, -1.0), (150, -1.0)],
)
def test_overlong_penalty_dapo(length, expected):
    # L_max = 100, L_cache = 20: free up to 80 tokens, linear to -1 at 100
    assert overlong_penalty(length, 100, 20) == pytest.approx(expected)


def test_overlong_reward_takes_lengths():
    comps = ["a", "b", "c"]
    got = score("overlong", comps, [S()] * 3, RewardContext(lengths=[10, 90, 100]),
                max_len=100, cache_len=20, penalty=0.5)  # fmt: skip
    assert got == pytest.approx([0.0, -0.25, -0.5])
    with pytest.raises(ValueError, match="needs completion lengths"):
        score("overlong", comps, [S()] * 3)
    with pytest.raises(ValueError, match="cache_len <= max_len"):
        score("overlong", comps, [S()] * 3, RewardContext(lengths=[1, 2, 3]), max_len=10,
              cache_len=20)  # fmt: skip


def test_composite_passes_its_context_to_every_term():
    reward = build_reward({"format": 1.0, "overlong": {"max_len": 10, "cache_len": 5}})
    comps = ["<think>a</think><answer>3</answer>", "x"]
    totals, parts, stats = reward(comps, [S()] * 2, RewardContext(lengths=[3, 10]))
    assert parts == {"format": [1.0, 0.0], "overlong": [0.0, -1.0]} and totals == [1.0, -1.0]
    # without lengths overlong fails (counted), format still scores
    totals, parts, stats = reward(comps, [S()] * 2)
    assert totals == [1.0, 0.0] and stats["reward/errors/overlong"] == 2
    with pytest.raises(ValueError, match="1 lengths for 2 completions"):
        reward(comps, [S()] * 2, RewardContext(lengths=[3]))
    with pytest.raises(ValueError, match="come from the rollout"):
        build_reward({"overlong": {"lengths": [1]}})


@pytest.mark.parametrize(
    "text,n,expected",
    [
        ("a b c d", 3, 0.0),  # abc, bcd: all unique
        ("a b c a b c", 3, 1 - 3 / 4),  # abc bca cab abc: 3 unique of 4
        ("go go go go go", 1, 1 - 1 / 5),
        ("Go go GO", 1, 1 - 1 / 3),  # lower-cased
        ("a b", 3, 0.0),  # shorter than n
        ("", 3, 0.0),
    ],
)
def test_repetition_fraction(text, n, expected):
    assert repetition_fraction(text, n) == pytest.approx(expected)


def test_repetition_reward():
    comps = ["a b c a b c", "all words differ here", "", None, "x " * 1000]
    got = score("repetition", comps, [S()] * 5, penalty=2.0)
    # "x x x ..." 1000 words: 998 trigrams, 1 unique
    assert got == pytest.approx([-0.5, 0.0, 0.0, 0.0, -2.0 * (1 - 1 / 998)])
    with pytest.raises(ValueError, match="ngram must be >= 1"):
        score("repetition", ["a"], [S()], ngram=0)


def test_answer_keys():
    assert answer_key("<answer>3.0</answer>", S()) == 3.0
    assert answer_key("<answer>(b)</answer>", S("B", "mcq", options=["x", "y"])) == "B"
    assert answer_key("<answer> The  Red cube. </answer>", S("", "rouge_l")) == "the red cube"
    assert answer_key("the red cube", S("", "rouge_l")) is None  # untagged text does not vote
    assert answer_key("so \\boxed{Red}", S("", "rouge_l")) == "red"
    assert answer_key("<answer>2 or 3</answer>", S()) is None
    with pytest.raises(ValueError, match="unknown key"):
        answer_key("<answer>3</answer>", S(), key="vote")


def test_majority_by_group_ids_and_by_sample():
    a, b = S("?", sid="qa"), S("?", sid="qb")
    comps = [
        "<answer>3</answer>", "<answer>3</answer>", "<answer>4</answer>", "no answer",  # group qa
        "<answer>7</answer>", "<answer>8</answer>", "<answer>8</answer>", "<answer>8.0</answer>",
    ]  # fmt: skip
    samples = [a] * 4 + [b] * 4
    expected = [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert score("majority", comps, samples) == expected  # grouped by sample id
    groups = RewardContext(group_ids=[0] * 4 + [1] * 4)
    assert score("majority", comps, samples, groups) == expected
    # the same sample drawn as two groups: group_ids keep them apart
    assert score("majority", comps, [a] * 8, groups) == expected
    # tie: the answer given first wins
    assert score("majority", ["<answer>5</answer>", "<answer>6</answer>"], [a] * 2) == [1.0, 0.0]
    # a majority below min_share of the group labels nothing
    got = score("majority", comps, samples, groups, min_share=0.6)
    assert got == [0.0] * 4 + [0.0, 1.0, 1.0, 1.0]
    # samples without ids group by object
    anon1, anon2 = {"reward": "numeric"}, {"reward": "numeric"}
    got = score("majority", ["<answer>1</answer>", "<answer>2</answer>", "<answer>2</answer>"],
                [anon1, anon2, anon2])  # fmt: skip
    assert got == [1.0, 1.0, 1.0]


def test_majority_malformed_and_in_composite():
    bad = ["", None, "<answer></answer>", "<answer>", 5]
    assert score("majority", bad, [S()] * 5) == [0.0] * 5
    comps = ["<answer>3</answer>", "<answer>3</answer>", "<answer>4</answer>", "<answer>4</answer>"]
    groups = RewardContext(group_ids=[0, 0, 1, 1])
    totals, _, _ = build_reward(["majority"])(comps, [S(sid="q")] * 4, groups)
    assert totals == [1.0, 1.0, 1.0, 1.0]
    totals, _, _ = build_reward(["majority"])(comps, [S(sid="q")] * 4)
    assert totals == [1.0, 1.0, 0.0, 0.0]


@REWARDS.register("test_shaping_half")
def half(completions, samples, ctx):
    return [0.5] * len(completions)


def test_gating():
    reward = build_reward(
        {
            "accuracy": 1.0,
            "format": {"weight": 0.5, "gate": "accuracy"},
            "test_shaping_half": {"weight": 2.0, "gate": {"accuracy": 1.0, "format": 1.0}},
        }
    )
    comps = [
        "<think>x</think><answer>3</answer>",  # correct, formatted
        "<answer>3</answer>",  # correct, unformatted
        "<think>x</think><answer>4</answer>",  # wrong, formatted
    ]
    totals, parts, stats = reward(comps, [S()] * 3)
    assert parts["accuracy"] == [1.0, 1.0, 0.0]
    assert parts["format"] == [1.0, 0.0, 0.0]  # third completion's format gated off
    assert parts["test_shaping_half"] == [0.5, 0.0, 0.0]
    assert totals == [1.0 + 0.5 + 1.0, 1.0, 0.0]
    assert stats["reward/format/gate_open"] == pytest.approx(2 / 3)
    assert stats["reward/format/ungated"] == pytest.approx(2 / 3)
    assert stats["reward/test_shaping_half/gate_open"] == pytest.approx(1 / 3)
    # a weight-0 term only gates
    reward = build_reward({"accuracy": 0.0, "format": {"gate": {"accuracy": 0.5}}})
    assert reward(comps, [S()] * 3)[0] == [1.0, 0.0, 0.0]


def test_gate_errors():
    with pytest.raises(ValueError, match="gate 'accuracy' must name another term"):
        build_reward({"format": {"gate": "accuracy"}})
    with pytest.raises(ValueError, match="gate 'format' must name another term"):
        build_reward({"format": {"gate": "format"}})
    with pytest.raises(ValueError, match="gate threshold for 'accuracy' must be a number"):
        build_reward({"accuracy": 1.0, "format": {"gate": {"accuracy": "high"}}})
    with pytest.raises(ValueError, match="gate must be a term name or a mapping"):
        build_reward({"accuracy": 1.0, "format": {"gate": 1}})


PREPARED: list[dict] = []


@REWARDS.register("test_shaping_prepared", prepare=lambda **params: PREPARED.append(params))
def prepared(completions, samples, ctx, level: int = 0):
    return [float(level)] * len(completions)


def test_prepare_runs_once_at_build_with_the_term_parameters():
    reward = build_reward({"test_shaping_prepared": {"weight": 2.0, "level": 3, "gate": "format"},
                           "format": 0.0})  # fmt: skip
    assert PREPARED == [{"level": 3}]
    reward(["<think>a</think><answer>1</answer>"] * 2, [S()] * 2)
    assert PREPARED == [{"level": 3}]  # not again per call
