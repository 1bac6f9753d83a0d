"""The whole catalogue: every issue-listed reward is registered, listed by `perceptrl config`,
and scores malformed completions 0 without raising (penalties: 0 as well, nothing to punish)."""

from __future__ import annotations

import pytest

from perceptrl.cli import main
from perceptrl.registry import REWARDS
from perceptrl.rewards import build_reward

CATALOGUE = [
    "format", "mcq", "numeric", "math", "count", "iou", "giou", "det", "ocr", "rouge_l", "tiou",
    "mra", "overlong", "repetition", "judge", "majority", "accuracy",
]  # fmt: skip

MALFORMED = [
    "",
    " \n ",
    "<answer></answer>",
    "<think>cut off",
    "</answer><answer>",
    "<answer>[</answer>",
    "\\boxed{",
    "\x00\uffff" * 40,
    None,
    1.5,
]

GROUND_TRUTH = {
    "format": ("3", {}),
    "mcq": ("B", {"options": ["a", "b", "c"]}),
    "numeric": ("3", {}),
    "math": ("\\frac{1}{2}", {}),
    "count": ("3", {}),
    "iou": ("[0, 0, 4, 4]", {}),
    "giou": ("[0, 0, 4, 4]", {}),
    "det": ("[[0, 0, 4, 4]]", {}),
    "ocr": ("hello world", {}),
    "rouge_l": ("hello world", {}),
    "tiou": ("[1, 3]", {}),
    "mra": ("4", {}),
    "repetition": ("", {}),
    "majority": ("", {}),
}


def test_every_catalogue_reward_is_registered_and_listed(capsys):
    assert set(CATALOGUE) <= set(REWARDS.names())
    assert main(["config"]) == 0
    listed = capsys.readouterr().out.splitlines()[-1]
    assert listed.startswith("# rewards for rollout.reward:")
    assert all(name in listed for name in CATALOGUE)


@pytest.mark.parametrize("name", sorted(GROUND_TRUTH))
def test_malformed_completions_score_zero_without_errors(name):
    answer, meta = GROUND_TRUTH[name]
    reward_name = name if name not in ("format", "repetition", "majority") else "numeric"
    sample = {"id": "m", "images": [], "question": "q", "answer": answer,
              "reward": reward_name, "meta": meta}  # fmt: skip
    totals, parts, stats = build_reward([name])(MALFORMED, [sample] * len(MALFORMED))
    assert parts[name] == [0.0] * len(MALFORMED)
    assert stats["reward/errors"] == 0 and stats["reward/timeouts"] == 0


@pytest.mark.parametrize(
    "text,expected",
    [
        ("**Answer:** B", 1.0),
        ("The correct option is (B) blue", 1.0),
        ("<answer>B: blue</answer>", 1.0),
        ("<answer>[B]</answer>", 1.0),
        ('<answer>"B"</answer>', 1.0),
        ("Final Answer: b", 1.0),
        ("The answer is B, not A", 1.0),
        ("<think>A and C are wrong</think> \\boxed{B}", 1.0),
        ("The final answer is $\\boxed{\\text{B}}$", 1.0),
        ("<answer>blue.</answer>", 1.0),
        ("<answer>A or B</answer>", 0.0),  # hedging earns nothing
        ("Between A and B, I pick B.", 0.0),  # no cue: ambiguous
        ("<answer>\\boxed{}</answer>", 0.0),
        ("<answer>D</answer>", 0.0),  # not an option
    ],
)
def test_mcq_letter_extraction_is_robust(text, expected):
    sample = {"id": "m", "answer": "B", "reward": "mcq", "meta": {"options": ["red", "blue", "c"]}}
    assert build_reward(["mcq"])([text], [sample])[0] == [expected]
