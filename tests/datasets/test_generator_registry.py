"""Generators registered from user code: a module outside perceptrl, accepted by
``data.generator`` once registered, a taken name refused, and a trace of another signature
named."""

from __future__ import annotations

import json

import pytest

from perceptrl.datasets.registry import Generator
from perceptrl.registry import GENERATORS
from perceptrl.trainer.config import ConfigError
from perceptrl.wiring import load_config

MODULE = """
import json
from pathlib import Path

FAMILIES = ("one",)


def generate(out_dir, splits, families, seed=0):
    out = {}
    for split, n in splits.items():
        path = Path(out_dir) / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"id": f"{split}-{i}", "family": "one", "answer": str(seed + i)} for i in range(n)]
        path.write_text("".join(json.dumps(r) + "\\n" for r in rows))
        out[split] = path
    return out


def reasoning_trace(sample, tools=()):
    return f"<answer>{sample['answer']}</answer>"
"""

OLD_TRACE = """
FAMILIES = ("one",)


def reasoning_trace(sample):
    return "<answer>1</answer>"
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_gen_mod.py").write_text(MODULE)
    (tmp_path / "user_gen_old.py").write_text(OLD_TRACE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_gen_mod"
    GENERATORS.unregister("user_gen")
    GENERATORS.unregister("user_gen_old")


def test_a_registered_generator_is_a_valid_data_generator(user_module, tmp_path):
    with pytest.raises(ConfigError, match="data.generator='user_gen'"):
        load_config(None, ["data.generator=user_gen"])
    gen = GENERATORS.register("user_gen", Generator("user_gen", user_module, "image", "one"))
    assert GENERATORS.register("user_gen", gen) is gen  # the same entry again: nothing happens
    assert load_config(None, ["data.generator=user_gen"]).data.generator == "user_gen"
    paths = GENERATORS.get("user_gen").generate(tmp_path / "out", {"train": 2, "val": 0}, seed=5)
    assert set(paths) == {"train"}
    rows = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["5", "6"]
    assert gen.reasoning_trace(rows[0]) == "<answer>5</answer>"
    with pytest.raises(ValueError, match="'clevr' is already registered"):
        GENERATORS.register("clevr", Generator("clevr", user_module, "image", "not clevr"))
    assert GENERATORS.get("clevr").load().__name__ == "perceptrl.datasets.clevr"
    old = GENERATORS.register(
        "user_gen_old", Generator("user_gen_old", "user_gen_old", "image", "")
    )
    with pytest.raises(ValueError, match=r"reasoning_trace must take \(sample, tools=\(\)\)"):
        old.reasoning_trace({})
