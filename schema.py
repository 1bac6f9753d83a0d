"""Typed option dataclasses, checked once: the one mechanism every package checks its options with.

A component's options are a small dataclass, help beside each field; a name with a fixed set of
values is a `choice` field. `from_dict` builds one from a mapping (a recipe section, or an env's
keyword arguments) and checks everything there is to check: unknown keys are errors that name
the nearest valid key, values must fit their annotation (ints are taken for floats, a list for a
tuple), and a `choice` field's value must be one of its valid values (a tuple, or a function
returning a registry's names, read when the options load). Errors are `ConfigError`.

This module sits at the bottom of the import graph with ``registry.py``: it imports only
``errors.py`` (where `ConfigError` and the other error classes live), so the simulator
(`sim.env.ManipEnvConfig`) uses it as the recipe loader does (``trainer/config.py`` builds YAML
loading, overrides and the reference on top and re-exports these names).
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import field, fields, is_dataclass
from typing import Any

from .errors import ConfigError


def choice(default: Any, valid: Sequence | Callable[[], Iterable]) -> Any:
    """A field whose value must be one of ``valid``: a tuple, or a function returning the names
    of a registry (called when a recipe loads, so registries stay open to user entries)."""
    return field(default=default, metadata={"choices": valid})


def choices(f) -> list | None:
    """The valid values of a `choice` field ``f`` (None for a free field)."""
    valid = f.metadata.get("choices")
    if valid is None:
        return None
    return list(valid() if callable(valid) else valid)


def at_least(default: Any, low: float) -> Any:
    """A number field whose value must be at least ``low`` (e.g. a group size of at least 1)."""
    return field(default=default, metadata={"low": low})


def from_dict(cls: type, raw: dict[str, Any], where: str, root: type | None = None) -> Any:
    """Instantiate dataclass ``cls`` from ``raw``, recursing into nested dataclasses; keys,
    types and `choice` values are checked here (see the module docstring). ``where``: the
    dotted key of ``cls`` in ``root`` (messages name keys by it; "" at the root)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{where}.{key}" if where else str(key)
        if key not in by_name:
            raise ConfigError(_unknown_key_message(dotted, where, list(by_name), root or cls))
        kind = hints[key]
        if is_dataclass(kind):
            kwargs[key] = from_dict(kind, value or {}, dotted, root)
        else:
            value = _check_type(value, kind, dotted)
            kwargs[key] = _check_low(
                _check_choice(value, by_name[key], dotted), by_name[key], dotted
            )
    return cls(**kwargs)


def check_sections(root: Any) -> None:
    """Run the cross-field rules of every section of ``root`` (a built options dataclass): each
    section (at any depth, in field order, ``root`` itself last) that defines
    ``check(self, root)`` is called with the whole config, so a rule about two keys lives with
    the section that owns it and sees the others. A rule raises `ConfigError` naming the key,
    the conflicting key and the fix. Run by the recipe loader, so checking a recipe
    (``perceptrl config``) refuses exactly what building a run would."""
    for section in _sections(root):
        check = getattr(section, "check", None)
        if callable(check):
            check(root)


def _sections(obj: Any) -> list[Any]:
    """The dataclass instances of ``obj``'s tree, children before their parent."""
    out = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value) and not isinstance(value, type):
            out += _sections(value)
    return [*out, obj]


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, dataclass field, annotation) of every leaf field of ``cls``, in order."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            out += leaf_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", f, hints[f.name]))
    return out


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of ``cls`` (``algo.kl_coef`` ...)."""
    return [key for key, _, _ in leaf_fields(cls, prefix)]


def type_name(kind: Any) -> str:
    """``int``, ``list[str]``, ``dict[str, float | dict[str, Any]]`` ..."""
    if typing.get_origin(kind) is not None:
        return str(kind).replace("typing.", "")
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


def _check_low(value: Any, f, dotted: str) -> Any:
    low = f.metadata.get("low")
    if low is None or value >= low:
        return value
    raise ConfigError(f"{dotted}={value!r} is out of range: it must be at least {low}")


def did_you_mean(value: Any, valid) -> str:
    """``"; did you mean 'x'?"`` naming the valid value closest to ``value``, or ``""``."""
    near = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1, cutoff=0.5)
    return f"; did you mean {near[0]!r}?" if near else ""


def _check_choice(value: Any, f, dotted: str) -> Any:
    valid = choices(f)
    if valid is None or value in valid:
        return value
    hint = did_you_mean(value, valid)
    raise ConfigError(
        f"{dotted}={value!r} is not a valid value{hint} (valid: {', '.join(map(str, valid))})"
    )


def _unknown_key_message(dotted: str, where: str, names: list[str], root: type) -> str:
    candidates = all_keys(root) + [f.name for f in fields(root)]
    near = difflib.get_close_matches(dotted, candidates, n=1, cutoff=0.5)
    if not near:
        near = difflib.get_close_matches(dotted.rsplit(".", 1)[-1], names, n=1, cutoff=0.4)
        near = [f"{where}.{near[0]}" if where else near[0]] if near else []
    hint = f"; did you mean {near[0]!r}?" if near else ""
    section = f" in section {where!r}" if where else ""
    return f"unknown config key {dotted!r}{section}{hint} (valid here: {', '.join(names)})"


def _check_type(value: Any, kind: Any, dotted: str) -> Any:
    """Validate (and gently coerce int -> float, list -> tuple) ``value`` against the
    annotation ``kind``."""
    bad = ConfigError(f"{dotted}: expected {type_name(kind)}, got {type(value).__name__} {value!r}")
    if kind is Any:
        return value
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        for arg in typing.get_args(kind):
            try:
                return _check_type(value, arg, dotted)
            except ConfigError:
                continue
        raise bad
    if typing.get_origin(kind) in (list, tuple, dict):
        return _check_container(value, kind, dotted, bad)
    return _check_scalar(value, kind, dotted, bad)


def _check_scalar(value: Any, kind: Any, dotted: str, bad: ConfigError) -> Any:
    if kind is type(None):
        if value is None:
            return None
        raise bad
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `2e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. `model.path=123` written without quotes
        raise bad
    raise ConfigError(f"{dotted}: unsupported annotation {kind!r}")


def _check_container(value: Any, kind: Any, dotted: str, bad: ConfigError) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is list:
        if not isinstance(value, list):
            raise bad
        return [_check_type(v, args[0], f"{dotted}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:  # tuple[X, ...]: any length (a YAML list or a tuple)
        if not isinstance(value, (list, tuple)) or len(args) != 2 or args[1] is not Ellipsis:
            raise bad
        return tuple(_check_type(v, args[0], f"{dotted}[{i}]") for i, v in enumerate(value))
    if not isinstance(value, dict):
        raise bad
    return {
        _check_type(k, args[0], f"{dotted} key"): _check_type(v, args[1], f"{dotted}.{k}")
        for k, v in value.items()
    }


__all__ = ["ConfigError", "all_keys", "choice", "choices", "from_dict", "leaf_fields", "type_name"]
