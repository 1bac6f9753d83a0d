"""One registry mechanism for every kind of named component a recipe can choose.

Estimators, losses, KL estimators, aggregation modes, rollout corrections, rewards, step rewards,
tools, data generators, episode environments, sim tasks, scripted experts, judge backends, sides,
training engines, VLA action heads and planner executors are each a `Registry` below. A
component registers itself where it is defined, with what it needs declared beside it::

    from perceptrl.registry import ADVANTAGES

    @ADVANTAGES.register("my_baseline", needs=("values",))
    def my_baseline(inp, cfg): ...

and is looked up by name (``ADVANTAGES.get(name)``, ``ADVANTAGES.entry(name).meta``); an unknown
name raises `UnknownName` with the valid names and the nearest one. Callers read an entry's
declared metadata; they never inspect a function's signature to decide what to pass it. The
kinds a recipe may also name by import path (rewards, step rewards, tools) look a spec up with
``resolve("package.module:function")``.

A registry knows the modules that hold its built-in entries (``builtins``) and imports them
the first time it is read, so a recipe can be checked against every built-in name before any
side is built, whoever reads the registry first. This module is the bottom of the import graph:
it imports nothing of the package.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
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
        declares: what an entry of this kind declares, with the default of each declaration;
            when given, every entry's ``meta`` holds exactly these keys (a key not listed is a
            typo and raises at registration).
    """

    def __init__(
        self,
        kind: str,
        key: str = "",
        builtins: tuple[str, ...] = (),
        declares: Mapping[str, Any] | None = None,
    ):
        self.kind, self.key, self.builtins = kind, key, builtins
        self.declares = None if declares is None else MappingProxyType(dict(declares))
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
        if self.declares is not None:
            unknown = sorted(set(meta) - set(self.declares))
            if unknown:
                raise ValueError(
                    f"{self.kind} {name!r} declares {', '.join(unknown)}; a {self.kind} "
                    f"declares only {', '.join(self.declares) or 'nothing'}"
                )
            meta = {**self.declares, **meta}

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

    def resolve(self, spec: str) -> Entry[T]:
        """The entry of a registered name, or of the object a ``"package.module:function"`` spec
        names, for the kinds a recipe may name by import path (rewards, step rewards, tools):
        the object's own entry when it is registered, else one that declares the kind's
        defaults.

        Raises:
            UnknownName: an unknown name (the message lists the valid names).
            ValueError: a spec that does not import or names nothing callable.
        """
        if not isinstance(spec, str):
            raise ValueError(f"{self.kind} name must be a string, got {type(spec).__name__}")
        if ":" not in spec:
            try:
                return self.entry(spec)
            except UnknownName as e:
                raise UnknownName(f"{e}, or name a function as 'package.module:function'") from None
        obj = _import_spec(spec, self.kind)
        for e in self.load()._entries.values():
            if e.obj is obj:
                return Entry(spec, obj, e.meta)
        return Entry(spec, obj, MappingProxyType(dict(self.declares or {})))

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
    """The same object, or the same function/class defined again by a re-imported module (a
    record of them, such as a `Side`, field by field)."""
    if a is b:
        return True
    if is_dataclass(a) and not isinstance(a, type) and type(a) is type(b):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))
    key = ("__module__", "__qualname__")
    return all(hasattr(x, k) for x in (a, b) for k in key) and all(
        getattr(a, k) == getattr(b, k) for k in key
    )


