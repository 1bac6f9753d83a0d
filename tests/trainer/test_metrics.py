"""metrics.jsonl (trainer/metrics.py): a damaged line is dropped with a warning by every reader,
and a resume's rewrite replaces the file whole."""

from __future__ import annotations

import json
import logging

from perceptrl.trainer.metrics import MetricsLogger, read_metrics

ROWS = [{"step": 0, "eval/accuracy": 0.5}, {"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]


def _write(path, rows, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_a_half_written_last_line_is_dropped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    _write(path, ROWS, tail='{"step": 3, "lo')
    with caplog.at_level(logging.WARNING, logger="perceptrl.trainer.metrics"):
        assert read_metrics(path) == ROWS
    assert "its last line, cut short" in caplog.text and str(path) in caplog.text


def test_a_damaged_line_inside_is_named_and_skipped(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\x00\x00garbage\n" + json.dumps(ROWS[1]) + "\n")
    with caplog.at_level(logging.WARNING, logger="perceptrl.trainer.metrics"):
        assert read_metrics(path) == ROWS[:2]
    assert "line 2" in caplog.text


def test_truncate_after_keeps_the_lines_up_to_the_step_byte_for_byte(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, ROWS, tail='{"step": 3, "lo')
    (tmp_path / ".tmp-metrics.jsonl-123").write_text("left by a killed rewrite")
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.truncate_after(1)
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in ROWS[:2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    logger.log(2, {"loss": 0.25})
    assert read_metrics(path)[-1] == {"step": 2, "loss": 0.25}


def test_non_finite_values_are_written_as_null(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"loss": float("nan"), "ok": 1.0})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": None, "ok": 1.0}]
