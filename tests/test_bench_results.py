"""The benchmark suite's bookkeeping: every committed result says what produced it, every
benchmark script is reachable from a make target, and the docs cite result files that exist."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
RESULT_FILES = sorted(
    [*(BENCH / "results").glob("**/*.json"), *(REPO / "assets" / "build").glob("*.json")]
)
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GPU_LANE = re.compile(r"bench/results/gpu_")
"""results only a GPU machine writes (`make gpu-lane`): cited before the lane has run"""


def common():
    """bench/common.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def recipe_lines() -> str:
    """The Makefile's recipe lines (those of its targets), joined."""
    return "\n".join(
        line for line in (REPO / "Makefile").read_text().splitlines() if line.startswith("\t")
    )


def expand(path: str) -> list[str]:
    """``a/{b,c}.md`` -> ``a/b.md``, ``a/c.md`` (shell-style braces, as the docs write them)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_result_records_its_provenance(path):
    prov = json.loads(path.read_text()).get("provenance")
    assert isinstance(prov, dict), f"{path.name}: no provenance"
    assert str(prov.get("command", "")).startswith("python "), prov.get("command")
    assert re.fullmatch(r"[0-9a-f]{40}", prov.get("commit") or ""), prov.get("commit")
    assert isinstance(prov.get("machine"), dict) and prov["machine"], "no machine"
    assert "seeds" in prov and "date" in prov
    for text in (prov["command"], json.dumps(prov.get("rows", {}))):
        assert not re.search(r"(^|[\s=])/(tmp|work|home|root|Users)/", text), text


def test_results_have_no_local_paths():
    for path in RESULT_FILES:
        text = path.read_text() + (
            path.with_suffix(".md").read_text() if path.with_suffix(".md").exists() else ""
        )
        assert not re.search(r"(^|[\s\"'=])/(tmp|work|home|root|Users)/", text), path.name


def test_every_script_is_reachable_from_make():
    recipes = recipe_lines()
    scripts = [p for p in BENCH.glob("*.py") if p.name != "common.py"]
    builders = sorted((REPO / "assets" / "build").glob("*.py"))
    assert scripts and builders
    missing = [str(p.relative_to(REPO)) for p in [*scripts, *builders]
               if str(p.relative_to(REPO)) not in recipes]  # fmt: skip
    assert not missing, f"named in no make target: {missing}"


def test_every_benchmark_states_its_question():
    for path in sorted(BENCH.glob("bench_*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = doc.splitlines()[0] if doc else ""
        assert first.endswith("?"), f"{path.name}: the docstring's first line is not a question"


def test_docs_cite_result_files_that_exist():
    missing = []
    for doc in DOCS:
        for m in re.finditer(r"bench/results/[\w./{},\-]*", doc.read_text()):
            cited = m.group(0).rstrip(".,")
            if GPU_LANE.match(cited) or "<" in cited:
                continue
            missing += [f"{doc.name}: {p}" for p in expand(cited) if not (REPO / p).exists()]
    assert not missing, "cited but missing:\n" + "\n".join(missing)


def test_write_results_records_provenance(tmp_path, monkeypatch):
    mod = common()
    monkeypatch.setattr(mod, "RESULTS", tmp_path)
    monkeypatch.setattr(
        mod.sys, "argv", [str(BENCH / "bench_sim.py"), "--out", str(tmp_path / "run"), "--n", "2"]
    )
    js, md = mod.write_results("x", {"figure": 1.5}, "# X\n\nA table.", seeds=[0, 1])
    assert (js, md) == (tmp_path / "x.json", tmp_path / "x.md")
    data = json.loads(js.read_text())
    prov = data["provenance"]
    assert data["figure"] == 1.5
    assert prov["command"] == "python bench/bench_sim.py --out '<outside>/run' --n 2"
    if (REPO / ".git").exists():  # a copy of the checkout without git records no commit
        assert re.fullmatch(r"[0-9a-f]{40}", prov["commit"]) and isinstance(prov["dirty"], bool)
        assert prov["commit"][:12] in md.read_text()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", prov["date"])
    assert prov["machine"]["cores"] and "torch" in prov["machine"]
    assert prov["seeds"] == [0, 1] and prov["wall_s"] >= 0
    lines = md.read_text().splitlines()
    assert lines[0] == "# X" and lines[-1].startswith("Provenance (recorded): `python bench/")


def test_write_results_keeps_provenance_on_a_rewrite(tmp_path, monkeypatch):
    mod = common()
    monkeypatch.setattr(mod, "RESULTS", tmp_path)
    earlier = {"command": "python bench/bench_vla.py", "commit": "a" * 40, "seeds": [0]}
    mod.write_results("y", {"provenance": dict(earlier)}, "# Y", seeds=[0], keep_provenance=True)
    assert json.loads((tmp_path / "y.json").read_text())["provenance"] == earlier
    with pytest.raises(TypeError):
        mod.write_results("z", {}, "# Z")  # seeds is required


def test_write_results_uses_the_machine_the_result_names(tmp_path, monkeypatch):
    mod = common()
    monkeypatch.setattr(mod, "RESULTS", tmp_path)
    mod.write_results("m", {"machine": {"cpu": "test cpu", "cores": 2}}, "# M", seeds=[])
    prov = json.loads((tmp_path / "m.json").read_text())["provenance"]
    assert prov["machine"] == {"cpu": "test cpu", "cores": 2}
    assert "test cpu, 2 cores" in (tmp_path / "m.md").read_text()
