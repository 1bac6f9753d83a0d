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
