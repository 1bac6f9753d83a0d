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


USER_MODULE = """
import torch

from perceptrl.registry import ADVANTAGES


@ADVANTAGES.register("median_baseline")
def median_baseline(inp, cfg):
    r = inp.rewards.float()
    adv = torch.zeros_like(r)
    for g in inp.group_id.unique():
        rows = inp.group_id == g
        adv[rows] = r[rows] - r[rows].median()
    adv = adv[:, None] * inp.mask
    return adv, adv, {}
"""


def test_a_recipe_imports_the_users_registrations_for_the_command(tmp_path):
    """``imports`` names modules the ``perceptrl`` command imports before it checks the recipe's
    names, so a user's registered estimator runs from the command line, and its run resumes."""
    import os
    import subprocess
    import sys

    (tmp_path / "my_estimators.py").write_text(USER_MODULE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    tiny = ["data.n_train=4", "data.n_val=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=8", "train.eval_every=0", "train.eval_samples=2",
            "algo.dynamic_sampling=false", "log.progress=false", "log.tensorboard=false",
            "algo.adv_estimator=median_baseline"]  # fmt: skip

    def perceptrl(*args):
        cmd = [sys.executable, "-m", "perceptrl.cli", *args]
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)

    without = perceptrl("config", "vlm_clevr", *tiny)
    assert without.returncode == 2 and "median_baseline" in without.stderr
    out = perceptrl("train", "vlm_clevr", *tiny, "imports=[my_estimators]", "train.steps=1",
                    "--run-dir", "run")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "my_estimators" in (tmp_path / "run" / "config.yaml").read_text()
