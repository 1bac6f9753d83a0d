"""The package installs as a plain wheel (not only editable) and every subpackage imports."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["trainer", "vlm", "vla", "sim", "rewards", "datasets"]


def _subpackages() -> list[str]:
    """Every folder of the layout that holds code today (folders without code hold nothing)."""
    return [p for p in PACKAGES if any((ROOT / p).glob("*.py"))]


def test_wheel_installs_and_imports_every_subpackage(tmp_path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheel_dir),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = wheel_dir.glob("perceptrl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "perceptrl/cli.py" in names and not any(
        n.startswith(("perceptrl/tests/", "tests/")) for n in names
    )
    assert any(n.startswith("perceptrl/configs/") and n.endswith(".yaml") for n in names)
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
    )
    modules = [
        f"perceptrl.{p}.{m.stem}"
        for p in _subpackages()
        for m in (ROOT / p).glob("*.py")
        if m.stem != "__init__"
    ]
    code = (
        "import importlib, perceptrl, pathlib, sys\n"
        f"assert pathlib.Path(perceptrl.__file__).is_relative_to({str(target)!r}), perceptrl.__file__\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "import perceptrl.cli; perceptrl.cli.build_parser()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]


def test_datasets_folder_never_shadows_the_hf_datasets_library(tmp_path):
    """Run from the repo root (where ``datasets/`` is importable by name): a regular package
    named ``datasets`` later on the path (as HF's is in site-packages) must still win."""
    fake = tmp_path / "site" / "datasets"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("HF = True\n")
    code = "import datasets; assert getattr(datasets, 'HF', False), datasets.__path__"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def test_layout_rules():
    """datasets/ stays a namespace package; trainer/ never imports a side."""
    assert not (ROOT / "datasets" / "__init__.py").exists()
    for f in (ROOT / "trainer").glob("*.py"):
        text = f.read_text()
        for side in ("vlm", "vla", "sim", "datasets"):
            assert f"from ..{side}" not in text and f"perceptrl.{side}" not in text, (f.name, side)


def test_cli_help_lists_only_real_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "perceptrl.cli", "--help"], capture_output=True, text=True, cwd="/"
    )
    assert out.returncode == 0
    from perceptrl.cli import build_parser

    def commands(parser, prefix=""):
        for name, sub in parser._subparsers._group_actions[0].choices.items():
            if sub._subparsers is not None:
                yield from commands(sub, f"{prefix}{name} ")
            else:
                yield f"{prefix}{name}", sub

    for name, sub in commands(build_parser()):
        assert name.split()[0] in out.stdout
        assert sub.get_default("func") is not None, f"subcommand {name} does nothing"
