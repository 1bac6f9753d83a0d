"""Built-in rewards and parsers on hand-computed cases, including malformed completions."""

from __future__ import annotations

import pytest

from perceptrl.registry import REWARDS
from perceptrl.rewards import (
    RewardContext,
    extract_answer,
    extract_letter,
    parse_box,
    parse_number,
)

OPTS = ["red", "blue", "green", "cyan"]
MALFORMED = [
    "",
    "   ",
    "<answer>",
    "</answer>",
    "<answer></answer>",
    "<think>unclosed",
    "[",
    "[,,,]",
    "<answer>[1, 2, 3]</answer>",
    "<answer>nan</answer>",
    "<answer>1e999</answer>",
    "<answer>[inf, 0, 1, 1]</answer>",
    "\x00\uffff" * 50,
    "<answer>" * 1000,
    "a" * 20000,
    None,
    42,
]


def S(answer: str, reward: str = "numeric", **meta) -> dict:
    return {
        "id": "s",
        "images": [],
        "question": "q",
        "answer": answer,
        "reward": reward,
        "family": "f",
        "meta": meta,
    }


def score(name: str, completions: list, samples: list[dict], **kw) -> list[float]:
    return REWARDS.get(name)(completions, samples, RewardContext(), **kw)


def test_extract_answer_takes_the_last_closed_tag():
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_answer("<think>x</think><answer>\nB\n</answer>") == "B"
    assert extract_answer("no tags") is None
    assert extract_answer("<answer>cut off") is None


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<think>ok</think><answer>3</answer>", 1.0),
        ("  <think>a\nb</think>\n\n<answer>x</answer>\n", 1.0),
        ("<think></think><answer></answer>", 1.0),
        ("<answer>3</answer>", 0.0),
        ("<think>ok</think>", 0.0),
        ("pre <think>ok</think><answer>3</answer>", 0.0),
        ("<think>ok</think><answer>3</answer> post", 0.0),
        ("<think>ok</think><answer>3</answer><answer>4</answer>", 0.0),
        ("<think>a<think>b</think><answer>3</answer>", 0.0),
        ("<answer>3</answer><think>ok</think>", 0.0),
    ],
)
def test_format(text, expected):
    assert score("format", [text], [S("3")]) == [expected]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<answer>B</answer>", 1.0),
        ("<answer>(B)</answer>", 1.0),
        ("<answer>B.</answer>", 1.0),
        ("<answer>B. blue</answer>", 1.0),
        ("<answer>Answer: B</answer>", 1.0),
        ("<answer>the answer is b</answer>", 1.0),
        ("<answer>blue</answer>", 1.0),
        ("The answer is (B).", 1.0),
        ("<think>A is wrong</think><answer>b</answer>", 1.0),
        ("<answer>A</answer>", 0.0),
        ("<answer>A or B</answer>", 0.0),
        ("<answer>E</answer>", 0.0),
        ("<answer>the answer is a blue one</answer>", 0.0),
        ("<answer></answer>", 0.0),
        ("no answer here", 0.0),
    ],
)
def test_mcq(text, expected):
    assert score("mcq", [text], [S("B", "mcq", options=OPTS)]) == [expected]


def test_mcq_without_options_and_letter_parsing():
    assert score(
        "mcq", ["<answer>C</answer>", "I think C", "<answer>c)</answer>"], [S("(C)", "mcq")] * 3
    ) == [1.0, 0.0, 1.0]  # "I" and "C" are both capitals
    assert extract_letter("Option D", OPTS) == "D" and extract_letter("Option E", OPTS) is None
    with pytest.raises(ValueError, match="not an option letter"):
        score("mcq", ["A"], [S("blue", "mcq")])


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<answer>3</answer>", 1.0),
        ("<answer> 3.0 </answer>", 1.0),
        ("<answer>three</answer>", 1.0),
        ("<answer>There are 3 objects.</answer>", 1.0),
        ("3", 1.0),
        ("Three", 1.0),
        ("<think>maybe 4 or 5</think><answer>3</answer>", 1.0),
        ("<answer>4</answer>", 0.0),
        ("<answer>3.5</answer>", 0.0),
        ("<answer>2 or 3</answer>", 0.0),
        ("<answer>x3</answer>", 0.0),
        ("<answer>none</answer>", 0.0),
        ("<answer></answer>", 0.0),
        ("1 2 3 4 5 6", 0.0),
    ],
)
def test_numeric(text, expected):
    assert score("numeric", [text], [S("3")]) == [expected]


def test_numeric_tolerance_from_params_and_meta():
    comps = ["<answer>10.4</answer>", "<answer>twenty</answer>", "<answer>1,000</answer>"]
    assert score("numeric", comps, [S("10"), S("20"), S("1000")]) == [0.0, 1.0, 1.0]
    assert score("numeric", comps[:1], [S("10")], abs_tol=0.5) == [1.0]
    assert score("numeric", comps[:1], [S("10")], rel_tol=0.01) == [0.0]
    assert score("numeric", comps[:1], [S("10", rel_tol=0.05)]) == [1.0]
    assert parse_number("-2.5") == -2.5 and parse_number("2 and 2") == 2.0
    with pytest.raises(ValueError, match="not a number"):
        score("numeric", ["1"], [S("many")])


