"""Metrics sink: one JSON line per step in ``metrics.jsonl`` plus TensorBoard scalars."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)  # builders called from scripts, not the CLI
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drop lines logged after ``step`` (a killed run may have logged past its checkpoint)."""
        if not self.path.exists():
            return
        keep = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", -1) <= step
        ]
        self.path.write_text("".join(line + "\n" for line in keep))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: _jsonable(v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self.tb is not None:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and v is not None:
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


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
