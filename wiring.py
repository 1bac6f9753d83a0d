"""Where the sides meet the trainer: the recipe's `Config` (the trainer's sections composed with
each side's) and the table from ``side`` to the module that builds it.

A side module (``vlm/run.py``, ``vla/run.py``) provides ``build_trainer(cfg, run_dir) ->
Trainer``, ``run_sft(cfg, run_dir) -> metrics`` and ``run_eval(cfg, out_dir, more=()) -> dict``;
a new side is one entry in `SIDES` (from user code too, before the recipe loads) and its module;
sections of its own are fields of `Config` (a side defined outside this package reads the
existing sections). This file sits at the top of the dependency graph beside ``cli.py`` (which
only parses arguments and prints), so benchmarks and tests can build runs without argparse.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from .trainer import config as trainer_config
from .trainer.config import (
    AlgoConfig,
    CheckpointConfig,
    LogConfig,
    Registry,
    TrainConfig,
    choice,
    load,
)
from .vla.config import EnvConfig, PlanConfig, VLAConfig
from .vlm.config import DataConfig, ModelConfig, RolloutConfig, VideoConfig

SIDES = {"vlm": ".vlm.run", "vla": ".vla.run", "plan": ".vla.plan"}
"""side -> module with build_trainer, run_sft and run_eval: relative to ``perceptrl`` when it
starts with a dot, else a full module name (a side of your own: ``SIDES["mine"] =
"mypkg.side"``). ``plan``: a VLM planner whose subgoals a VLA executes in MuJoCo; the VLM
side's runs with its episode environment"""


def _sides() -> list[str]:
    return list(SIDES)


@dataclass
class Config:
    side: str = choice("vlm", _sides)
    """which policy side the recipe trains, a key of ``SIDES`` (plan: a VLM planner whose
    subgoals a VLA executes)"""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    vla: VLAConfig = field(default_factory=VLAConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """A `Config` from a YAML recipe and dotted ``key.sub=value`` overrides (see
    ``trainer.config.load``): unknown keys, wrong types and names outside a fixed set of values
    are `ConfigError`s that name the nearest valid key or the valid values."""
    return load(Config, path, overrides)


def side(cfg: Config) -> ModuleType:
    """The module that builds ``cfg.side``'s runs (imported on first use)."""
    return importlib.import_module(SIDES[cfg.side], __package__)


# ---------------------------------------------------------------------------------------------
# The configuration reference (docs/config.md): the trainer's registries and the sides'
# ---------------------------------------------------------------------------------------------


def _import_sides() -> None:
    """Import every side's module: a side registers its names (an episode environment) there."""
    for module in SIDES.values():
        importlib.import_module(module, __package__)


def _tiny_archs() -> tuple[str, ...]:
    from .vlm.tiny import ARCHS

    return ARCHS


def _generators() -> list[str]:
    from .datasets.registry import GENERATORS

    return list(GENERATORS)


def _families() -> dict[str, tuple[str, ...]]:
    from .datasets.registry import GENERATORS

    return {name: g.families for name, g in GENERATORS.items()}


def _rewards() -> list[str]:
    from .rewards import list_rewards

    return list_rewards()


def _process_rewards() -> list[str]:
    from .rewards.process import list_step_rewards
    from .vlm.process import IMPLICIT

    return [*list_step_rewards(), IMPLICIT]


def _tools() -> list[str]:
    from .vlm.tools import list_tools

    return list_tools()


def _episode_envs() -> list[str]:
    _import_sides()
    from .vlm.episode import EPISODE_ENVS

    return ["tools", *EPISODE_ENVS]


def _env_ids() -> list[str]:
    from .sim import ENV_IDS

    return list(ENV_IDS.values())


def _vla_heads() -> list[str]:
    from .registry import VLA_HEADS

    return VLA_HEADS.names()


def _executor_families() -> list[str]:
    from .vla.executors import ALL, PRIMITIVES

    return [*PRIMITIVES, ALL]


REGISTRIES = (
    Registry("Sides", "`wiring.py`, `SIDES`", ("side",), _sides),
    *trainer_config.REGISTRIES,
    Registry("Tiny model architectures", "`vlm/tiny.py`, `ARCHS`", ("model.tiny_arch",),
             _tiny_archs),
    Registry("Synthetic generators", "`datasets/registry.py`, `GENERATORS`", ("data.generator",),
             _generators),
    Registry("Question families", "each generator's module, `FAMILIES` (per generator)",
             ("data.families",), _families),
    Registry("Rewards", "`rewards/`, `@register_reward`", ("rollout.reward",), _rewards),
    Registry("Process rewards", "`rewards/`, `@register_step_reward`; and `implicit_prm`, "
             "`vlm/process.py`", ("rollout.process_reward",), _process_rewards),
    Registry("Episode environments", "`vlm/episode.py`, `EPISODE_ENVS` (a side registers its "
             "own when imported), and the built-in `tools`", ("rollout.episode.env",),
             _episode_envs),
    Registry("Tools", "`vlm/tools.py`, `@register_tool`", ("rollout.episode.tools",), _tools),
    Registry("Simulator tasks", "`sim/tasks.py`, `TASKS`, as the gymnasium ids `sim/__init__.py` "
             "registers", ("env.id", "env.eval_tasks"), _env_ids),
    Registry("VLA action heads", "`registry.py`, `VLA_HEADS` (registered beside each policy "
             "class: `vla/compact.py`, `vla/flow.py`)", ("vla.head",), _vla_heads),
    Registry("Executor policy families", "`sim/composite.py`, `PRIMITIVES`, and `all` "
             "(`vla/executors.py`)", ("plan.policies",), _executor_families),
)  # fmt: skip
"""Every registry a recipe's keys read, for the configuration reference and ``perceptrl
config`` (registries of names that no key reads are not listed)."""

REFERENCE_COMMAND = "perceptrl config --reference > docs/config.md"

_INTRO = f"""\
Every key of a recipe, with its type, default, help and valid values, and the registries the
valid values come from. A recipe is a YAML file with one section per component (the sections
below); dotted overrides on the command line (`algo.kl_coef=0.01`) apply on top, and
`perceptrl config <recipe>` prints a recipe's resolved values with the same help.

This page is generated from the config dataclasses (each field's help is the docstring below it)
and from the registries; do not edit it by hand, change the code and regenerate it:

    {REFERENCE_COMMAND}

A test fails when this page and the code disagree. Defaults are written as YAML. Valid values
are either the complete list of a key that is checked when the recipe loads, or, after
"registered:", the names a registry holds (the help says what else the key takes, such as
`package.module:function`)."""


def reference() -> str:
    """The configuration reference (docs/config.md) as Markdown."""
    return trainer_config.reference(Config, REGISTRIES, _INTRO)
