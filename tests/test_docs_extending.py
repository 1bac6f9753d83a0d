"""docs/extending.md runs: every ``## section``'s ```python blocks, in order, in one fresh module.

The sections run in one subprocess (so their registrations never reach the other tests' registries
and torch is imported once), each as its own module in ``sys.modules`` (an example may name
itself, ``__name__``, as the module of a side or a generator) with its own working directory. A
traceback names the guide's own line numbers. Only fences whose info string is exactly
``python`` run; the guide has no other kind of Python fence.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
EXTENSION_POINTS = (
    "Advantage estimator",
    "Policy loss",
    "Rollout correction",
    "Reward",
    "Step reward",
    "Tool",
    "Episode environment",
    "Sim task",
    "Data generator",
    "Side",
)
"""Sections the guide must hold (each title starts with one of these), one per extension point."""

_FENCE = re.compile(r"^```(.*)$")


def sections(text: str) -> dict[str, str]:
    """``## title`` -> the section's ```python blocks as one source, each block's lines at their
    line numbers in the guide (blank lines elsewhere), so tracebacks point into the guide."""
    lines = text.splitlines()
    out: dict[str, list[str]] = {}
    title, fence = None, None
    for i, line in enumerate(lines):
        m = _FENCE.match(line)
        if fence is not None:
            if m is not None and not m.group(1).strip():
                fence = None
            elif fence == "python" and title is not None:
                out[title][i] = line
            continue
        if m is not None:
            fence = m.group(1).strip()
            continue
        if line.startswith("## "):
            title = line[3:].strip()
            out[title] = [""] * len(lines)
    return {t: "\n".join(src) for t, src in out.items() if any(s.strip() for s in src)}


def python_fences(text: str) -> list[str]:
    """Info strings of every fence that starts with ``python``."""
    return [m.group(1).strip() for m in map(_FENCE.match, text.splitlines())
            if m is not None and m.group(1).strip().startswith("python")]  # fmt: skip


def module_name(title: str) -> str:
    return "extending_" + re.sub(r"\W+", "_", title.lower()).strip("_")


def run_all(guide: Path, workdir: Path) -> dict[str, str | None]:
    """Run every section (in this process); title -> None when it ran, else its traceback."""
    import types

    import torch  # noqa: F401  (before anything renders: see the design's environment facts)

    results: dict[str, str | None] = {}
    for title, source in sections(guide.read_text()).items():
        name = module_name(title)
        module = types.ModuleType(name)
        module.__file__ = str(guide)
        sys.modules[name] = module
        cwd = workdir / name
        cwd.mkdir(parents=True, exist_ok=True)
        os.chdir(cwd)
        try:
            exec(compile(source, str(guide), "exec"), module.__dict__)
            results[title] = None
        except BaseException:  # noqa: BLE001 - reported per section
            results[title] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, str | None]:
    work = tmp_path_factory.mktemp("extending")
    out = work / "results.json"
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    proc = subprocess.run(
        [sys.executable, __file__, str(GUIDE), str(work), str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_guide_has_a_section_per_extension_point():
    titles = list(sections(GUIDE.read_text()))
    for point in EXTENSION_POINTS:
        assert any(t.startswith(point) for t in titles), f"no runnable section for {point!r}"
    assert set(python_fences(GUIDE.read_text())) == {"python"}, "a Python fence that never runs"


@pytest.mark.parametrize("title", list(sections(GUIDE.read_text())))
def test_section_runs(results, title):
    assert title in results, f"section {title!r} did not run"
    assert results[title] is None, (
        f"section {title!r} of docs/extending.md failed:\n{results[title]}"
    )


if __name__ == "__main__":
    guide, work, out = (Path(a) for a in sys.argv[1:4])
    Path(out).write_text(json.dumps(run_all(guide, work)))
