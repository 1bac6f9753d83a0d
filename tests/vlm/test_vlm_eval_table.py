"""Per-modality evaluation report: rows, weighted means, Markdown, bar chart, and
`perceptrl eval` over two task sets (image + 3D) with the shipped tiny model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import cv2
import pytest

from perceptrl.vlm import report

METRICS_IMG = {"accuracy/count_all": 0.5, "count/count_all": 4.0, "accuracy/spatial": 1.0,
               "count/spatial": 2.0, "accuracy": 2 / 3, "count": 6.0}  # fmt: skip
SAMPLES_IMG = [
    {"family": "count_all", "images": ["a.png"]},
    {"family": "spatial", "images": ["b.png"]},
]
SAMPLES_3D = [{"family": "rel_direction", "images": ["a.png", "b.png"], "meta": {"modality": "3d"}},
              {"family": "spatial", "images": ["c.png"], "meta": {"modality": "3d"}}]  # fmt: skip
METRICS_3D = {"accuracy/rel_direction": 0.25, "count/rel_direction": 4.0,
              "accuracy/spatial": 0.0, "count/spatial": 4.0}  # fmt: skip


def test_modality_of_a_sample():
    assert report.modality({"images": ["a.png"]}) == "image"
    assert report.modality({"videos": ["a.mp4"], "images": []}) == "video"
    assert report.modality({"images": ["a.png"], "meta": {"modality": "3d"}}) == "3d"


def test_rows_merge_and_weighted_means():
    rows = report.family_rows(METRICS_IMG, SAMPLES_IMG) + report.family_rows(METRICS_3D, SAMPLES_3D)
    # the same family name in two modalities stays two rows
    assert {(r["modality"], r["family"]) for r in rows} >= {("image", "spatial"), ("3d", "spatial")}
    again = report.family_rows({"accuracy/count_all": 1.0, "count/count_all": 4.0}, SAMPLES_IMG)
    merged = report.merge(rows + again)
    assert [r["modality"] for r in merged] == ["image", "image", "3d", "3d"]
    count_all = next(r for r in merged if r["family"] == "count_all")
    assert count_all == {
        "modality": "image",
        "family": "count_all",
        "questions": 8,
        "accuracy": 0.75,
    }
    s = report.summarize(merged)
    assert s["modalities"]["image"] == {"questions": 10, "accuracy": pytest.approx(0.8)}
    assert s["modalities"]["3d"] == {"questions": 8, "accuracy": pytest.approx(0.125)}
    assert s["overall"]["accuracy"] == pytest.approx((8 + 1) / 18)
    md = report.markdown(merged)
    assert "| image | count_all | 8 | 0.750 |" in md and "| 3d | all | 8 | 0.125 |" in md
    assert md.splitlines()[-1] == "| all | all | 18 | 0.500 |"


def test_question_groups_add_their_columns_and_metrics(tmp_path):
    """A family whose samples form question groups (MMBench's circular copies, MME's image
    pairs) carries its groups and the share wholly right; merged rows weigh them by groups;
    a family without groups shows "-" in those columns."""
    grouped = {"accuracy/colour": 0.75, "count/colour": 8.0, "group_accuracy/colour": 0.5,
               "groups/colour": 4.0, "accuracy/shape": 1.0, "count/shape": 2.0}  # fmt: skip
    samples = [{"family": "colour", "images": ["a.png"]}, {"family": "shape", "images": ["b"]}]
    rows = report.family_rows(grouped, samples)
    colour = next(r for r in rows if r["family"] == "colour")
    assert (colour["groups"], colour["group_accuracy"]) == (4, 0.5)
    assert "groups" not in next(r for r in rows if r["family"] == "shape")
    again = report.family_rows(
        {"accuracy/colour": 0.0, "count/colour": 4.0, "group_accuracy/colour": 0.0,
         "groups/colour": 2.0}, samples,
    )  # fmt: skip
    merged = report.merge(rows + again)
    colour = next(r for r in merged if r["family"] == "colour")
    assert colour["group_accuracy"] == pytest.approx(2 / 6) and colour["groups"] == 6
    assert colour["accuracy"] == pytest.approx(6 / 12)
    md = report.markdown(merged).splitlines()
    assert md[0] == "| modality | family | questions | accuracy | groups | all of group right |"
    assert "| image | colour | 12 | 0.500 | 6 | 0.333 |" in md
    assert "| image | shape | 2 | 1.000 | - | - |" in md
    assert md[-1] == "| all | all | 14 | 0.571 | 6 | 0.333 |"
    out = report.write_report(merged, tmp_path / "r", model="m")
    metrics = json.loads((tmp_path / "r" / "eval.json").read_text())["metrics"]
    assert metrics["group_accuracy"] == pytest.approx(2 / 6) and metrics["groups"] == 6
    assert metrics["groups/image/colour"] == 6 and "groups/image/shape" not in metrics
    assert out["table"].startswith("| modality | family | questions | accuracy | groups |")


def test_group_accuracy_counts_a_group_right_only_when_all_of_it_is():
    from perceptrl.vlm.source import _Tally

    tally = _Tally(None, None)
    scores = {("colour", "7"): [1.0, 1.0], ("colour", "8"): [1.0, 0.0], ("shape", "9"): [0.5]}
    for (family, group), vs in scores.items():
        tally.by_family[family] += vs
        tally.by_group[family, group] += vs
    m = tally.metrics()
    assert m["group_accuracy/colour"] == 0.5 and m["groups/colour"] == 2
    assert m["group_accuracy/shape"] == 1.0 and m["groups"] == 3
    assert m["group_accuracy"] == pytest.approx(2 / 3) and m["accuracy"] == pytest.approx(0.7)
    # no group of two or more: no group metrics (every sample its own group)
    alone = _Tally(None, None)
    alone.by_family["colour"] += [1.0, 0.0]
    alone.by_group["colour", "1"] += [1.0]
    alone.by_group["colour", "2"] += [0.0]
    assert not any(k.startswith("group") for k in alone.metrics())


def test_a_family_with_two_modalities_is_an_error():
    mixed = [{"family": "f", "images": ["a.png"]}, {"family": "f", "videos": ["v.mp4"]}]
    with pytest.raises(ValueError, match="mixes modalities"):
        report.family_rows({"accuracy/f": 1.0, "count/f": 2.0}, mixed)


def test_write_report_files(tmp_path):
    rows = report.family_rows(METRICS_IMG, SAMPLES_IMG) + report.family_rows(METRICS_3D, SAMPLES_3D)
    out = report.write_report(rows, tmp_path / "r", model="m")
    record = json.loads((tmp_path / "r" / "eval.json").read_text())
    assert record["metrics"]["count"] == 14 and record["modalities"]["3d"]["questions"] == 8
    assert record["metrics"]["accuracy/3d/rel_direction"] == 0.25
    assert (tmp_path / "r" / "eval.md").read_text().strip() == out["table"]
    png = cv2.imread(str(tmp_path / "r" / "eval.png"))
    assert png is not None and png.shape[0] > 200 and png.std() > 10


def test_cli_eval_two_task_sets_gives_a_per_modality_table(tmp_path):
    """`perceptrl eval vlm_clevr vlm_spatial --model <tiny base>`: image and 3D rows, files."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    from perceptrl.cli import main

    base = Path(__file__).resolve().parents[2] / "assets" / "vlm_base"
    out = tmp_path / "ev"
    rc = main(["eval", "vlm_clevr", "vlm_spatial", "--model", str(base), "--out", str(out),
               "data.n_val=6", "train.eval_samples=6", "rollout.max_new_tokens=24"])  # fmt: skip
    assert rc == 0
    record = json.loads((out / "eval.json").read_text())
    assert {r["modality"] for r in record["rows"]} == {"image", "3d"}
    assert (
        record["modalities"]["3d"]["questions"] == 6 == record["modalities"]["image"]["questions"]
    )
    assert len(record["task_sets"]) == 2 and record["metrics"]["count"] == 12
    md = (out / "eval.md").read_text()
    assert "| 3d | obj_count | 1 |" in md and "| image | all | 6 |" in md
    assert cv2.imread(str(out / "eval.png")) is not None


