"""Shared by the benchmark scripts: the machine description and result writing (with the
provenance of every result: command, commit, date, machine, seeds, wall time)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""the checkout's root (the ``perceptrl`` package)"""
RESULTS = ROOT / "bench" / "results"
"""where `write_results` writes (read at each call: a script or test may point it elsewhere)"""
IMPORTED = time.time()
"""when this module was imported: the start of a script's wall time if its process start is
unknown"""


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


def process_start() -> float:
    """The Unix time this process started (Linux ``/proc``), else when this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return IMPORTED


def portable(arg: str) -> str:
    """A command-line argument without this machine's paths: a path inside the checkout made
    relative to its root, any other absolute path (a scratch folder) shown as ``<outside>/name``;
    also the value of a ``key=/path`` override."""
    key, sep, value = ("", "", arg) if arg.startswith("/") else arg.rpartition("=")
    if not value.startswith("/"):
        return arg
    path = Path(value)
    try:
        value = str(path.resolve().relative_to(ROOT)) or "."
    except ValueError:
        value = f"<outside>/{path.name}"
    return f"{key}{sep}{value}"


def command_line(argv: list[str] | None = None) -> str:
    """The command that runs this script, as typed from the checkout's root: ``python
    bench/<script>.py args...`` (``argv``: ``sys.argv``)."""
    argv = list(sys.argv if argv is None else argv) or ["-c"]
    script = argv[0]
    if Path(script).is_file():
        script = portable(str(Path(script).resolve()))
    return shlex.join(["python", script, *(portable(a) for a in argv[1:])])


def git_commit() -> tuple[str | None, bool | None]:
    """The checkout's commit and whether tracked files differ from it (``dirty``); ``(None,
    None)`` outside a git work tree, unless ``PERCEPTRL_COMMIT`` names the commit (a copy of a
    checkout without its ``.git``, as on a lent GPU machine; dirty then unknown)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()  # fmt: skip

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        return commit, dirty
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("PERCEPTRL_COMMIT") or None, None


def provenance(seeds, machine_info: dict | None = None) -> dict:
    """What produced a result: the command line, the commit (``dirty``: tracked files changed),
    the UTC date, the machine, the seeds the script used, and its wall time so far (seconds
    since the process started)."""
    commit, dirty = git_commit()
    return {
        "command": command_line(),
        "commit": commit,
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine_info if machine_info is not None else machine(),
        "seeds": seeds,
        "wall_s": round(time.time() - process_start(), 1),
    }


def provenance_line(p: dict) -> str:
    """One line for the bottom of a result's markdown."""
    commit = (p.get("commit") or "unknown commit")[:12] + (" (dirty)" if p.get("dirty") else "")
    m = p.get("machine") or {}
    where = m.get("cuda") or m.get("cpu") or "unknown machine"
    cores = f", {m['cores']} cores" if m.get("cores") else ""
    wall = f", {p['wall_s'] / 60:.1f} min" if isinstance(p.get("wall_s"), (int, float)) else ""
    seeds = f", seeds {json.dumps(p['seeds'])}" if p.get("seeds") is not None else ""
    how = "recovered from git history" if p.get("recovered") else "recorded"
    return (
        f"Provenance ({how}): `{p['command']}` at {commit}, {p.get('date', '?')[:10]}, "
        f"{where}{cores}{seeds}{wall}."
    )


def write_results(
    name: str, data: dict, markdown: str, *, seeds, keep_provenance: bool = False
) -> tuple[Path, Path]:
    """``RESULTS/<name>.json`` (``data`` with its ``provenance``) and ``<name>.md`` (``markdown``
    and a provenance line). ``seeds``: every seed the script used (a list, or a dict naming what
    each seeds). ``keep_provenance``: a rewrite of an earlier result (a report re-rendered from
    its JSON) keeps the provenance it has."""
    if not (keep_provenance and "provenance" in data):
        data["provenance"] = provenance(seeds, data.get("machine"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    js, md = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    js.write_text(json.dumps(data, indent=2) + "\n")
    md.write_text(f"{markdown.rstrip()}\n\n{provenance_line(data['provenance'])}\n")
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


def install_last_model(run_dir: Path, out: Path) -> Path:
    """Copy the model folder of ``run_dir``'s last checkpoint to ``out`` (replaced); returns the
    source folder. How the asset builders put a trained base in place."""
    source = last_model(run_dir)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out)
    return source


def metrics(run_dir: Path) -> list[dict]:
    """The run's ``metrics.jsonl`` rows."""
    from perceptrl.trainer.metrics import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")
