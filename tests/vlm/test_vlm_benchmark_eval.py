"""`perceptrl eval` on benchmark files (a VLMEvalKit TSV, an MMStar Parquet export) with the
shipped tiny model: a row per category, the overall accuracy, the images decoded under the
output directory, and a bad image refused (strict) or skipped and counted (lenient). The files
come from tests/datasets/benchmark_files.py, in the published schemas."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from perceptrl.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "datasets"))
import benchmark_files as bf  # noqa: E402

BASE = Path(__file__).resolve().parents[2] / "assets" / "vlm_base"
FAST = ["rollout.max_new_tokens=8", "log.progress=false"]


def _eval(out: Path, *args: str) -> int:
    return main(["eval", "vlm_clevr", "--model", str(BASE), "--out", str(out), *FAST, *args])


def test_eval_on_a_vlmevalkit_file_reports_per_category(tmp_path, capsys):
    rows = bf.vlmevalkit_rows()
    rows[4]["image"] = "A" * 65  # not base64: strict stops at it, lenient skips and counts it
    tsv = bf.write_tsv(tmp_path / "MMBench_DEV_EN.tsv", rows)
    assert _eval(tmp_path / "strict", f"data.val={tsv}") == 3  # a data error, before any model
    err = capsys.readouterr().err
    assert "MMBench_DEV_EN.tsv, row 4, index 5: its image is no valid base64" in err
    assert "data.strict=false" in err

    out = tmp_path / "ev"
    assert _eval(out, f"data.val={tsv}", "data.strict=false") == 0
    record = json.loads((out / "eval.json").read_text())
    assert {(r["family"], r["questions"]) for r in record["rows"]} == {("colour", 1), ("shape", 3)}
    assert record["overall"]["questions"] == 4 and 0.0 <= record["overall"]["accuracy"] <= 1.0
    assert record["task_sets"][0]["skipped"] == {"images": 1}
    assert record["task_sets"][0]["data"] == str(tsv)
    assert "| image | shape | 3 |" in (out / "eval.md").read_text()
    # one file per image, index 3 sharing index 1's
    assert sorted(p.name for p in (out / "data" / "val_images").iterdir()) == [
        "1.png", "2.png", "4_0.png", "4_1.jpg"
    ]  # fmt: skip


def test_eval_on_a_yes_no_file_reports_its_image_groups(tmp_path):
    """An MME-style TSV: scored by yesno, and each image's two questions one group."""
    tsv = bf.write_tsv(tmp_path / "MME.tsv", bf.mme_rows(), bf.MME_COLUMNS)
    out = tmp_path / "ev"
    assert _eval(out, f"data.val={tsv}") == 0
    record = json.loads((out / "eval.json").read_text())
    (row,) = record["rows"]
    assert (row["family"], row["questions"], row["groups"]) == ("color", 4, 2)
    assert row["group_accuracy"] <= row["accuracy"]
    assert record["task_sets"][0]["metrics"]["groups"] == 2
    assert "| groups | all of group right |" in (out / "eval.md").read_text()


def test_eval_on_an_mmstar_parquet_named_by_data_format(tmp_path):
    path = bf.write_parquet(tmp_path / "mmstar.parquet", bf.mmstar_table())
    out = tmp_path / "ev"
    assert _eval(out, f"data.val={path}", "data.format=mmstar") == 0
    metrics = json.loads((out / "eval.json").read_text())["metrics"]
    assert metrics["count"] == 2
    assert metrics["count/image/instance reasoning"] == 1.0
    assert metrics["count/image/fine-grained perception"] == 1.0
