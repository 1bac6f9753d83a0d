"""giou and det (Visual-RFT terms, COCO mAP) on hand-computed cases; format's boxed style."""

from __future__ import annotations

import pytest

from perceptrl.registry import REWARDS
from perceptrl.rewards import RewardContext
from perceptrl.rewards.boxes import Detection, coco_map, parse_detections, rft_terms
from perceptrl.rewards.parse import answer_or_text, extract_boxed, extract_letter

MALFORMED = [
    "",
    "<answer></answer>",
    "<answer>[]</answer>",
    "<answer>[1, 2, 3]</answer>",
    '<answer>[{"bbox_2d": [1, 2]}]</answer>',
    '<answer>[{"bbox_2d": [0, 0, nan, 1]}]</answer>',
    "<answer>the cat</answer>",
    "<answer>" * 300,
    "{" * 5000,
    None,
    3.5,
]


def S(answer, reward: str = "det", **meta) -> dict:
    return {
        "id": "s",
        "images": [],
        "question": "q",
        "answer": answer,
        "reward": reward,
        "meta": meta,
    }


def score(name: str, completions: list, samples: list[dict], **kw) -> list[float]:
    return REWARDS.get(name)(completions, samples, RewardContext(), **kw)


def test_giou_hand_computed():
    gt = S("[0, 0, 10, 10]", "giou")
    # [5,5,15,15]: IoU 25/175, hull 15x15=225, union 175 -> GIoU = 1/7 - 50/225
    g1 = 25 / 175 - 50 / 225
    # [20,0,30,10]: IoU 0, hull 30x10=300, union 200 -> GIoU = -1/3
    cases = {
        "<answer>[0, 0, 10, 10]</answer>": (1.0, 1.0),
        "<answer>[5, 5, 15, 15]</answer>": ((1 + g1) / 2, g1),
        "<answer>[20, 0, 30, 10]</answer>": ((1 - 1 / 3) / 2, -1 / 3),
        "<answer>[5, 5, 5, 9]</answer>": (0.0, 0.0),  # degenerate
        "<answer>[]</answer>": (0.0, 0.0),
    }
    comps = list(cases)
    assert score("giou", comps, [gt] * 5) == pytest.approx([v[0] for v in cases.values()])
    assert score("giou", comps, [gt] * 5, rescale=False) == pytest.approx(
        [v[1] for v in cases.values()]
    )
    with pytest.raises(ValueError, match="is not a box"):
        score("giou", ["[0, 0, 1, 1]"], [S("[1, 1, 0, 0]", "giou")])


def test_parse_detections_formats():
    d = parse_detections('[{"bbox_2d": [0, 0, 10, 10], "label": "Cat", "confidence": 0.9}]')
    assert d == [Detection((0.0, 0.0, 10.0, 10.0), 0.9, "cat")]
    d = parse_detections("[{'Position': [1, 2, 3, 4], 'Confidence': 1.7}]")  # Visual-RFT keys
    assert d == [Detection((1.0, 2.0, 3.0, 4.0), 1.0, None)]  # confidence clipped to 1
    truncated = '[{"bbox_2d": [0, 0, 1, 1], "score": 0.5}, {"bbox_2d": [2, 2'
    assert parse_detections(truncated) == [Detection((0.0, 0.0, 1.0, 1.0), 0.5)]
    assert parse_detections("[[0, 0, 1, 1], [2, 2, 3, 3]]") == [
        Detection((0.0, 0.0, 1.0, 1.0)),
        Detection((2.0, 2.0, 3.0, 3.0)),
    ]
    assert parse_detections("```json\n[[0, 0, 1, 1]]\n```") == [Detection((0.0, 0.0, 1.0, 1.0))]
    assert parse_detections("[0, 0, 1, 1]") == [Detection((0.0, 0.0, 1.0, 1.0))]
    assert parse_detections("[]") == []
    for bad in ("none", "[1, 2]", '[{"label": "cat"}]', "", None, 7):
        assert parse_detections(bad) is None


GT2 = [Detection((0, 0, 10, 10)), Detection((20, 20, 30, 30))]


def test_rft_terms_hand_computed():
    # one exact hit at conf 0.9, one miss at conf 0.2; one ground truth box not found
    preds = [Detection((0, 0, 10, 10), 0.9), Detection((50, 50, 60, 60), 0.2)]
    iou_t, conf_t = rft_terms(preds, GT2)
    assert iou_t == pytest.approx(1.0 / 2) and conf_t == pytest.approx((0.9 + 0.8) / 2)
    # IoU 0.5 exactly is not a match (> 0.5 needed): [0,0,10,5] vs [0,0,10,10]
    assert rft_terms([Detection((0, 0, 10, 5), 0.6)], GT2) == pytest.approx((0.0, 0.4))
    # [0,0,10,6]: IoU 0.6 matched; more predictions than ground truths divides by predictions
    preds = [
        Detection((0, 0, 10, 6), 1.0),
        Detection((20, 20, 30, 30), 1.0),
        Detection((0, 0, 1, 1), 0.0),
    ]
    assert rft_terms(preds, GT2) == pytest.approx(((0.6 + 1.0) / 3, 1.0))
    # greedy by confidence: the confident box takes the ground truth first
    preds = [Detection((0, 0, 10, 9), 0.5), Detection((0, 0, 10, 6), 0.9)]
    assert rft_terms(preds, GT2[:1]) == pytest.approx((0.6 / 2, (0.9 + 0.5) / 2))
    # duplicates are removed before matching
    assert rft_terms([Detection((0, 0, 10, 10))] * 3, GT2[:1]) == pytest.approx((1.0, 1.0))
    assert rft_terms([], []) == (1.0, 1.0) and rft_terms([], GT2) == (0.0, 0.0)


