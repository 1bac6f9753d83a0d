"""The one option mechanism (`perceptrl.schema`): what it checks, and that the recipe loader and
the simulator use the same one."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from perceptrl import schema
from perceptrl.schema import ConfigError, choice, from_dict


@dataclass(frozen=True)
class Inner:
    mode: str = choice("a", ("a", "b"))
    """a choice"""
    names: tuple[str, ...] = ("x",)
    """a tuple of any length"""


@dataclass
class Outer:
    rate: float = 0.1
    steps: int = 1
    inner: Inner = field(default_factory=Inner)
    tags: list[str] = field(default_factory=list)
    path: str | None = None


def test_types_choices_tuples_and_nesting_are_checked():
    cfg = from_dict(Outer, {"rate": 1, "inner": {"mode": "b", "names": ["p", "q"]}}, where="")
    assert cfg.rate == 1.0 and isinstance(cfg.rate, float)
    assert cfg.inner == Inner("b", ("p", "q"))
    with pytest.raises(ConfigError, match=r"inner.mode='c' is not a valid value \(valid: a, b\)"):
        from_dict(Outer, {"inner": {"mode": "c"}}, where="")
    with pytest.raises(ConfigError, match="steps: expected int, got float"):
        from_dict(Outer, {"steps": 1.5}, where="")
    with pytest.raises(ConfigError, match=r"inner.names\[1\]: expected str"):
        from_dict(Outer, {"inner": {"names": ["p", None]}}, where="")
    with pytest.raises(ConfigError, match="did you mean 'inner.mode'"):
        from_dict(Outer, {"inner": {"mdoe": "a"}}, where="")


def test_the_recipe_loader_and_the_simulator_share_the_mechanism():
    from perceptrl.sim.env import ManipEnvConfig
    from perceptrl.trainer import config

    for name in ("ConfigError", "choice", "choices", "from_dict", "all_keys", "leaf_fields"):
        assert getattr(config, name) is getattr(schema, name)
    assert schema.choices(next(f for f in schema.leaf_fields(ManipEnvConfig)
                               if f[0] == "control")[1]) == ["ee", "joint"]  # fmt: skip
    with pytest.raises(ConfigError, match="ManipEnv.control='delta'"):
        from_dict(ManipEnvConfig, {"control": "delta"}, where="ManipEnv")


def test_check_sections_runs_every_sections_rules_with_the_whole_config():
    from dataclasses import dataclass, field

    from perceptrl.schema import ConfigError, check_sections

    calls = []

    @dataclass
    class Inner:
        n: int = 1

        def check(self, root):
            calls.append(("inner", root.limit))
            if self.n > root.limit:
                raise ConfigError(f"inner.n={self.n} exceeds limit={root.limit}; lower inner.n")

    @dataclass
    class Root:
        limit: int = 2
        inner: Inner = field(default_factory=Inner)

        def check(self, root):
            calls.append(("root", root is self))

    check_sections(Root())
    assert calls == [("inner", 2), ("root", True)]  # children first, then the section above
    with pytest.raises(ConfigError, match="inner.n=3 exceeds limit=2"):
        check_sections(Root(inner=Inner(n=3)))
