"""Atomic checkpoints: policy weights (the policy's own format, HF for VLMs), optimizer, RNG,
data position and loop counters, written to a temporary directory and renamed into place.

Layout::

    <run>/checkpoints/step_000010/
        model/               policy.save(...)  (HF directory for a VLM); under ZeRO the
                             consolidated weights (gathered, written by rank 0)
        trainer_state.pt     optimizer + scheduler + RNG + source state  (torch.save, loaded
                             with weights_only=True); under DeepSpeed rank 0's RNG and source
        trainer_state.rank<r>.pt   the same for rank r > 0 (its data shard position, RNG)
        zero/                DeepSpeed only: each rank's optimizer (and ZeRO-3 parameter)
                             partitions, what a resume loads; DeepSpeed's ``zero_to_fp32.py``
                             in it rebuilds fp32 weights offline
        state.json           step, counters (human-readable)
    <run>/best/              ``checkpoint.best``: the weights of the best evaluation so far
        model/               as above
        best.json            step, metric, value

Under data parallelism every rank calls ``save_checkpoint`` (the gathers and DeepSpeed's save are
collective); rank 0 owns the directory, the rename and the pruning. Multi-node runs need the run
directory on a file system every node sees.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import RunError
from .files import fsync_dir, fsync_file

log = logging.getLogger(__name__)

STEP_PREFIX = "step_"
BEST = "best"
"""the run directory's folder of the best evaluation's weights (``checkpoint.best``)"""
PAUSE_ENV = "PERCEPTRL_TEST_CHECKPOINT_PAUSE_S"
"""fault-injection tests: seconds to sleep after a checkpoint's files are written, before the
rename that makes it visible (so a kill can land inside the write)"""


def rng_state() -> dict[str, Any]:
    """Every RNG the loop draws from, as tensors and plain Python values (weights_only-safe)."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [
            np_name,
            torch.from_numpy(np_keys.astype(np.int64)),
            np_pos,
            np_has_gauss,
            np_gauss,
        ],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys, pos, has_gauss, np_gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, np_gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainer_state_name(rank: int) -> str:
    return "trainer_state.pt" if rank == 0 else f"trainer_state.rank{rank}.pt"


