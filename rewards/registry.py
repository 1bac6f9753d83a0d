"""The one reward registry.

A reward is a plain function ``fn(completions: list[str], samples: list[dict], **params) ->
list[float]`` with one score per completion; ``samples[i]`` is the dataset sample that
``completions[i]`` answers (keys ``answer``, ``reward``, ``meta`` ...). Optional keyword
parameters (tolerances, lengths) come from the recipe. Rewards know nothing of models.

Register with ``@register_reward("name")``; look up with :func:`get_reward`, which also accepts
``"package.module:function"`` for a user function that is not registered.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable

RewardFn = Callable[..., list[float]]

_REWARDS: dict[str, RewardFn] = {}


def registrar(table: dict, kind: str, name: str) -> Callable[[Callable], Callable]:
    """Decorator registering a function in ``table`` under ``name`` (non-empty, no ':');
    registering another function under a taken name raises (the same function again is fine)."""
    if not name or ":" in name:
        raise ValueError(f"invalid {kind} name {name!r}: must be non-empty and contain no ':'")

    def deco(fn: Callable) -> Callable:
        old = table.get(name)
        same = old is not None and (old.__module__, old.__qualname__) == (
            fn.__module__,
            fn.__qualname__,
        )
        if old is not None and not same:
            raise ValueError(
                f"{kind} {name!r} is already registered by "
                f"{old.__module__}.{old.__qualname__}; choose another name"
            )
        table[name] = fn
        return fn

    return deco


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering ``fn`` under ``name``; reusing a name for another function raises."""
    return registrar(_REWARDS, "reward", name)


def list_rewards() -> list[str]:
    """Sorted registered reward names."""
    return sorted(_REWARDS)


def _import_spec(spec: str) -> RewardFn:
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"reward spec {spec!r} must look like 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(
            f"reward spec {spec!r}: cannot import module {mod_name!r} ({e}); "
            "check the module is on PYTHONPATH"
        ) from e
    fn = mod
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward spec {spec!r}: module {mod_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward spec {spec!r} names a {type(fn).__name__}, not a function")
    return fn


def get_reward(name: str) -> RewardFn:
    """Registered reward ``name`` or the function named by ``"module:function"``.

    Raises:
        ValueError: unknown name (the message lists valid names and the nearest one).
    """
    if not isinstance(name, str):
        raise ValueError(f"reward name must be a string, got {type(name).__name__}")
    if ":" in name:
        return _import_spec(name)
    if name not in _REWARDS:
        near = difflib.get_close_matches(name, _REWARDS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(
            f"unknown reward {name!r}{hint}; valid: {', '.join(list_rewards())}, "
            "or 'package.module:function'"
        )
    return _REWARDS[name]
