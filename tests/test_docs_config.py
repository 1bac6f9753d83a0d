"""docs/config.md is the configuration reference generated from the config dataclasses and the
registries: it must match the code, cover every key the shipped recipes use, and the fields' help
must not list by hand names that a registry supplies."""

import difflib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from perceptrl.registry import SIDES
from perceptrl.trainer.config import all_keys, choices, describe, leaf_fields, valid_values
from perceptrl.wiring import REFERENCE_COMMAND, REGISTRIES, Config, reference

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "config.md"
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.fixture(scope="module")
def text() -> str:
    """The reference as the command prints it, in a fresh process: other tests register names of
    their own (tools, rewards) that the page must not list."""
    out = subprocess.run(
        [sys.executable, "-m", "perceptrl.cli", "config", "--reference"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_committed_reference_matches_the_code(text):
    committed = DOC.read_text() if DOC.exists() else ""
    if committed != text:
        diff = "".join(
            list(
                difflib.unified_diff(
                    committed.splitlines(True), text.splitlines(True),
                    "docs/config.md (committed)", "generated", n=1,
                )
            )[:60]
        )  # fmt: skip
        pytest.fail(
            f"docs/config.md is out of date with the config dataclasses or the registries; "
            f"regenerate it with `{REFERENCE_COMMAND}` and commit it.\n{diff}"
        )


def test_perceptrl_config_reference_prints_it(capsys):
    from perceptrl.cli import main

    assert main(["config", "--reference"]) == 0
    assert capsys.readouterr().out == reference()
    assert main(["config", "vlm_demo", "--reference"]) == 2  # the reference takes no recipe


def test_reference_is_machine_independent(text):
    for place in {str(ROOT), str(Path.home()), "/tmp/"}:
        assert place not in text, place
    assert REFERENCE_COMMAND in text


def _recipe_keys(raw: dict, leaves: set[str], prefix: str = ""):
    """Dotted keys a recipe sets: a config leaf's value (a mapping too) is not descended into."""
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if dotted in leaves or not isinstance(value, dict):
            yield dotted
        else:
            yield from _recipe_keys(value, leaves, dotted + ".")


def test_every_key_has_a_row(text):
    rows = set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))
    assert rows == set(all_keys(Config))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_key_of_a_shipped_recipe_is_in_the_reference(recipe, text):
    leaves = set(all_keys(Config))
    raw = yaml.safe_load(recipe.read_text()) or {}
    missing = [k for k in _recipe_keys(raw, leaves) if f"| `{k}` |" not in text]
    assert not missing, f"{recipe.name}: keys without a row in the reference: {missing}"


def _help_by_key():
    """(dotted key, dataclass field, help) of every leaf field of `Config`."""
    helps = {key: help_ for key, _, _, help_ in describe(Config)}
    return [(key, f, helps[key]) for key, f, _ in leaf_fields(Config)]


def test_registries_name_real_keys_and_agree_with_choice_fields():
    keys = dict((k, f) for k, f, _ in _help_by_key())
    for reg in REGISTRIES:
        for key in reg.keys:
            assert key in keys, (reg.title, key)
            valid = choices(keys[key])
            if valid is not None:
                assert sorted(map(str, valid)) == sorted(map(str, reg.names())), (reg.title, key)


def test_help_lists_no_names_that_a_registry_supplies():
    """A help's ``a | b | c`` list is the valid values: only a fixed tuple may be spelt out (all
    of it, nothing else); names a registry supplies are printed from the registry instead."""
    registry_keys = {k for reg in REGISTRIES for k in reg.keys}
    bad = []
    for key, f, help_ in _help_by_key():
        spec = f.metadata.get("choices")
        listed = re.findall(r"\| +([\w.+:-]+)", help_)
        if not listed:
            continue
        if callable(spec) or key in registry_keys:
            bad.append(f"{key}: lists registry names by hand ({help_!r})")
        elif spec is not None:
            valid = [str(v) for v in choices(f)]
            names = [n.rstrip(":") for n in listed]
            if not set(names) <= set(valid) or len(names) + 1 != len(valid):
                bad.append(f"{key}: help lists {names} (after the first), valid: {valid}")
    assert not bad, "\n".join(bad)


def test_valid_values_are_sorted_for_registries():
    valid = valid_values(Config, REGISTRIES)
    assert valid["algo.adv_estimator"].names == sorted(valid["algo.adv_estimator"].names)
    assert {"treepo", "treerl", "prime"} <= set(valid["algo.adv_estimator"].names)
    assert "plan" in valid["rollout.episode.env"].names  # registered by the plan side's module
    assert valid["model.dtype"].names == ["float32", "bfloat16", "float16"]  # a fixed tuple
    assert SIDES.names() == valid["side"].names


def test_rendering_of_a_toy_config():
    """Sections in field order, nested ones as subsections; Markdown-safe cells; a default read
    from the machine is written as its field's placeholder."""
    from dataclasses import dataclass, field

    from perceptrl.trainer import config as tc

    @dataclass
    class Inner:
        mode: str = tc.choice("a", ("a", "b"))
        """a | b: the <mode>"""

    @dataclass
    class Section:
        workers: int = field(default=7, metadata={"reference_default": "<cpu count>"})
        """read from the machine"""
        inner: Inner = field(default_factory=Inner)
        """nested"""

    @dataclass
    class Root:
        top: str = "x"
        """a leaf at the top"""
        section: Section = field(default_factory=Section)

    names = tc.Registry("Things", "`here`", ("section.inner.mode",), lambda: ["b", "a"])
    text = tc.reference(Root, [names], intro="Intro.")
    assert text.index("## top") < text.index("## section") < text.index("### section.inner")
    assert "| `section.workers` | `int` | `<cpu count>` | read from the machine |  |" in text
    assert "| `section.inner.mode` | `str` | `a` | a \\| b: the \\<mode> | `a`, `b` |" in text
    assert text.endswith("### Things\n\n`here`; read by `section.inner.mode`.\n\n`a`, `b`\n")
