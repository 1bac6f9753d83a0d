"""The package installs as a plain wheel (not only editable): every subpackage imports, and in a
clean venv the installed command prints a recipe and runs the demo's first steps."""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["trainer", "vlm", "vla", "sim", "rewards", "datasets"]


def _subpackages() -> list[str]:
    """Every folder of the layout that holds code today (folders without code hold nothing)."""
    return [p for p in PACKAGES if any((ROOT / p).glob("*.py"))]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The package built as a plain wheel from the repo (once for this module)."""
    wheel_dir = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheel_dir), str(ROOT)],
        check=True,
    )  # fmt: skip
    (path,) = wheel_dir.glob("perceptrl-*.whl")
    return path


def test_wheel_installs_and_imports_every_subpackage(tmp_path, wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "perceptrl/cli.py" in names and not any(
        n.startswith(("perceptrl/tests/", "tests/", "perceptrl/bench/", "perceptrl/assets/build/"))
        for n in names
    )
    assert any(n.startswith("perceptrl/configs/") and n.endswith(".yaml") for n in names)
    for page in ("page.html", "view.css", "view.js"):  # `perceptrl view`'s page
        assert f"perceptrl/trainer/view_page/{page}" in names, page
    for base in ("vlm_base", "vlm_demo_base", "vlm_plan_base"):
        assert f"perceptrl/assets/{base}/model.safetensors" in names, base
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True,
    )  # fmt: skip
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
        "from perceptrl.trainer.viewer import render\n"
        "render({'run': 'r', 'metrics': {'steps': [], 'series': {}}, 'records': [], 'findings': []})\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]


def test_wheel_in_a_clean_venv_runs_config_and_the_demo(tmp_path, wheel):
    """A new venv that holds only the wheel (its dependencies reached through a path entry to
    this environment's site-packages, whose editable install of the repo is not activated):
    the installed `perceptrl` command prints a shipped recipe and runs the demo's first steps,
    from a directory outside the repo, with the models and recipes the wheel ships."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([py, "-c", purelib], capture_output=True, text=True, check=True)
    deps = sysconfig.get_paths()["purelib"]
    # a plain path line: .pth files inside `deps` (the repo's editable finder) are not processed
    (Path(site.stdout.strip()) / "dependencies.pth").write_text(deps + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
         str(wheel)],
        check=True,
    )  # fmt: skip
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    where = subprocess.run(
        [py, "-c", "import perceptrl; print(perceptrl.__file__)"],
        cwd=cwd, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    exe = venv / "bin" / "perceptrl"
    out = subprocess.run([exe, "config", "vlm_clevr"], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "algo.adv_estimator = 'grpo'" in out.stdout
    demo = [
        exe, "demo", "--out", "demo", "--steps", "1", "--test-questions", "4", "--vla-steps", "1",
        "data.n_train=8", "data.n_val=4", "train.eval_samples=4", "rollout.prompts_per_step=2",
    ]  # fmt: skip
    env = {**os.environ, "MUJOCO_GL": "egl", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(demo, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    result = json.loads((cwd / "demo" / "demo.json").read_text())
    assert result["vlm_grpo"]["steps"] == 1 and result["vla_ppo_reach"]["steps"] == 1


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


def test_datasets_stays_a_namespace_package():
    """datasets/ has no __init__.py, so running from the repo root never shadows HF datasets
    (the import directions are checked from the import graph in tests/test_layout.py)."""
    assert not (ROOT / "datasets" / "__init__.py").exists()


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
