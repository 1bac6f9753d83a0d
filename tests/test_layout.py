"""The import graph, computed from the code: no circles, and every arrow between the package's
folders points the way the architecture allows (docs/architecture.md, "Dependency direction").

Every ``import`` statement counts, at module level or inside a function, since a deferred import
is still a dependency. A folder is a room (``trainer``, ``vlm`` ...); a module at the package's
root is a room of its own (``registry``, ``wiring``, ``cli`` ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = {"tests", "bench", "assets", "build", "docs", "configs"}
"""folders that are not part of the package's code"""

ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "registry": set(),
    "schema": {"errors"},
    "rewards": {"errors", "registry"},
    "sim": {"errors", "registry", "schema"},
    "datasets": {"errors", "registry", "sim"},
    "trainer": {"errors", "registry", "schema"},
    "vlm": {"errors", "registry", "trainer", "rewards", "datasets"},
    "vla": {"errors", "registry", "trainer", "rewards", "datasets", "sim", "vlm"},
}
"""room -> the rooms it may import. The error classes (``errors.py``) are below everything, so
every layer may raise them. The trainer knows no side, no simulator and no data; rewards and
datasets know no model code; the simulator knows no trainer; the VLM side knows no VLA side; the
VLA side (and the planner in it) builds on both. Rooms above these (the wiring, the demo, the
command line) may import any room below them but no room imports them."""
TOP = ("wiring", "demo", "inspection", "cli")
"""the composition rooms, from lowest to highest: each may import the rooms before it"""


def _modules() -> dict[str, Path]:
    """Module name (``perceptrl.vlm.builder``) -> file, for the package's code."""
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in OUTSIDE or rel.parts[0].startswith("."):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(["perceptrl", *parts])] = path
    return out


def _targets(module: str, path: Path, node: ast.AST, known: dict) -> set[str]:
    """The package modules an import statement of ``module`` loads."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
        stem = ".".join(p for p in (base, node.module or "") if p)
        names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
    found = set()
    for name in names:
        while (
            name and name not in known
        ):  # `import perceptrl.vlm.builder` loads perceptrl.vlm.builder
            name = name.rpartition(".")[0]
        if name.startswith("perceptrl"):
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    graph = {}
    for module, path in known.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= _targets(module, path, node, known)
        graph[module] = deps - {module, "perceptrl"}
    return graph


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "perceptrl"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "modules that import each other (directly or around a loop): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_every_arrow_points_the_allowed_way():
    allowed = {r: set(deps) for r, deps in ALLOWED.items()}
    below = set(ALLOWED)
    for r in TOP:
        allowed[r] = set(below)
        below.add(r)
    bad = set()
    for module, deps in import_graph().items():
        a = room(module)
        if a == "perceptrl":  # the package's __init__
            continue
        assert a in allowed, f"{module}: room {a!r} has no rule here; add it to ALLOWED or TOP"
        bad |= {(module, d) for d in deps if room(d) != a and room(d) not in allowed[a]}
    assert not bad, "imports against the architecture's direction: " + "; ".join(
        f"{m} -> {d}" for m, d in sorted(bad)
    )


MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 60
"""the house style's readable sizes, held for the package's code"""


def test_files_and_functions_stay_readable():
    long = []
    for module, path in _modules().items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            long.append(f"{module}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {n} lines")
    assert not long, (
        f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function: {long}"
    )