def save_checkpoint(
    root: Path,
    step: int,
    policy,
    trainer_state: dict[str, Any],
    counters: dict,
    keep_last: int,
    engine=None,
) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically and prune to ``keep_last``.

    ``engine`` (the loop's) writes the weights: ``engine.export`` gathers ZeRO-3 partitions into
    consolidated HF weights, ``engine.save_sharded`` writes DeepSpeed's per-rank state; without
    one, ``policy.save`` alone. Returns the final directory. A crash at any point leaves either
    the previous set of complete checkpoints or the new one, never a half-written ``step_*``.
    """
    rank = engine.rank if engine is not None else 0
    distributed = engine is not None and engine.world_size > 1
    final = root / f"{STEP_PREFIX}{step:06d}"
    # every rank writes into the same temporary directory, so its name is not per-process
    tmp = root / f".tmp-{STEP_PREFIX}{step:06d}-{'dist' if distributed else os.getpid()}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    if distributed:
        engine.barrier()
    if engine is not None:
        engine.export(policy, tmp / "model")
        engine.save_sharded(tmp)
    else:
        policy.save(tmp / "model")
    torch.save(trainer_state, tmp / trainer_state_name(rank))
    if distributed:
        engine.barrier()
    if rank == 0:
        (tmp / "state.json").write_text(json.dumps({"step": step, **counters}, indent=2))
        _fsync_tree(tmp)  # every file's data on disk before the rename makes it visible
        if os.environ.get(PAUSE_ENV):
            time.sleep(float(os.environ[PAUSE_ENV]))
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    if distributed:
        engine.barrier()
    return final


def save_best(run_dir: Path, step: int, policy, record: dict, engine=None) -> Path:
    """Write the policy's weights to ``run_dir/best`` with ``best.json`` = ``record`` (the
    step, metric and value), replacing the previous best atomically. Every rank calls it (the
    export gathers ZeRO-3 partitions); rank 0 writes. Returns the directory."""
    rank = engine.rank if engine is not None else 0
    final = run_dir / BEST
    distributed = engine is not None and engine.world_size > 1
    tmp = run_dir / f".tmp-{BEST}-{'dist' if distributed else os.getpid()}"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    if engine is not None:
        engine.barrier()
        engine.export(policy, tmp / "model")
        engine.barrier()
    else:
        policy.save(tmp / "model")
    if rank == 0:
        (tmp / "best.json").write_text(json.dumps({"step": step, **record}, indent=2))
        _fsync_tree(tmp)
        old = run_dir / f".old-{BEST}"
        if final.exists():  # two renames: a crash between them leaves .old-best, never half a best
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(run_dir)
    if engine is not None:
        engine.barrier()
    return final


def tidy_best(run_dir: Path, reset: bool) -> None:
    """Before a run: remove unfinished writes of the best weights, put back a best that a kill
    between `save_best`'s two renames left as ``.old-best``, and with ``reset`` (a run that
    starts over) remove the best of the earlier run."""
    for p in run_dir.glob(f".tmp-{BEST}-*"):
        shutil.rmtree(p, ignore_errors=True)
    old, final = run_dir / f".old-{BEST}", run_dir / BEST
    if old.is_dir() and not final.exists():
        os.replace(old, final)
    shutil.rmtree(old, ignore_errors=True)
    if reset:
        shutil.rmtree(final, ignore_errors=True)


def best_record(run_dir: Path) -> dict | None:
    """``best.json`` of the run's best weights (step, metric, value), or None."""
    path = run_dir / BEST / "best.json"
    return json.loads(path.read_text()) if path.is_file() else None


def remove_stale_temporaries(root: Path) -> list[Path]:
    """Delete the temporary directories of checkpoint writes that never finished (a process
    killed mid-write leaves ``.tmp-step_*``); complete ``step_*`` directories are untouched.
    Returns the paths removed."""
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(f".tmp-{STEP_PREFIX}")]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)]
    return sorted(done, key=lambda p: int(p.name[len(STEP_PREFIX) :]))


class DamagedCheckpoint(RunError):
    """A checkpoint whose files cannot be what ``save_checkpoint`` wrote (truncated weights or
    trainer state, an empty or unparsable state.json, missing files)."""


def load_trainer_state(ckpt: Path, rank: int = 0) -> tuple[dict[str, Any], dict]:
    """(trainer state of ``rank``, counters) of checkpoint ``ckpt``, after checking its other
    files (`checkpoint_problem`); `DamagedCheckpoint` says what is wrong with it."""
    path = ckpt / trainer_state_name(rank)
    if rank > 0 and not path.is_file() and (ckpt / trainer_state_name(0)).is_file():
        raise RunError(
            f"{path} is missing: checkpoint {ckpt.name} was written by fewer ranks than this "
            "launch has; resume with the same number of processes"
        )
    problem = checkpoint_problem(ckpt) or _file_problem(path)
    if problem is None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError ...
            problem = f"{path.name} does not load ({type(e).__name__}: {_first_line(e)})"
    if problem is not None:
        raise DamagedCheckpoint(f"{ckpt}: {problem}")
    return state, json.loads((ckpt / "state.json").read_text())


def checkpoint_problem(ckpt: Path) -> str | None:
    """What is wrong with checkpoint ``ckpt``'s state.json and weights, None when they are
    whole: state.json must parse with its step, and every safetensors file under ``model/``
    must be as long as its header says (a truncated copy is not). Reads headers, not weights."""
    try:
        counters = json.loads((ckpt / "state.json").read_text())
        if not isinstance(counters.get("step"), int):
            return "state.json holds no step"
    except (OSError, ValueError, AttributeError) as e:
        return f"state.json is unreadable ({type(e).__name__}: {_first_line(e)})"
    model = ckpt / "model"
    weights = sorted(model.rglob("*.safetensors")) if model.is_dir() else []
    if not weights:
        return "model/ holds no safetensors weights"
    for f in weights:
        problem = _safetensors_problem(f)
        if problem is not None:
            return f"{f.relative_to(ckpt)} {problem}"
    return None


