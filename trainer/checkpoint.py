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
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

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
        _fsync_dir(root)
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
        _fsync_dir(run_dir)
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


def load_trainer_state(ckpt: Path, rank: int = 0) -> tuple[dict[str, Any], dict]:
    """(trainer state of ``rank``, counters) of checkpoint ``ckpt``."""
    path = ckpt / trainer_state_name(rank)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: checkpoint {ckpt.name} was written by fewer ranks than this "
            "launch has; resume with the same number of processes"
        )
    state = torch.load(path, map_location="cpu", weights_only=True)
    counters = json.loads((ckpt / "state.json").read_text())
    return state, counters


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory (deepest first): the data and the
    names are on disk before the checkpoint is renamed into place."""
    dirs = [root]
    for dirpath, dirnames, filenames in os.walk(root):
        dirs += [Path(dirpath) / d for d in dirnames]
        for name in filenames:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(d)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
