"""Crash-safe writes of a run's files: a kill (or power loss) at any moment leaves either the
old content or the new, never an empty or half-written file.

* A rewrite goes to a temporary file beside the target, is fsynced, then renamed over it
  (`atomic_write_text`, `replace_file`); the directory is fsynced so the rename itself lasts.
* An append writes one whole line with one ``write`` on a descriptor opened ``O_APPEND``
  (`append_line`): a kill lands before or after the line, and a reader drops a line that a
  failing disk cut short (`trainer.metrics.read_metrics`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PAUSE_ENV = "PERCEPTRL_TEST_REWRITE_PAUSE_S"
"""fault-injection tests: seconds `atomic_write_text` sleeps between writing the temporary file
and renaming it into place (so a kill can land inside a rewrite)"""


def fsync_dir(path: Path) -> None:
    """fsync directory ``path`` (its entries: names created or renamed in it); a no-op where
    directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(tmp: Path, final: Path) -> None:
    """Make the complete file ``tmp`` the content of ``final`` in one step: fsync it, rename it
    over ``final``, fsync the directory."""
    fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file renamed into place."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed into place (see the module
    docstring); the temporary file is removed when the write fails."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        if os.environ.get(PAUSE_ENV):
            time.sleep(float(os.environ[PAUSE_ENV]))
        replace_file(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def append_line(path: str | Path, line: str) -> None:
    """Append ``line`` (a newline is added) to ``path`` with one ``write`` of the whole line,
    repeated for what a short write left. A kill can still cut a long write short (the kernel
    stops a write between pages for a fatal signal): a line the file ends in without its
    newline is closed first, so the cut line stays one damaged line that readers drop and the
    new one stays whole."""
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
