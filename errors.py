"""The errors a user can act on, one class per kind, each with the `perceptrl` command's exit
status for it; and the YAML reader whose syntax errors are `ConfigError`s naming file and line.

==========  ================  ============================================================
status      class             what is wrong
==========  ================  ============================================================
2           `ConfigError`     the recipe or an override (key, type, value, two keys that
                              cannot go together, YAML syntax), or a command's arguments
3           `DataError`       a data file, sample, image or video
4           `ModelError`      ``model.path`` or ``--model``: missing, not a model, damaged
                              weights, no processor
5           `MachineError`    the machine lacks what the run needs: a GPU, a writable
                              directory with free space, offscreen rendering (EGL), memory
6           `RunError`        a run that cannot go on: every checkpoint of a resumed run is
                              damaged, the loss diverged, the rollout workers keep failing
==========  ================  ============================================================

Every message is one paragraph: what is wrong, where (the key, file, line, sample or path) and
the fix. The command (``cli.py``) prints ``perceptrl: <kind> error: <message>`` and exits with
the class's status; any other exception is a bug (traceback, status 1).

This module is the bottom of the import graph with ``registry.py`` and ``schema.py``: it imports
nothing of the package, so every layer (the simulator and the data loaders included) may raise
these classes. Each is also the built-in exception it was before it had a class here (a
`ValueError` for the first three, a `RuntimeError` for the others), so callers that caught
those still do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import traceback
from pathlib import Path
from typing import Any

import yaml


class PerceptrlError(Exception):
    """An anticipated failure whose message says what is wrong, where, and the fix."""

    exit_status = 1
    kind = "error"


class ConfigError(PerceptrlError, ValueError):
    """A recipe, override or option that does not fit the option dataclasses, or a command's
    arguments that cannot go together."""

    exit_status = 2
    kind = "config"


class DataError(PerceptrlError, ValueError):
    """A data file, sample, image or video that cannot be used; the message names the file and
    the place (line, sample index or id) and says what to do (``data.strict=false`` skips and
    counts such samples)."""

    exit_status = 3
    kind = "data"


class ModelError(PerceptrlError, ValueError):
    """A model directory that is missing, not a model of the kind asked for, or damaged
    (truncated weights, no processor)."""

    exit_status = 4
    kind = "model"


class MachineError(PerceptrlError, RuntimeError):
    """What the machine lacks: a GPU the recipe asks for, a writable run directory, disk space,
    an offscreen OpenGL (EGL) the simulator renders with, memory."""

    exit_status = 5
    kind = "machine"


class RunError(PerceptrlError, RuntimeError):
    """A run that cannot go on as it is: its checkpoints are damaged, its loss diverged, its
    rollout workers keep failing."""

    exit_status = 6
    kind = "run"


TAB = "found character '\\t' that cannot start any token"
"""PyYAML's problem text for a tab where indentation or a token should be"""


def parse_yaml(text: str, source: str) -> Any:
    """``yaml.safe_load(text)``; a syntax error is a `ConfigError` naming ``source`` (a file, or
    ``override 'key=value'``), the line and column, the offending line and the fix (a tab
    indent is named as such)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise yaml_error(e, source, text) from None


def read_yaml(path: str | Path) -> Any:
    """The YAML document in file ``path``; an unreadable file (missing, a directory, not UTF-8)
    or a syntax error is a `ConfigError` naming the file (and the line)."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.start}); save the recipe as UTF-8 YAML"
        ) from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the recipe ({e.strerror or e})") from None
    return parse_yaml(text, str(path))


