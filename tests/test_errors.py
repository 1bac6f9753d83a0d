"""The error boundary (cli.main, errors.py): one paragraph and the exit status of its class for
every anticipated failure, the traceback and a line saying it is a bug for anything else. The
bad inputs themselves are the fault corpus's (tests/faults/)."""

from __future__ import annotations

import errno

import pytest

import perceptrl.cli as cli
from perceptrl import errors
from perceptrl.errors import (
    ConfigError,
    DataError,
    MachineError,
    ModelError,
    RunError,
    parse_yaml,
    read_yaml,
)
from perceptrl.registry import UnknownName


def _raising(monkeypatch, exc: BaseException) -> None:
    """``perceptrl config`` raises ``exc``."""

    def boom(args):
        raise exc

    monkeypatch.setattr(cli, "cmd_config", boom)


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (ConfigError("bad key\nsecond line"), 2, "config"),
        (DataError("bad line"), 3, "data"),
        (ModelError("no model"), 4, "model"),
        (MachineError("no GPU"), 5, "machine"),
        (RunError("all damaged"), 6, "run"),
        (UnknownName("unknown thing 'x'"), 2, "config"),
        (OSError(errno.ENOSPC, "No space left on device", "runs/x/metrics.jsonl"), 5, "machine"),
        (PermissionError(errno.EACCES, "Permission denied", "/runs"), 5, "machine"),
        (MemoryError(), 5, "machine"),
    ],
)
def test_each_class_is_one_paragraph_with_its_status(monkeypatch, capsys, exc, status, kind):
    _raising(monkeypatch, exc)
    assert cli.main(["config"]) == status
    err = capsys.readouterr().err
    assert err.startswith(f"perceptrl: {kind} error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_a_bug_prints_its_traceback_and_says_it_is_a_bug(monkeypatch, capsys):
    _raising(monkeypatch, KeyError("surprise"))
    assert cli.main(["config"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "KeyError: 'surprise'" in err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("perceptrl: unexpected error (KeyError). This is a bug")
    )


def test_ctrl_c_is_status_130_without_a_traceback(monkeypatch, capsys):
    _raising(monkeypatch, KeyboardInterrupt())
    assert cli.main(["config"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "--resume" in err and "Traceback" not in err


def test_the_error_classes_stay_the_builtin_errors_callers_catch():
    assert issubclass(ConfigError, ValueError) and issubclass(DataError, ValueError)
    assert issubclass(ModelError, ValueError) and issubclass(RunError, RuntimeError)
    from perceptrl.datasets.loader import DataError as LoaderDataError
    from perceptrl.schema import ConfigError as SchemaConfigError
    from perceptrl.trainer.loop import TrainingDiverged
    from perceptrl.vlm.model import ModelLoadError

    assert LoaderDataError is DataError and SchemaConfigError is ConfigError
    assert issubclass(ModelLoadError, ModelError) and issubclass(TrainingDiverged, RunError)
    assert [c.exit_status for c in (ConfigError, DataError, ModelError, MachineError, RunError)] == [
        2, 3, 4, 5, 6,
    ]  # fmt: skip


# ---- YAML: the file (or override), the line and the fix --------------------------------------


def test_a_tab_indent_names_the_file_the_line_and_the_fix(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("side: vlm\nalgo:\n\tkl_coef: 0.1\n")
    with pytest.raises(ConfigError) as err:
        read_yaml(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}, line 3, column 1: YAML syntax error, a tab character")
    assert "'kl_coef: 0.1'" in msg and "spaces only" in msg


def test_a_syntax_error_in_an_override_names_the_override():
    with pytest.raises(ConfigError, match=r"override 'x=\[1,', line 1.*quote the value"):
        parse_yaml("[1,", "override 'x=[1,'")


def test_an_unlocated_yaml_error_is_found_in_the_commands_overrides(tmp_path):
    import yaml

    try:
        yaml.safe_load("{a: 1")
    except yaml.YAMLError as e:
        found = errors.locate_yaml_error(e, [], ["train.steps=3", "rollout.reward={a: 1"])
    assert "override 'rollout.reward={a: 1'" in str(found)


def test_a_recipe_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(b"side: \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_yaml(path)


# ---- the machine -----------------------------------------------------------------------------


def test_a_renderer_mujoco_cannot_make_is_a_machine_error(monkeypatch):
    import mujoco

    from perceptrl.sim.render import make_renderer

    def no_gl(*_):
        raise mujoco.FatalError("an OpenGL platform library has not been loaded")

    monkeypatch.setattr(mujoco, "Renderer", no_gl)
    monkeypatch.setenv("MUJOCO_GL", "egl")
    with pytest.raises(MachineError, match="MUJOCO_GL=egl .*Mesa EGL libraries"):
        make_renderer(None, 8, 8)


def test_a_gpu_that_is_not_there_is_a_machine_error():
    import torch

    from perceptrl.trainer.runtime import resolve_device

    if torch.cuda.is_available():
        with pytest.raises(MachineError, match="cuda:999"):
            resolve_device("cuda:999")
    else:
        with pytest.raises(MachineError, match="train.device=cpu"):
            resolve_device("cuda")
    assert resolve_device("cpu").type == "cpu"
