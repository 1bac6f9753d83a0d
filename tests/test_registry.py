"""The one registry mechanism: register with declared needs, look up, list, and name errors."""

import json

import pytest

from perceptrl.registry import Registry, UnknownName


def test_register_lookup_and_declared_meta():
    r = Registry("thing", "x.thing")

    @r.register("alpha", needs=("values",))
    def alpha():
        return 1

    r.register("beta", object(), per_step=True)
    assert r.names() == ["alpha", "beta"] and "alpha" in r and len(r) == 2
    assert r.get("alpha") is alpha and r.meta("alpha")["needs"] == ("values",)
    assert r.meta("beta")["per_step"] is True
    with pytest.raises(TypeError):
        r.meta("alpha")["needs"] = ()  # declarations are read-only


def test_unknown_name_lists_valid_names_and_the_nearest():
    r = Registry("thing", "x.thing")
    r.register("gamma", object())
    with pytest.raises(
        UnknownName, match=r"unknown thing 'gama' \(x.thing\); did you mean 'gamma'"
    ):
        r.get("gama")


def test_same_function_again_is_a_no_op_another_one_raises():
    r = Registry("thing")

    def f():
        pass

    r.register("f", f)
    r.register("f", f)

    def g():
        pass

    with pytest.raises(ValueError, match="already registered"):
        r.register("f", g)
    for bad in ("", "a:b"):
        with pytest.raises(ValueError, match="invalid thing name"):
            r.register(bad, f)


def test_builtins_are_imported_on_first_read():
    r = Registry("thing", builtins=("json",))
    assert not r._loaded
    assert r.names() == [] and r._loaded


def test_declared_keys_get_their_defaults_and_a_typo_raises():
    r = Registry("thing", declares={"needs": (), "per_step": False})
    r.register("a", object(), needs=("values",))
    assert dict(r.meta("a")) == {"needs": ("values",), "per_step": False}
    with pytest.raises(ValueError, match="declares need; a thing declares only needs, per_step"):
        r.register("b", object(), need=("values",))
    nothing = Registry("other", declares={})
    with pytest.raises(ValueError, match="declares only nothing"):
        nothing.register("c", object(), x=1)


def test_resolve_a_name_or_an_import_path_with_its_declaration():
    r = Registry("thing", "x.thing", declares={"usage": ""})
    r.register("dumps", json.dumps, usage="dumps(obj)")
    assert r.resolve("dumps").meta["usage"] == "dumps(obj)"
    own = r.resolve("json:dumps")  # a registered object named by path: its own declaration
    assert own.obj is json.dumps and own.name == "json:dumps" and own.meta["usage"] == "dumps(obj)"
    other = r.resolve("json:loads")  # not registered: the kind's defaults
    assert other.obj is json.loads and dict(other.meta) == {"usage": ""}
    with pytest.raises(UnknownName, match="did you mean 'dumps'.*or name a function as"):
        r.resolve("dump")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        r.resolve("no_such_module:f")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        r.resolve("json:nope")
