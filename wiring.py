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

from .trainer.config import AlgoConfig, CheckpointConfig, LogConfig, TrainConfig, choice, load
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
    """which policy side the recipe trains: vlm | vla | plan (a VLM planner for a VLA)"""
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