def _file_problem(path: Path) -> str | None:
    if not path.is_file():
        return f"{path.name} is missing"
    return f"{path.name} is empty" if path.stat().st_size == 0 else None


def _safetensors_problem(path: Path) -> str | None:
    """None when ``path`` is a whole safetensors file: an 8-byte header length, a JSON header,
    and exactly as many data bytes as its tensors' offsets cover."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                return f"is cut short ({size} bytes, shorter than its header)"
            header = json.loads(f.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError) as e:
        return f"has a damaged header ({type(e).__name__})"
    want = 8 + n + max(ends, default=0)
    return None if size == want else f"is {size} bytes, its header says {want} (cut short?)"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def load_latest(root: Path, engine=None):
    """The newest intact checkpoint under ``root`` for a resume, falling back past damaged ones.

    Each damaged checkpoint newer than the one taken is named in a warning and set aside as
    ``damaged-step_*`` beside the others (never deleted; later pruning and saves leave it
    alone). With ``engine`` (the loop's), every rank takes the same checkpoint and rank 0
    writes (the warnings, the renames).

    Returns:
        None when ``root`` holds no checkpoint; else (checkpoint dir, trainer state, counters,
        metrics for the resume's row: ``resume/damaged_checkpoints`` when some were set aside).
    Raises:
        RunError: every checkpoint is damaged (they stay where they are).
    """
    rank = engine.rank if engine is not None else 0
    damaged: list[tuple[Path, str]] = []
    for ckpt in reversed(list_checkpoints(root)):
        try:
            state, counters = load_trainer_state(ckpt, rank)
            problem = None
        except DamagedCheckpoint as e:
            problem = str(e)
        if problem is None if engine is None else engine.all_true(problem is None):
            main = engine is None or engine.is_main
            aside = _set_aside(damaged, ckpt, main)
            metrics = {"resume/damaged_checkpoints": float(len(aside))} if aside else {}
            return ckpt, state, counters, metrics
        damaged.append((ckpt, problem or f"{ckpt}: damaged on another rank"))
    if damaged:
        raise RunError(
            f"every checkpoint of {root.parent} is damaged, so it cannot resume: "
            + "; ".join(why for _, why in damaged)
            + ". Start the run again in a new --run-dir (or move checkpoints/ and "
            "metrics.jsonl away); the damaged checkpoints are left as they are"
        )
    return None


def _set_aside(damaged: list[tuple[Path, str]], taken: Path, main: bool) -> list[Path]:
    """Rename each damaged checkpoint to ``damaged-<name>`` (rank 0) with a warning that names
    it, what is wrong and the checkpoint resumed instead. Returns the new paths."""
    out = []
    for ckpt, why in damaged:
        aside = ckpt.with_name(f"damaged-{ckpt.name}")
        k = 1
        while aside.exists():
            aside, k = ckpt.with_name(f"damaged-{ckpt.name}.{k}"), k + 1
        if main:
            log.warning(
                "damaged checkpoint: %s. Resuming from %s instead; the damaged one is kept as %s",
                why, taken.name, aside,
            )  # fmt: skip
            os.replace(ckpt, aside)
        out.append(aside)
    if main and out:
        fsync_dir(taken.parent)
    return out


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory (deepest first): the data and the
    names are on disk before the checkpoint is renamed into place."""
    dirs = [root]
    for dirpath, dirnames, filenames in os.walk(root):
        dirs += [Path(dirpath) / d for d in dirnames]
        for name in filenames:
            fsync_file(Path(dirpath) / name)
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(d)