def _where(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def _import_spec(spec: str, kind: str) -> Callable:
    """The callable ``"package.module:attr"`` names (``attr`` may be dotted)."""
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"{kind} spec {spec!r} must look like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(
            f"{kind} spec {spec!r}: cannot import module {mod_name!r} ({e}); "
            "check the module is on PYTHONPATH"
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{kind} spec {spec!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{kind} spec {spec!r} names a {type(obj).__name__}, not a function")
    return obj


def import_modules(names: Sequence[str]) -> None:
    """Import the modules a recipe lists in ``imports``: the user's own registrations, for the
    ``perceptrl`` command, a resume and a pipeline's worker processes alike.

    Raises:
        ValueError: a name that is not text, or a module that does not import (with why).
    """
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"imports: {name!r} is not a module name (e.g. mypkg.rewards)")
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ValueError(
                f"imports: cannot import {name!r} ({e}); put the folder that holds it on "
                "PYTHONPATH or install its package"
            ) from e


# ---------------------------------------------------------------------------------- the kinds

ADVANTAGES: Registry[Callable] = Registry(
    "advantage estimator", "algo.adv_estimator",
    ("perceptrl.trainer.advantages", "perceptrl.trainer.tree_advantages"),
    declares={"needs": (), "per_step": False},
)  # fmt: skip
"""``fn(inp: AdvantageInputs, cfg: AlgoConfig) -> (advantages [B, T], returns [B, T], metrics)``
(trainer/advantages.py, trainer/tree_advantages.py). Declares ``needs``: the optional inputs it reads (``values``,
``bootstrap_value``, ``segments``, ``step_rewards``; the trainer gives it no other, and folds
process rewards into ``rewards`` for one that does not read ``step_rewards``), and ``per_step``:
it credits each step from per-step rewards and a critic (GAE), so a VLA run collects PPO
segments instead of whole-episode groups."""
POLICY_LOSSES: Registry[Callable] = Registry(
    "policy loss", "algo.policy_loss", ("perceptrl.trainer.algos",), declares={}
)
"""``fn(logp, logp_old, advantages, mask, cfg, *, is_weight=None, num_tokens=None,
num_seqs=None) -> (loss [], metrics)`` (trainer/algos.py)"""
KL_ESTIMATORS: Registry[Callable] = Registry(
    "KL estimator", "algo.kl_estimator", ("perceptrl.trainer.algos",), declares={}
)
"""``fn(logp [B, T], logp_ref [B, T]) -> kl [B, T]``, per token, not masked (trainer/algos.py)"""
AGG_MODES: Registry[Callable] = Registry(
    "loss aggregation mode", "algo.loss_agg_mode", ("perceptrl.trainer.algos",), declares={}
)
"""``fn(loss [B, T], valid [B, T], *, num_tokens, num_seqs, norm_len) -> loss []``: ``loss`` is
0 on the positions ``valid`` (bool) leaves out; called through ``agg_loss`` (trainer/algos.py)"""
CORRECTIONS: Registry[Callable] = Registry(
    "rollout correction", "algo.rollout_correction", ("perceptrl.trainer.corrections",),
    declares={"low": 0.0},
)  # fmt: skip
"""``fn(logp_old [B, T], logp_rollout [B, T], mask [B, T], cfg) -> (weight [B, T], keep [B, T]
bool)`` (trainer/corrections.py). Declares ``low``: its lower bound on ``pi_prox / pi_behav``
when ``algo.correction_low`` is 0 (0: none)."""
REWARDS: Registry[Callable] = Registry(
    "reward", "rollout.reward", ("perceptrl.rewards",),
    declares={"prepare": None, "counters": None, "self_timed": False, "check_answer": None},
)  # fmt: skip
"""``fn(completions, samples, ctx: RewardContext, **params) -> scores [B]`` (rewards/registry.py).
Declares ``prepare(**params)`` (called once when the reward is built), ``counters(**params)``
(running totals logged per call) and ``self_timed`` (it enforces ``ctx.timeout_s`` itself)."""
STEP_REWARDS: Registry[Callable] = Registry(
    "step reward", "rollout.process_reward", ("perceptrl.rewards",), declares={"prepare": None}
)
"""``fn(completions, samples, ctx: RewardContext, **params) -> [[Step(end, score), ...], ...]``
(rewards/process.py). Declares ``prepare(**params)`` (called once when it is built)."""
TOOLS: Registry[Callable] = Registry(
    "tool", "rollout.episode.tools", ("perceptrl.vlm.tools",), declares={"usage": ""}
)
"""``fn(ctx: ToolContext, **arguments) -> Observation | str | Image`` (vlm/tools.py). Declares
``usage``: the line the model reads in its system prompt (empty: the docstring's first line)."""
EPISODE_ENVS: Registry[Callable] = Registry(
    "episode environment", "rollout.episode.env", ("perceptrl.vlm.tool_env", "perceptrl.vla.plan_env"),
    declares={"eval_reward": None},
)  # fmt: skip
"""``build(cfg) -> factory of EpisodeEnv`` (one environment per rollout call; vlm/episode.py;
built in: ``tools``, vlm/tool_env.py, and the planner's ``plan``, vla/plan_env.py).
Declares ``eval_reward``: the held-out score of its episodes (None: the VLM side's accuracy)."""
GENERATORS: Registry[Any] = Registry(
    "data generator", "data.generator", ("perceptrl.datasets.registry",), declares={}
)
"""`datasets.registry.Generator` records (module, modality, splits, families, options)."""
TASKS: Registry[Any] = Registry(
    "sim task", "env.id", ("perceptrl.sim.tasks", "perceptrl.sim"), declares={}
)
"""`sim.tasks.Task` records (scene needs, layout, success and shaping functions); importing
``perceptrl.sim`` registers a gymnasium id for each."""
EXPERTS: Registry[Callable] = Registry(
    "scripted expert", "", ("perceptrl.sim.expert",), declares={}
)
"""``fn(expert: ScriptedExpert, world: World) -> action (5,)`` per task family (sim/expert.py)."""
JUDGES: Registry[Callable] = Registry("judge backend", "", ("perceptrl.vlm.judge",), declares={})
"""``factory(path, device, dtype) -> handler``, built inside the judge reward's worker process:
``handler(request) -> verdict texts`` for a request of judge prompts (``samples``,
``system_prompt``, ``batch_size``, ``max_new_tokens``, ``max_prompt_length``; rewards/judge.py).
The model side registers it, so that rewards know no model code (vlm/judge.py: ``hf``)."""


@dataclass(frozen=True)
class Side:
    """What the ``perceptrl`` command calls on a side, registered in `SIDES` by the side's own
    module. A command the side does not support is None; the command then says which sides
    support it."""

    build_trainer: Callable[..., Any]
    """``(cfg, run_dir) -> Trainer``: RL training (``perceptrl train``, ``perceptrl demo``)"""
    run_eval: Callable[..., dict]
    """``(cfg, out_dir, more=()) -> {"table", "files"}``: a saved model on the recipe's held-out
    data or tasks (``perceptrl eval``; ``more``: recipes whose task sets join the table)"""
    run_sft: Callable[..., Any] | None = None
    """``(cfg, run_dir) -> metrics``: the supervised warm start (``perceptrl sft``)"""
    run_compare: Callable[..., dict] | None = None
    """``(cfgs: name -> cfg, out_dir) -> {"table", "files"}``: several saved models side by side
    (``perceptrl eval`` with several ``--model name=path``)"""
    run_pass_k: Callable[..., dict] | None = None
    """``(cfgs: name -> cfg, out_dir, ks, n) -> {"table", "files"}``: pass@k of one or more
    models from ``n`` sampled answers (``perceptrl eval --pass-k``)"""
    check: Callable[[Any], None] | None = None
    """``(cfg) -> None``: the side's rules across sections, run when a recipe naming the side
    loads (after each section's own ``check``); raises ``ConfigError`` naming the keys and the
    fix"""


SIDES: Registry[Side] = Registry(
    "side", "side", ("perceptrl.vlm.builder", "perceptrl.vla.builder", "perceptrl.vla.plan_builder"),
    declares={},
)  # fmt: skip
"""side name -> `Side`: the policy side a recipe trains (``side``); ``wiring.side(cfg)`` returns
the record. Built in: vlm (``vlm/builder.py``), vla (``vla/builder.py``) and plan (``vla/plan_builder.py``: a
VLM planner whose subgoals a VLA executes)"""
ENGINES: Registry[Callable] = Registry(
    "training engine", "train.backend",
    ("perceptrl.trainer.engine", "perceptrl.trainer.deepspeed_engine"), declares={},
)  # fmt: skip
"""``build(policy, cfg: TrainConfig) -> engine``: the optimisation engine of ``train.backend``
(trainer/engine.py, trainer/deepspeed_engine.py; the seam is ``trainer.engine.Engine``)"""
VLA_HEADS: Registry[type] = Registry(
    "VLA action head", "vla.head",
    ("perceptrl.vla.compact", "perceptrl.vla.flow", "perceptrl.vla.sac"), declares={},
)  # fmt: skip
"""``cls(spec: CompactSpec) -> policy``: the compact VLA class of an action head, registered beside
it (gaussian: ``vla.compact.CompactVLA``; flow: ``vla.flow.FlowVLA``, the same network with a
flow-matching chunk head; sac and dsrl: ``vla.sac``, the off-policy heads);
``vla.compact.build_compact`` builds the one ``vla.head`` names"""
EXECUTORS: Registry[Callable] = Registry(
    "plan executor", "plan.executor", ("perceptrl.vla.executors",), declares={"policies": False}
)
"""``build(policies: dict[str, str], device: str) -> executor``: what executes a planner's
subgoals in the simulator (vla/executors.py: ``oracle``, the scripted experts; ``policy``, frozen
VLAs saved by the VLA recipes). Declares ``policies``: it runs the saved VLAs of
``plan.policies``, so a recipe that chooses it must name at least one."""