def yaml_error(e: yaml.YAMLError, source: str, text: str | None = None) -> ConfigError:
    """The `ConfigError` for PyYAML's error ``e`` in ``text`` read from ``source``."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = source
    shown = ""
    if mark is not None:
        where = f"{source}, line {mark.line + 1}, column {mark.column + 1}"
        lines = (text or "").splitlines()
        if text is not None and mark.line < len(lines) and lines[mark.line].strip():
            shown = f" (the line reads {lines[mark.line].strip()!r})"
    context = getattr(e, "context", None)
    if TAB in problem or (text is not None and _tab_indented(text, mark)):
        fix = "YAML indents with spaces only: replace the tab with spaces"
        problem, context = "a tab character indents or separates this line", None
    elif source.startswith("override"):
        fix = "quote the value on the command line (key='value') or close its brackets"
    else:
        fix = "fix the YAML there (close brackets and quotes; quote values that hold ': ' or ' #')"
    detail = f"{context}: {problem}" if context else problem
    return ConfigError(f"{where}: YAML syntax error, {detail}{shown}; {fix}")


def locate_yaml_error(e: yaml.YAMLError, files: list[Path], overrides: list[str]) -> ConfigError:
    """The `ConfigError` for ``e`` (raised while some recipe or override was parsed, the source
    unknown), naming the first of ``files`` (recipes) or ``overrides`` (``key=value``) whose
    YAML does not parse; a generic one when none of them reproduces it."""
    for path in files:
        try:
            read_yaml(path)
        except ConfigError as found:
            return found
    for item in overrides:
        value = item.partition("=")[2]
        if not value.strip():
            continue
        try:
            parse_yaml(value, f"override {item!r}")
        except ConfigError as found:
            return found
    return yaml_error(e, "the recipe")


@contextlib.contextmanager
def creating(path: Path):
    """Around making directory ``path``: an OS error (a read-only or full disk, no permission,
    a file in the way) is a `MachineError` that names it."""
    try:
        yield
    except OSError as e:
        raise MachineError(
            f"cannot create the directory {path} ({e.strerror or e}); give a --run-dir, "
            "log.dir or --out on a disk you may write to"
        ) from e


def _tab_indented(text: str, mark) -> bool:
    """Whether the line at ``mark`` (or the one before it) starts with a tab."""
    if mark is None:
        return False
    lines = text.splitlines()
    return any(0 <= i < len(lines) and lines[i][:1] == "\t" for i in (mark.line, mark.line - 1))


WRITE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT})
"""OS errors that mean the machine will not let the run write (permissions, a read-only or full
disk): machine errors, not bugs"""


def render_error(e: BaseException) -> MachineError:
    """The `MachineError` for MuJoCo failing to set up offscreen OpenGL (``MUJOCO_GL``: EGL
    libraries missing, no display for glx, an unknown value), when it is imported or when a
    renderer is made."""
    gl = os.environ.get("MUJOCO_GL", "(unset)")
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return MachineError(
        f"MuJoCo cannot render offscreen with MUJOCO_GL={gl} ({type(e).__name__}: {first}). "
        "Set MUJOCO_GL=egl (the default without a display) and install the Mesa EGL libraries "
        "(`make sysdeps` on Debian/Ubuntu: libegl1, libgl1, libopengl0, libegl-mesa0)"
    )


GL_PACKAGES = ("/mujoco/rendering/", "/OpenGL/", "/glfw/")
"""where an exception raised while MuJoCo sets up OpenGL comes from"""


def explain(e: BaseException) -> PerceptrlError | None:
    """``e`` as one of these classes when another library raised it for a reason that is always
    the same (a YAML syntax error, OpenGL that MuJoCo cannot set up, a path the machine will not
    let us write, a full disk, no memory left); the error itself when it is one already; None
    otherwise (a bug)."""
    if isinstance(e, PerceptrlError):
        return e
    if isinstance(e, yaml.YAMLError):
        return yaml_error(e, "the recipe")
    if isinstance(e, (ImportError, RuntimeError, AttributeError, OSError)) and any(
        part in frame.filename for frame in traceback.extract_tb(e.__traceback__)
        for part in GL_PACKAGES
    ):  # fmt: skip
        return render_error(e)
    if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
        fix = (
            "Free disk space or give a --run-dir / log.dir on another disk; a killed run "
            "continues with perceptrl train --resume <run dir>"
            if e.errno in (errno.ENOSPC, errno.EDQUOT)
            else "Give a --run-dir / log.dir (or --out) you may write to, or fix the "
            "permissions of that path"
        )
        return MachineError(f"{e.filename or 'a file'}: {e.strerror}. {fix}")
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":  # torch's, CUDA
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return MachineError(
            f"out of memory ({type(e).__name__}: {first}). Lower train.micro_batch_size, "
            "rollout.prompts_per_step or rollout.group_size, or model.max_pixels, or set "
            "model.gradient_checkpointing=true"
        )
    return None


__all__ = [
    "ConfigError",
    "DataError",
    "MachineError",
    "ModelError",
    "PerceptrlError",
    "RunError",
    "creating",
    "explain",
    "locate_yaml_error",
    "parse_yaml",
    "read_yaml",
    "render_error",
    "yaml_error",
]
