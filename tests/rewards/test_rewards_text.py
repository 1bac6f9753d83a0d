"""math (math-verify), ocr (1 - WER) and rouge_l on hand-computed cases and malformed input."""

from __future__ import annotations

import pytest

from perceptrl.registry import REWARDS
from perceptrl.rewards import RewardContext, build_reward

MALFORMED = [
    "",
    "   ",
    "<answer></answer>",
    "<answer>   </answer>",
    "<think>unclosed",
    "\x00\uffff" * 50,
    "<answer>" * 300,
    None,
    42,
]


def S(answer, reward: str = "math") -> dict:
    return {
        "id": "s",
        "images": [],
        "question": "q",
        "answer": answer,
        "reward": reward,
        "meta": {},
    }


def score(name: str, completions: list, samples: list[dict], **kw) -> list[float]:
    return REWARDS.get(name)(completions, samples, RewardContext(), **kw)


@pytest.mark.parametrize(
    "answer,text,expected",
    [
        ("1/2", "<answer>\\frac{1}{2}</answer>", 1.0),
        ("\\frac{1}{2}", "<answer>0.5</answer>", 1.0),
        ("0.5", "<think>half</think> so \\boxed{\\frac12}", 1.0),
        ("x+1", "<answer>1+x</answer>", 1.0),
        ("\\sqrt{2}/2", "<answer>$\\frac{1}{\\sqrt{2}}$</answer>", 1.0),
        ("10\\%", "<answer>0.1</answer>", 1.0),
        ("3", "The final answer is 3.", 1.0),
        ("3", "<think>maybe 4</think><answer>3</answer>", 1.0),
        ("3", "<answer>4</answer>", 0.0),
        ("x+1", "<answer>x+2</answer>", 0.0),
        ("1/2", "<answer>\\frac{1}{3}</answer>", 0.0),
        ("3", "<answer>three apples</answer>", 0.0),
    ],
)
def test_math_equivalence(answer, text, expected):
    assert score("math", [text], [S(answer)]) == [expected]


def test_math_bad_ground_truth_raises():
    with pytest.raises(ValueError, match="math-verify cannot parse answer"):
        score("math", ["<answer>1</answer>"], [S("")])


def test_ocr_hand_computed():
    gt = S("the cat sat on the mat", "ocr")
    cases = {
        "<answer>the cat sat on the mat</answer>": 1.0,
        # sat -> sit (1 substitution), "the" before mat deleted: WER 2/6
        "<answer>the cat sit on mat</answer>": 1 - 2 / 6,
        "<answer>  the  cat sat\non the mat </answer>": 1.0,  # whitespace does not count
        "<answer>The cat sat on the mat.</answer>": 1 - 2 / 6,  # case and punctuation count
        "<answer>dog</answer>": 0.0,  # 5 deletions + 1 substitution = 6/6
        "<answer>a b c d e f g h i j k l</answer>": 0.0,  # WER > 1 clipped to 0
    }
    assert score("ocr", list(cases), [gt] * len(cases)) == pytest.approx(list(cases.values()))
    assert score(
        "ocr",
        ["<answer>The cat sat on the mat.</answer>"],
        [gt],
        ignore_case=True,
        ignore_punct=True,
    ) == [1.0]
    assert score("ocr", ["<answer></answer>", "x"], [S("", "ocr")] * 2) == [1.0, 0.0]


def test_rouge_l_hand_computed():
    gt = S("the cat sat on the mat", "rouge_l")
    # LCS "the cat on mat" (stemming: sitting -> sit, sat stays): P 4/7, R 4/6
    p, r = 4 / 7, 4 / 6
    comp = ["<answer>the cat was sitting on a mat</answer>"]
    assert score("rouge_l", comp, [gt]) == pytest.approx([2 * p * r / (p + r)])
    assert score("rouge_l", comp, [gt], measure="recall") == pytest.approx([r])
    assert score("rouge_l", ["<answer>The Cat sat on the mat!</answer>"], [gt]) == [1.0]
    assert score("rouge_l", ["<answer>dogs bark</answer>"], [gt]) == [0.0]
    with pytest.raises(ValueError, match="unknown measure"):
        score("rouge_l", comp, [gt], measure="f1")


@pytest.mark.parametrize("name,answer", [("math", "3"), ("ocr", "hello world"), ("rouge_l", "hi")])
def test_malformed_completions_score_zero(name, answer):
    assert score(name, MALFORMED, [S(answer, name)] * len(MALFORMED)) == [0.0] * len(MALFORMED)


def test_math_inside_composite_with_timeout():
    """math-verify runs under the composite's alarm timer without disturbing it."""
    totals, _, stats = build_reward({"math": 1.0}, timeout_s=5.0)(
        ["<answer>\\frac{2}{4}</answer>", "<answer>2</answer>"], [S("1/2"), S("1/2")]
    )
    assert totals == [1.0, 0.0] and stats["reward/errors"] == 0 and stats["reward/timeouts"] == 0
