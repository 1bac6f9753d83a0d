"""The side table: a side added from user code after import is a valid ``side`` of a recipe,
and its module (any importable module) is what `side` returns."""

from __future__ import annotations

import pytest

from perceptrl import wiring
from perceptrl.trainer.config import ConfigError
from perceptrl.wiring import SIDES, load_config, side


def test_builtin_sides_resolve_to_their_modules():
    for name, module in (("vlm", "vlm.run"), ("vla", "vla.run"), ("plan", "vla.plan")):
        assert side(load_config(None, [f"side={name}"])).__name__ == f"perceptrl.{module}"


def test_a_side_added_later_is_accepted_and_imported(tmp_path, monkeypatch):
    (tmp_path / "my_side_pkg").mkdir()
    (tmp_path / "my_side_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_side_pkg" / "side.py").write_text(
        "def build_trainer(cfg, run_dir):\n    return 'built'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="side='mine'.*valid: vlm, vla, plan"):
        load_config(None, ["side=mine"])
    monkeypatch.setitem(SIDES, "mine", "my_side_pkg.side")  # registered after wiring's import
    cfg = load_config(None, ["side=mine"])
    assert cfg.side == "mine"
    assert side(cfg).build_trainer(cfg, tmp_path) == "built"
    with pytest.raises(ConfigError, match="valid: vlm, vla, plan, mine"):
        load_config(None, ["side=yours"])
    assert wiring.Config().side == "vlm"
