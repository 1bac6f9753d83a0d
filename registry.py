"""One registry mechanism for every kind of named component a recipe can choose.

Estimators, losses, KL estimators, aggregation modes, rollout corrections, rewards, step rewards,
tools, data generators, episode environments, sim tasks, scripted experts, sides, training
engines and VLA action heads are each a `Registry` below. A component registers itself where it
is defined, with what it needs declared beside it::

    from perceptrl.registry import ADVANTAGES

    @ADVANTAGES.register("my_baseline", needs=("values",))
    def my_baseline(inp, cfg): ...

and is looked up by name (``ADVANTAGES.get(name)``, ``ADVANTAGES.entry(name).meta``); an unknown
name raises `UnknownName` with the valid names and the nearest one. Callers read an entry's
declared metadata; they never inspect a function's signature to decide what to pass it.

A registry knows the modules that hold its built-in entries (``builtins``) and imports them
the first time it is read, so a recipe can be checked against every built-in name before any
side is built, whoever reads the registry first. This module is the bottom of the import graph:
it imports nothing of the package.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownName(ValueError):
    """A name that is not registered (the message lists the valid names)."""


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered component: its name, the object, and what it declared at registration."""

    name: str
    obj: T
    meta: Mapping[str, Any] = field(default_factory=dict)


class Registry(Generic[T]):
    """Name -> component of one kind.

    Args:
        kind: what the entries are, for messages ("advantage estimator").
        key: the recipe key that names an entry ("algo.adv_estimator"), for messages.
        builtins: modules whose import registers the built-in entries (imported on first read).
    """

    def __init__(self, kind: str, key: str = "", builtins: tuple[str, ...] = ()):
        self.kind, self.key, self.builtins = kind, key, builtins
        self._entries: dict[str, Entry[T]] = {}
        self._loaded = not builtins

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self._entries)} entries)"

    # ----------------------------------------------------------------------------- writing

    def register(self, name: str, obj: T | None = None, **meta: Any) -> Any:
        """Register ``obj`` under ``name`` with its declared ``meta``; without ``obj``, a
        decorator that registers what it decorates. Registering the same object again (a
        module imported twice) is a no-op; another object under a taken name raises."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"invalid {self.kind} name {name!r}: non-empty text without ':'")

        def add(o: T) -> T:
            old = self._entries.get(name)
            if old is not None and not _same(old.obj, o):
                raise ValueError(
                    f"{self.kind} {name!r} is already registered by {_where(old.obj)}; "
                    f"register {_where(o)} under another name"
                )
            self._entries[name] = Entry(name, o, MappingProxyType(dict(meta)))
            return o

        return add if obj is None else add(obj)

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests and interactive sessions that register temporary entries)."""
        self._entries.pop(name, None)

    # ----------------------------------------------------------------------------- reading

    def load(self) -> Registry[T]:
        """Import the modules of the built-in entries (once)."""
        if not self._loaded:
            self._loaded = True
            for module in self.builtins:
                importlib.import_module(module)
        return self

    def names(self) -> list[str]:
        """Sorted registered names."""
        return sorted(self.load()._entries)

    def __contains__(self, name: object) -> bool:
        return name in self.load()._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.load()._entries)

    def entry(self, name: str) -> Entry[T]:
        """The entry registered as ``name``; `UnknownName` (with the valid names) if none."""
        entries = self.load()._entries
        if name not in entries:
            raise UnknownName(self.unknown_message(name))
        return entries[name]

    def get(self, name: str) -> T:
        """The object registered as ``name``; `UnknownName` (with the valid names) if none."""
        return self.entry(name).obj

    def meta(self, name: str) -> Mapping[str, Any]:
        """What ``name`` declared when it registered."""
        return self.entry(name).meta

    def unknown_message(self, name: object) -> str:
        valid = self.names()
        near = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        where = f" ({self.key})" if self.key else ""
        return (
            f"unknown {self.kind} {name!r}{where}{hint} (valid: {', '.join(valid) or 'none'}); "
            f"a new one is registered with perceptrl.registry"
        )

    def choices(self) -> Callable[[], list[str]]:
        """The live names, as a `trainer.config.choice` field takes them."""
        return self.names


def _same(a: object, b: object) -> bool:
    """The same object, or the same function/class defined again by a re-imported module."""
    if a is b:
        return True
    key = ("__module__", "__qualname__")
    return all(hasattr(x, k) for x in (a, b) for k in key) and all(
        getattr(a, k) == getattr(b, k) for k in key
    )


def _where(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


# ---------------------------------------------------------------------------------- the kinds

ADVANTAGES: Registry[Callable] = Registry(
    "advantage estimator", "algo.adv_estimator", ("perceptrl.trainer.advantages",)
)
"""``fn(inp: AdvantageInputs, cfg) -> (advantages [B, T], returns [B, T], metrics)``; declares
``needs`` (``values``, ``segments``, ``step_rewards``) and ``per_step`` (credit per step from
per-step rewards, as GAE)"""
POLICY_LOSSES: Registry[Callable] = Registry(
    "policy loss", "algo.policy_loss", ("perceptrl.trainer.algos",)
)
KL_ESTIMATORS: Registry[Callable] = Registry(
    "KL estimator", "algo.kl_estimator", ("perceptrl.trainer.algos",)
)
AGG_MODES: Registry[Callable] = Registry(
    "loss aggregation mode", "algo.loss_agg_mode", ("perceptrl.trainer.algos",)
)
CORRECTIONS: Registry[Callable] = Registry(
    "rollout correction", "algo.rollout_correction", ("perceptrl.trainer.corrections",)
)
REWARDS: Registry[Callable] = Registry("reward", "rollout.reward", ("perceptrl.rewards",))
"""``fn(completions, samples, ctx) -> list[float]``; declares ``prepare``, ``counters``,
``self_timed`` (see rewards/compose.py)"""
STEP_REWARDS: Registry[Callable] = Registry(
    "step reward", "rollout.process_reward", ("perceptrl.rewards",)
)
TOOLS: Registry[Any] = Registry("tool", "rollout.episode.tools", ("perceptrl.vlm.tools",))
EPISODE_ENVS: Registry[Any] = Registry(
    "episode environment", "rollout.episode.env", ("perceptrl.vlm.episode", "perceptrl.vla.plan")
)
GENERATORS: Registry[Any] = Registry(
    "data generator", "data.generator", ("perceptrl.datasets.registry",)
)
TASKS: Registry[Any] = Registry("sim task", "env.id", ("perceptrl.sim.tasks", "perceptrl.sim"))
EXPERTS: Registry[Callable] = Registry("scripted expert", "", ("perceptrl.sim.expert",))
SIDES: Registry[Any] = Registry(
    "side", "side", ("perceptrl.vlm.run", "perceptrl.vla.run", "perceptrl.vla.plan")
)
ENGINES: Registry[Callable] = Registry(
    "training engine", "train.backend", ("perceptrl.trainer.engine",)
)
VLA_HEADS: Registry[Any] = Registry(
    "VLA action head", "vla.head", ("perceptrl.vla.compact", "perceptrl.vla.flow")
)
