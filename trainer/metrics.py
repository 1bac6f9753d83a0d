"""Metrics sink: one JSON line per step in ``metrics.jsonl`` plus TensorBoard scalars, and a
copy of each row for the experiment trackers a recipe enables (``log.wandb``, ``log.mlflow``:
`trainer.trackers`; a tracker that fails is turned off, the local files go on).

The file survives a kill at any moment (``trainer/files.py``): each row is appended as one
whole line, and a resume's rewrite (`MetricsLogger.truncate_after`) replaces the file in one
rename, so it never empties the history. A line that is not JSON (a write cut short by a full
disk, a failing machine) is dropped with a warning by every reader, never a crash.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from .files import append_line, atomic_write_text
from .trackers import Trackers

log = logging.getLogger(__name__)


class MetricsLogger:
    """The metrics sink of a run (rank 0).

    Args:
        run_dir: the run directory (``metrics.jsonl``, ``tensorboard/``).
        recipe: the run's resolved config; the trackers its ``log`` section enables get every
            row, and the recipe itself as their config (W&B) or params (MLflow).
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, recipe: object = None):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)  # builders called from scripts, not the CLI
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.trackers = Trackers(run_dir, recipe)

    def truncate_after(self, step: int) -> None:
        """Drop lines logged after ``step`` (a killed run may have logged past its checkpoint);
        the trackers continue their runs and get no step they may already hold."""
        for stale in self.path.parent.glob(f".tmp-{self.path.name}-*"):  # a rewrite killed
            stale.unlink(missing_ok=True)
        rows = _rows(self.path) if self.path.exists() else []
        self.trackers.resume(step, max((row.get("step", -1) for _, row in rows), default=-1))
        if not self.path.exists():
            return
        keep = [line for line, row in rows if row.get("step", -1) <= step]
        atomic_write_text(self.path, "".join(line + "\n" for line in keep))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: _jsonable(v) for k, v in metrics.items()}
        append_line(self.path, json.dumps({"step": step, **clean}))
        if self.tb is not None:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and v is not None:
                    self.tb.add_scalar(k, v, step)
        self.trackers.log(step, clean)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        self.trackers.close()


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``, in order; a line that is not a JSON object is dropped
    with a warning naming it."""
    return [row for _, row in _rows(Path(path))]


def _rows(path: Path) -> list[tuple[str, dict]]:
    """(line, parsed row) of every line of ``path`` that holds a JSON object; a line cut short
    (the last one, by a kill during a write on a failing disk) or otherwise damaged is logged as
    a warning and skipped."""
    out = []
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            last = "its last line, cut short" if n == len(lines) else f"line {n}"
            log.warning("%s: dropping %s (not a JSON object): %.80r", path, last, line)
            continue
        out.append((line, row))
    return out


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf; the loop logs non-finite events as their own counters
    return v


class NullLogger:
    """The metrics sink of ranks other than 0 (one writer per run directory)."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def latest_skips(rows: list[dict]) -> dict[str, float]:
    """Samples a lenient run skipped, nonzero counts only: the ``data/skipped_<reason>`` of the
    last row that has them (counted when the data loaded) and the last
    ``rollout/skipped_images_total`` (files unreadable when drawn)."""
    loaded = next((r for r in reversed(rows) if any(k.startswith("data/skipped_") for k in r)), {})
    out = {k: v for k, v in loaded.items() if k.startswith("data/skipped_") and v}
    drawn = next((r["rollout/skipped_images_total"] for r in reversed(rows)
                  if "rollout/skipped_images_total" in r), 0)  # fmt: skip
    if drawn:
        out["rollout/skipped_images_total"] = drawn
    return out
