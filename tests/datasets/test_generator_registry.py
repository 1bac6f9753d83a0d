"""Generators registered from user code: a module outside perceptrl, accepted by
``data.generator`` once registered, and a taken name refused."""

from __future__ import annotations

import json

import pytest

from perceptrl.datasets.registry import GENERATORS, Generator, get_generator, register_generator
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


def reasoning_trace(sample):
    return f"<answer>{sample['answer']}</answer>"
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_gen_mod.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_gen_mod"
    GENERATORS.pop("user_gen", None)


def test_a_registered_generator_is_a_valid_data_generator(user_module, tmp_path):
    with pytest.raises(ConfigError, match="data.generator='user_gen'"):
        load_config(None, ["data.generator=user_gen"])
    gen = register_generator(Generator("user_gen", user_module, "image", "one family"))
    assert register_generator(gen) is gen  # the same entry again: nothing happens
    assert load_config(None, ["data.generator=user_gen"]).data.generator == "user_gen"
    paths = get_generator("user_gen").generate(tmp_path / "out", {"train": 2, "val": 0}, seed=5)
    assert set(paths) == {"train"}
    rows = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["5", "6"]
    assert gen.reasoning_trace(rows[0]) == "<answer>5</answer>"
    with pytest.raises(ValueError, match="'clevr' is already registered"):
        register_generator(Generator("clevr", user_module, "image", "not clevr"))
    assert get_generator("clevr").load().__name__ == "perceptrl.datasets.clevr"
