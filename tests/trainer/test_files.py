"""Crash-safe writes (trainer/files.py): processes killed with SIGKILL at random moments while
rewriting or appending never leave an empty or half-written file."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perceptrl.trainer.files import append_line, atomic_write_text
from perceptrl.trainer.metrics import read_metrics

REWRITER = """
import sys
from perceptrl.trainer.files import atomic_write_text
path, n = sys.argv[1], 0
while True:
    n += 1
    atomic_write_text(path, "".join(f"{i} {'x' * 2000}\\n" for i in range(1, n % 200 + 2)))
"""
APPENDER = """
import json, sys
from perceptrl.trainer.files import append_line
for i in range(10**9):
    append_line(sys.argv[1], json.dumps({"step": i, "pad": "y" * 20000}))
"""


def _killed_at_random(script: str, path: Path, rng: random.Random) -> None:
    """Run ``script`` on ``path`` in its own process and SIGKILL it at a random moment after
    it first wrote."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)])
    deadline = time.time() + 60
    while not path.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.001)
    time.sleep(rng.uniform(0.0, 0.15))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the writer ended before it was killed"


def test_a_rewrite_killed_at_any_moment_leaves_a_whole_version(tmp_path):
    rng = random.Random(3)
    path = tmp_path / "m.txt"
    for _ in range(6):
        _killed_at_random(REWRITER, path, rng)
        lines = path.read_text().splitlines()
        assert lines, "the kill left the file empty"
        assert [int(line.split()[0]) for line in lines] == list(range(1, len(lines) + 1))
        assert all(line.endswith("x" * 2000) for line in lines)


def test_appends_killed_at_any_moment_lose_at_most_the_line_being_written(tmp_path):
    """A kill may cut the line being written short (the kernel stops a long write between pages
    for a fatal signal); every line before it stays whole, readers drop the cut one, and the
    next append starts a line of its own."""
    rng = random.Random(4)
    path = tmp_path / "metrics.jsonl"
    for kills in range(1, 7):
        _killed_at_random(APPENDER, path, rng)
        append_line(path, json.dumps({"step": -1, "pad": ""}))  # as a resumed run would go on
        rows = read_metrics(path)
        assert rows[-1]["step"] == -1
        assert all(r["step"] == -1 or len(r["pad"]) == 20000 for r in rows)
        lines = [line for line in path.read_text().splitlines() if line]
        assert len(lines) - len(rows) <= kills  # at most one cut line per kill


def test_a_failed_rewrite_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "f.txt"
    path.write_text("old\n")

    def refuse(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("perceptrl.trainer.files.os.replace", refuse)
    with pytest.raises(OSError):
        atomic_write_text(path, "new\n")
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_append_line_adds_exactly_one_newline(tmp_path):
    path = tmp_path / "a.jsonl"
    append_line(path, "{}")
    append_line(path, "{}\n")
    assert path.read_text() == "{}\n{}\n"
