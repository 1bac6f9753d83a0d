"""Every case of the fault corpus (tests/faults/corpus.py) through the `perceptrl` command: the
named error with its exit status, the counted skip or the clean success it is owed, and never a
traceback, a hang or a lost file. Cases run in this process (``perceptrl.cli.main``) under an
alarm; those that need an environment of their own (``MUJOCO_GL``) run as processes, slow."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402

from perceptrl.cli import main  # noqa: E402
from perceptrl.trainer.metrics import read_metrics  # noqa: E402

HANG_S = 300
KINDS = {2: "config", 3: "data", 4: "model", 5: "machine", 6: "run"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("corpus")


def _marks(case) -> list:
    marks = [pytest.mark.slow] if case.slow else []
    if case.pending:  # not strict: the case passes once the command answers it
        marks.append(pytest.mark.xfail(reason=case.pending, strict=False))
    return marks


def _params() -> list:
    return [pytest.param(c, id=c.name, marks=_marks(c)) for c in corpus.CASES]


def _alarm(*_):
    raise TimeoutError(f"the command hung (no answer within {HANG_S} s)")


def _here(args: list[str], capsys) -> tuple[int, str]:
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    try:
        status = main(args)
    except SystemExit as e:  # argparse's usage errors
        status = e.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return status, capsys.readouterr().err


def _process(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env}
    out = subprocess.run([sys.executable, "-m", "perceptrl.cli", *args], cwd=cwd, env=full,
                         capture_output=True, text=True, timeout=HANG_S)  # fmt: skip
    return out.returncode, out.stderr


def _files(where: Path) -> dict[str, bytes]:
    return {str(p.relative_to(where)): p.read_bytes() for p in where.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case", _params())
def test_corpus_case(case, root, capsys, caplog, monkeypatch):
    here = root / corpus.slug(case.name)
    here.mkdir()
    monkeypatch.chdir(here)
    args = case.make(here)
    before = _files(here)
    with caplog.at_level("WARNING"):
        if case.env:
            status, err = _process(args, dict(case.env), here)
        else:
            status, err = _here(args, capsys)
    said = err + caplog.text
    assert "Traceback" not in said, said[-4000:]
    assert status == case.status, said[-4000:]
    for phrase in case.says:
        assert phrase in said, (phrase, said[-3000:])
    if status:
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"perceptrl: {KINDS[status]} error: "), last
    if case.skipped:
        step = next(r for r in read_metrics(here / "r" / "metrics.jsonl") if "lr" in r)
        assert step[f"data/skipped_{case.skipped}"] == 1.0, step
    _nothing_lost(case, here, before, status)


def _nothing_lost(case, here: Path, before: dict[str, bytes], status: int) -> None:
    """Every file the case had is still there with its content; in a resumed run directory a
    damaged checkpoint may only have moved to ``damaged-step_*``, an unfinished write
    (``.tmp-*``) may be gone, and the metrics are the uninterrupted run's."""
    after = _files(here)
    for path, data in before.items():
        if status or not path.startswith("run/"):
            assert after.get(path) == data, f"{path} was changed or lost"
        elif ".tmp-" not in path and path not in after:
            moved = path.replace("checkpoints/step_", "checkpoints/damaged-step_")
            assert moved in after, f"{path} was lost"
    if case.kind == "run" and status == 0:
        assert corpus.rows(here / "run") == corpus.rows(corpus.base_run(here.parent))


def test_the_corpus_covers_every_kind_and_answer():
    """What the corpus holds, so a case dropped by mistake shows: counts per kind, and each of
    the three answers (error, skip, success) present."""
    kinds = {}
    for case in corpus.CASES:
        kinds[case.kind] = kinds.get(case.kind, 0) + 1
    assert set(kinds) == {"config", "data", "model", "machine", "run"} and len(corpus.CASES) > 100
    assert {c.status for c in corpus.CASES} == {0, 2, 3, 4, 5, 6}
    assert any(c.skipped for c in corpus.CASES) and any(c.slow for c in corpus.CASES)
