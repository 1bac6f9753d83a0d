"""Shared by the benchmark scripts: the machine description and result writing."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine(**extra) -> dict:
    """CPU model, cores and library versions: every result file says where it was measured."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    info = {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", ""),
    }
    info.update(extra)
    return info


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MB (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_results(name: str, data: dict, markdown: str) -> tuple[Path, Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    js, md = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    js.write_text(json.dumps(data, indent=2) + "\n")
    md.write_text(markdown.rstrip() + "\n")
    return js, md


def run_timed(argv: list[str]) -> float:
    """``argv`` in its own process (its own peak RSS), offline; wall seconds."""
    t = time.perf_counter()
    subprocess.run(argv, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return time.perf_counter() - t


def run_arm(cmd: list[str], run_dir: Path) -> float:
    """``perceptrl <cmd> --run-dir run_dir`` in its own process (`run_timed`), from scratch (an
    earlier run there is deleted first: the CLI refuses to start over it); wall seconds."""
    shutil.rmtree(run_dir, ignore_errors=True)
    return run_timed([sys.executable, "-m", "perceptrl.cli", *cmd, "--run-dir", str(run_dir)])


def arm_runner(out: Path, reuse: bool, previous: dict, wall: dict):
    """``arm(name, cmd) -> model``: ``perceptrl <cmd>`` run into ``out/name`` (`run_arm`; its
    wall seconds go into ``wall[name]``), or with ``reuse`` an arm already there kept as it is
    (its wall time taken from the ``previous`` results, else `logged_seconds`). Returns the
    arm's last model."""

    def arm(name: str, cmd: list[str]) -> Path:
        if reuse and (out / name / "checkpoints").exists():
            seconds = previous.get("wall_s", {}).get(name)
            known = seconds is not None and seconds == seconds  # NaN: not measured
            wall[name] = seconds if known else logged_seconds(out / name)
        else:
            wall[name] = run_arm(cmd, out / name)
        return last_model(out / name)

    return arm


def logged_seconds(run_dir: Path) -> float:
    """The seconds a run's metrics account for (its steps' and evaluations' ``time/*``): the
    wall time of a reused arm whose earlier result file is gone, without start-up."""
    rows = metrics(run_dir)
    return sum(r.get("time/step", 0.0) + r.get("time/eval", 0.0) for r in rows)


def last_model(run_dir: Path) -> Path:
    """The HF model folder of a run's last checkpoint."""
    return sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "model"


def metrics(run_dir: Path) -> list[dict]:
    """The run's ``metrics.jsonl`` rows."""
    from perceptrl.trainer.metrics import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")