def test_iou_hand_computed():
    gt = S("[0, 0, 10, 10]", "iou", image_size=[10, 10])
    cases = {
        "<answer>[0, 0, 10, 10]</answer>": 1.0,
        "<answer>[5, 5, 15, 15]</answer>": 25 / 175,
        "<answer>(0,0,5,10)</answer>": 0.5,
        '<answer>[{"bbox_2d": [0, 0, 10, 5], "label": "red circle"}]</answer>': 0.5,
        "<answer>[20, 20, 30, 30]</answer>": 0.0,
        "<answer>[5, 5, 5, 9]</answer>": 0.0,  # degenerate
        "<answer>[10, 10, 0, 0]</answer>": 0.0,  # corners swapped
        "<answer>[]</answer>": 0.0,
        "<answer>the red circle</answer>": 0.0,
    }
    got = score("iou", list(cases), [gt] * len(cases))
    assert got == pytest.approx(list(cases.values()))


def test_iou_maps_model_coordinates_back():
    # original 100x50 image resized by the processor to 200x200: x scales by 1/2, y by 1/4
    s = S("[10, 10, 30, 30]", "iou", image_size=[100, 50], model_image_size=[200, 200])
    assert score("iou", ["<answer>[20, 40, 60, 120]</answer>"], [s]) == [1.0]
    # [20, 20, 60, 60] maps to [10, 5, 30, 15]: inter 20*5, union 20*10 + 20*20 - 100
    assert score("iou", ["<answer>[20, 20, 60, 60]</answer>"], [s]) == [pytest.approx(0.2)]
    # without model_image_size the box is taken as original pixels: inter 10*10, union 1900
    plain = S("[10, 10, 30, 30]", "iou", image_size=[100, 50])
    assert score("iou", ["<answer>[20, 20, 60, 60]</answer>"], [plain]) == [pytest.approx(1 / 19)]
    assert parse_box("[1.5, 2, 3, 4.25]") == [1.5, 2.0, 3.0, 4.25]


def test_accuracy_dispatches_per_sample():
    samples = [S("3"), S("B", "mcq", options=OPTS), S("[0, 0, 10, 10]", "iou"), S("4")]
    comps = [
        "<answer>3</answer>",
        "<answer>B</answer>",
        "<answer>[0, 0, 5, 10]</answer>",
        "<answer>5</answer>",
    ]
    assert score("accuracy", comps, samples) == pytest.approx([1.0, 1.0, 0.5, 0.0])
    assert score("accuracy", comps[3:], samples[3:], numeric={"abs_tol": 1}) == [1.0]
    with pytest.raises(ValueError, match="must name an accuracy reward"):
        score("accuracy", ["3"], [S("3", "accuracy")])
    with pytest.raises(ValueError, match="unknown reward 'nmeric'.*did you mean 'numeric'"):
        score("accuracy", ["3"], [S("3", "nmeric")])


@pytest.mark.parametrize(
    "name,gt",
    [
        ("format", S("3")),
        ("mcq", S("B", "mcq", options=OPTS)),
        ("numeric", S("3")),
        ("iou", S("[0, 0, 4, 4]", "iou")),
        ("accuracy", S("3")),
    ],
)
def test_malformed_completions_score_zero_and_never_raise(name, gt):
    assert score(name, MALFORMED, [gt] * len(MALFORMED)) == [0.0] * len(MALFORMED)


def test_length_mismatch_raises():
    with pytest.raises(ValueError, match="2 completions for 1 samples"):
        score("numeric", ["1", "2"], [S("1")])


def test_registry_lookup_and_registration():
    assert {"format", "mcq", "numeric", "iou", "accuracy"} <= set(REWARDS.names())
    with pytest.raises(ValueError, match="unknown reward 'fromat'.*did you mean 'format'.*valid:"):
        REWARDS.resolve("fromat")
    iou = REWARDS.resolve("perceptrl.rewards.builtin:iou")
    assert iou.obj is REWARDS.get("iou") and iou.meta == REWARDS.meta("iou")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        REWARDS.resolve("no_such_mod:f")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        REWARDS.resolve("perceptrl.rewards.builtin:nope")

    @REWARDS.register("test_builtin_dummy")
    def dummy(completions, samples, ctx):
        return [0.5] * len(completions)

    assert REWARDS.get("test_builtin_dummy") is dummy
    assert REWARDS.meta("test_builtin_dummy")["self_timed"] is False  # the kind's defaults
    with pytest.raises(ValueError, match="already registered"):
        REWARDS.register("format", dummy)
    with pytest.raises(ValueError, match="declares timeout"):
        REWARDS.register("test_builtin_typo", dummy, timeout=True)