def test_paired_gain_on_a_hand_computed_case():
    """Differences [0, 1, 1, -1]: gain 0.25, sample variance 11/12, SE sqrt(11/48); ids scored
    by one model only do not count."""
    before = {"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0, "only_before": 0.0}
    after = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "only_after": 1.0}
    g = report.paired_gain(before, after)
    assert g["questions"] == 4 and g["before"] == 0.5 and g["after"] == 0.75
    assert g["gain"] == pytest.approx(0.25)
    assert g["se"] == pytest.approx((11 / 48) ** 0.5)
    assert g["z"] == pytest.approx(0.25 / (11 / 48) ** 0.5)
    assert (g["improved"], g["regressed"]) == (2, 1)
    same = report.paired_gain(before, before)
    assert (same["gain"], same["se"], same["z"]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="2 or more shared questions"):
        report.paired_gain({"a": 1.0}, {"a": 0.0, "b": 1.0})


def test_held_out_gain_scores_both_models_on_the_same_fresh_questions(tmp_path):
    """The two shipped bases on 12 fresh counting questions: each side equals that model's own
    evaluation on the same questions and the gain is their difference."""
    from perceptrl.cli import CONFIGS
    from perceptrl.datasets.loader import load_samples
    from perceptrl.rewards import build_reward
    from perceptrl.vlm.builder import build_policy, held_out_gain
    from perceptrl.vlm.run_plan import resolve
    from perceptrl.vlm.source import evaluate_accuracy
    from perceptrl.wiring import load_config

    assets = Path(__file__).resolve().parents[2] / "assets"
    plans = {
        name: resolve(load_config(CONFIGS / "vlm_demo.yaml", [f"model.path={assets / name}"]))
        for name in ("vlm_base", "vlm_demo_base")
    }
    policies = {name: build_policy(p, tmp_path / name) for name, p in plans.items()}
    plan = plans["vlm_demo_base"]
    g = held_out_gain(plan, policies["vlm_base"], policies["vlm_demo_base"], tmp_path / "t", 12)
    questions = load_samples(tmp_path / "t" / "data" / "test.jsonl")[0]
    assert len(questions) == 12 and g["questions"] == 12
    assert {q["family"] for q in questions} == {"count_all"} and set(g["families"]) == {"count_all"}
    own = {
        name: evaluate_accuracy(p, questions, build_reward({"accuracy": 1.0}),
                                prompt=plan.prompt)["accuracy"]
        for name, p in policies.items()
    }  # fmt: skip
    assert g["before"] == pytest.approx(own["vlm_base"]) and g["after"] == pytest.approx(
        own["vlm_demo_base"]
    )
    assert g["gain"] == pytest.approx(own["vlm_demo_base"] - own["vlm_base"])
    assert g["families"]["count_all"]["after"] == pytest.approx(own["vlm_demo_base"])
