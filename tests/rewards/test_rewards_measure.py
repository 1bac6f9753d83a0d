"""mra, tiou and count on hand-computed cases, including malformed completions."""

from __future__ import annotations

import pytest

from perceptrl.registry import REWARDS
from perceptrl.rewards import RewardContext, build_reward
from perceptrl.rewards.measure import mra_score, parse_span, span_iou

MALFORMED = [
    "",
    "<answer></answer>",
    "<answer>about ten</answer>x",
    "<answer>1, 2 or 3</answer>",
    "<answer>nan</answer>",
    "<answer>[</answer>",
    "<think>unclosed",
    "\x00" * 30,
    None,
    17,
]


def S(answer, reward: str = "mra", **meta) -> dict:
    return {
        "id": "s",
        "images": [],
        "question": "q",
        "answer": answer,
        "reward": reward,
        "meta": meta,
    }


def score(name: str, completions: list, samples: list[dict]) -> list[float]:
    return REWARDS.get(name)(completions, samples, RewardContext())


@pytest.mark.parametrize(
    "pred,gt,expected",
    [
        (10.0, 10.0, 1.0),  # exact: all 10 thresholds
        (10.4, 10.0, 1.0),  # rel 0.04 <= 0.05
        (10.6, 10.0, 0.9),  # rel 0.06: fails only theta=0.95 (needs <= 0.05)
        (9.4, 10.0, 0.9),
        (11.0, 10.0, 0.9),  # rel 0.10 <= 0.10 (theta=0.90): boundary counts (<=)
        (12.0, 10.0, 0.7),  # rel 0.20: theta 0.50..0.80 -> 7 of 10
        (13.0, 10.0, 0.5),  # rel 0.30: theta 0.50..0.70 -> 5
        (15.0, 10.0, 0.1),  # rel 0.50: only theta=0.50
        (15.1, 10.0, 0.0),
        (5.0, 10.0, 0.1),
        (0.0, 10.0, 0.0),
        (3.3, 3.0, 0.9),  # rel 0.1
    ],
)
def test_mra_score_hand_computed(pred, gt, expected):
    assert mra_score(pred, gt) == pytest.approx(expected)


def test_mra_reward_parses_answers():
    comps = [
        "<think>x</think><answer>2.2</answer>",
        "<answer>The table is 1.9 meters long.</answer>",
        "2.5",
        "<answer>two</answer>",
        "<answer>1.5 or 2</answer>",
    ]
    got = score("mra", comps, [S("2.0")] * len(comps))
    # rel 0.1 -> 0.9; rel 0.05 -> 1.0; rel 0.25 -> theta 0.50..0.75 = 6; "two" = 2 -> 1; hedge -> 0
    assert got == pytest.approx([0.9, 1.0, 0.6, 1.0, 0.0])
    with pytest.raises(ValueError, match="non-zero number"):
        score("mra", ["1"], [S("0")])
    with pytest.raises(ValueError, match="non-zero number"):
        score("mra", ["1"], [S("big")])


@pytest.mark.parametrize(
    "text,span",
    [
        ("[12.5, 20]", (12.5, 20.0)),
        ("12.5 - 20.0 seconds", (12.5, 20.0)),
        ("12.5-20.0", (12.5, 20.0)),
        ("from 3 to 7.5 s", (3.0, 7.5)),
        ("00:12 - 01:05", (12.0, 65.0)),
        ("1:00:00 to 1:00:30", (3600.0, 3630.0)),
        ([1, 2], (1.0, 2.0)),
        ("[5, 3]", None),  # reversed
        ("[-1, 3]", None),  # negative
        ("[1, 2, 3]", None),
        ("00:75 - 01:00", None),  # 75 seconds is not a clock field
        ("the whole video", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_span(text, span):
    assert parse_span(text) == span


def test_tiou_hand_computed():
    gt = S("[10, 20]", "tiou")
    cases = {
        "<answer>[10, 20]</answer>": 1.0,
        "<answer>[15, 25]</answer>": 5 / 15,  # overlap 15..20, union 10..25
        "<answer>from 12 to 18 seconds</answer>": 6 / 10,
        "<answer>0:05 - 0:15</answer>": 5 / 15,
        "<answer>[20, 30]</answer>": 0.0,  # touching, no overlap
        "<answer>[0, 40]</answer>": 10 / 40,
        "<answer>[12, 12]</answer>": 0.0,  # a point inside: no length
        "<answer>[30, 25]</answer>": 0.0,
    }
    assert score("tiou", list(cases), [gt] * len(cases)) == pytest.approx(list(cases.values()))
    assert score("tiou", ["[1, 2]"], [S([1.0, 2.0], "tiou")]) == [1.0]
    assert span_iou((3.0, 3.0), (3.0, 3.0)) == 1.0
    with pytest.raises(ValueError, match=r"tiou needs answer '\[start, end\]'"):
        score("tiou", ["[1, 2]"], [S("soon", "tiou")])


def test_count_hand_computed():
    comps = [
        "<answer>3</answer>",
        "<answer>three</answer>",
        "<answer>3.0</answer>",
        "<answer>3.5</answer>",
        "<answer>-3</answer>",
        "<answer>4</answer>",
    ]
    assert score("count", comps, [S("3", "count")] * 6) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="is not a count"):
        score("count", ["1"], [S("2.5", "count")])


@pytest.mark.parametrize("name,answer", [("mra", "4"), ("tiou", "[1, 3]"), ("count", "4")])
def test_malformed_completions_score_zero(name, answer):
    assert score(name, MALFORMED, [S(answer, name)] * len(MALFORMED)) == [0.0] * len(MALFORMED)


def test_accuracy_dispatches_to_mra_and_tiou():
    samples = [S("10", "mra"), S("[0, 10]", "tiou"), S("2", "count")]
    comps = ["<answer>12</answer>", "<answer>[5, 10]</answer>", "<answer>2</answer>"]
    totals, _, stats = build_reward(["accuracy"])(comps, samples)
    assert totals == pytest.approx([0.7, 0.5, 1.0]) and stats["reward/errors"] == 0
