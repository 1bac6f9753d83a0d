"""The sides: each built-in side registers its `Side` record from its own module, `side` returns
the record a recipe names, and a side registered from user code after import is a valid
``side`` of a recipe."""

from __future__ import annotations

import pytest

from perceptrl import wiring
from perceptrl.registry import SIDES, Side
from perceptrl.trainer.config import ConfigError
from perceptrl.wiring import load_config, side, sides_with


def test_builtin_sides_are_the_records_their_modules_register():
    for name, module, rules in (
        ("vlm", "vlm.builder", []),
        ("vla", "vla.builder", []),
        ("plan", "vla.plan_builder", ["rollout.episode.env=plan"]),  # the plan side's own rule
    ):
        record = side(load_config(None, [f"side={name}", *rules]))
        assert isinstance(record, Side)
        assert record.build_trainer.__module__ == f"perceptrl.{module}"
        assert record.run_eval.__module__ == f"perceptrl.{module}"


def test_a_record_says_which_commands_its_side_supports():
    assert sides_with("run_sft") == ["plan", "vla", "vlm"]
    assert sides_with("run_pass_k") == ["plan", "vlm"]
    assert sides_with("run_compare") == ["plan", "vla"]


def test_a_side_added_later_is_accepted_and_used():
    with pytest.raises(ConfigError, match="side='mine'.*valid: plan, vla, vlm"):
        load_config(None, ["side=mine"])
    record = Side(build_trainer=lambda cfg, run_dir: "built", run_eval=lambda *a, **k: {})
    SIDES.register("mine", record)  # registered after wiring's import
    try:
        cfg = load_config(None, ["side=mine"])
        assert cfg.side == "mine"
        assert side(cfg) is record and side(cfg).build_trainer(cfg, None) == "built"
        assert "mine" not in sides_with("run_sft")  # a command it does not support
        with pytest.raises(ConfigError, match="valid: mine, plan, vla, vlm"):
            load_config(None, ["side=yours"])
    finally:
        SIDES.unregister("mine")
    assert wiring.Config().side == "vlm"


def test_a_command_the_side_does_not_support_names_the_sides_that_do(tmp_path, capsys):
    from perceptrl.cli import main

    SIDES.register("mine", Side(build_trainer=lambda cfg, run_dir: None, run_eval=dict))
    try:
        args = ["sft", "side=mine", "--run-dir", str(tmp_path / "run")]
        assert main(args) == 2
        assert "side mine has no supervised warm start; sides with one: plan, vla, vlm" in (
            capsys.readouterr().err
        )
        args = ["eval", "side=mine", "--model", "x", "--pass-k", "1,2", "--out", str(tmp_path)]
        assert main(args) == 2
        assert "--pass-k evaluates recipes of side plan | vlm" in capsys.readouterr().err
    finally:
        SIDES.unregister("mine")