def test_det_reward_rft_and_labels():
    gt = S('[{"bbox_2d": [0, 0, 10, 10]}, {"bbox_2d": [20, 20, 30, 30]}]')
    comp = '<answer>[{"bbox_2d": [0, 0, 10, 10], "confidence": 0.9}, [50, 50, 60, 60]]</answer>'
    # second box has confidence 1 and misses: conf term (0.9 + 0) / 2; IoU term 1 / 2
    assert score("det", [comp], [gt]) == pytest.approx([0.5 + 0.45])
    assert score("det", [comp], [gt], conf_weight=0.0) == pytest.approx([0.5])
    labelled = S('[{"bbox_2d": [0, 0, 10, 10], "label": "cat"}]')
    right = '<answer>[{"bbox_2d": [0, 0, 10, 10], "label": "CAT"}]</answer>'
    wrong = '<answer>[{"bbox_2d": [0, 0, 10, 10], "label": "dog"}]</answer>'
    assert score("det", [right, wrong], [labelled] * 2) == pytest.approx([2.0, 0.0])
    # unlabelled ground truth: predicted labels are ignored
    assert score("det", [wrong], [S("[[0, 0, 10, 10]]")]) == pytest.approx([2.0])
    # model coordinates map back to the image (x / 2)
    scaled = S("[[0, 0, 10, 10]]", image_size=[50, 50], model_image_size=[100, 50])
    assert score("det", ["<answer>[[0, 0, 20, 10]]</answer>"], [scaled]) == [2.0]
    assert score("det", ["<answer>[]</answer>"], [S("[]")]) == [2.0]
    with pytest.raises(ValueError, match="det needs answer as a list of boxes"):
        score("det", ["[]"], [S("a cat")])
    with pytest.raises(ValueError, match="unknown metric"):
        score("det", ["[]"], [gt], metric="ap")


def test_coco_map_hand_computed():
    # 101-point interpolated AP: recall 0.5 reached at precision 1 -> 51/101
    assert coco_map([Detection((0, 0, 10, 10), 0.9)], GT2) == pytest.approx(51 / 101)
    # a more confident false positive halves the precision at that recall
    preds = [Detection((0, 0, 10, 10), 0.9), Detection((50, 50, 60, 60), 0.95)]
    assert coco_map(preds, GT2) == pytest.approx(0.5 * 51 / 101)
    assert coco_map(GT2, GT2) == pytest.approx(1.0)
    # IoU 0.6 counts at thresholds 0.50..0.60 only: mAP 3/10, AP50 1
    assert coco_map([Detection((0, 0, 10, 6))], GT2[:1]) == pytest.approx(0.3)
    assert coco_map([Detection((0, 0, 10, 6))], GT2[:1], iou="50") == pytest.approx(1.0)
    gt = S("[[0, 0, 10, 10], [20, 20, 30, 30]]")
    comps = ["<answer>[[0, 0, 10, 10], [20, 20, 30, 30]]</answer>", "<answer>[]</answer>"]
    assert score("det", comps, [gt] * 2, metric="map") == pytest.approx([1.0, 0.0])


@pytest.mark.parametrize(
    "name,answer,kw",
    [
        ("giou", "[0, 0, 4, 4]", {}),
        ("det", "[[0, 0, 4, 4]]", {}),
        ("det", "[[0, 0, 4, 4]]", {"metric": "map"}),
    ],
)
def test_malformed_completions_score_zero(name, answer, kw):
    assert score(name, MALFORMED, [S(answer, name)] * len(MALFORMED), **kw) == [0.0] * len(
        MALFORMED
    )


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<think>ok</think> so \\boxed{3}", 1.0),
        ("<think>ok</think>\nThe answer is $\\boxed{\\frac{1}{2}}$.", 1.0),
        ("<think>ok</think> \\boxed{}", 0.0),  # empty box
        ("<think>ok</think> \\boxed{3", 0.0),  # unclosed
        ("<think>ok</think> 3", 0.0),
        ("\\boxed{3}", 0.0),  # no reasoning
        ("pre <think>ok</think> \\boxed{3}", 0.0),
        ("<think>ok</think><answer>\\boxed{3}</answer>", 0.0),  # tags are the other style
    ],
)
def test_format_boxed_style(text, expected):
    assert score("format", [text], [S("3")], style="boxed") == [expected]
    with pytest.raises(ValueError, match="unknown style"):
        score("format", [text], [S("3")], style="latex")


def test_boxed_answers_are_read_by_answer_rewards():
    assert extract_boxed("a \\boxed{1} then \\boxed{\\frac{2}{3}} end") == "\\frac{2}{3}"
    assert extract_boxed("\\boxed{2} and \\boxed{unclosed") == "2"
    assert answer_or_text("<think>maybe 4</think> so \\boxed{3}") == "3"
    assert answer_or_text("<answer>5</answer> \\boxed{3}") == "5"  # the tag wins
    assert extract_letter(answer_or_text("<think>A is tempting</think> \\boxed{B}")) == "B"
    samples = [S("3", "numeric"), S("B", "mcq", options=["x", "y", "z"])]
    comps = ["<think>2 or 4?</think> \\boxed{3}", "<think>A? C?</think> \\boxed{(B)}"]
    assert score("accuracy", comps, samples) == [1.0, 1.0]
