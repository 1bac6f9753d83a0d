"""Where the sides meet the trainer: the recipe's `Config` (the trainer's sections composed with
each side's), the side a recipe names, and the run directory.

A side registers a `registry.Side` record in `registry.SIDES` from its own module (``vlm/builder.py``:
vlm, ``vla/builder.py``: vla, ``vla/plan_builder.py``: plan): ``build_trainer(cfg, run_dir) ->
Trainer``, ``run_eval(cfg, out_dir, more=()) -> dict`` and, where it has them, ``run_sft``,
``run_compare`` and ``run_pass_k``. `side` returns the record of ``cfg.side``. A new side is
one more registration (from user code too, before the recipe loads); sections of its own are
fields of `Config` (a side defined outside this package reads the existing sections). This
file sits at the top of the dependency graph beside ``cli.py`` (which only parses arguments and
prints) and ``demo.py``, so benchmarks and tests can build runs without argparse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .registry import SIDES, Side, import_modules
from .trainer import config as trainer_config
from .trainer.config import (
    AlgoConfig,
    CheckpointConfig,
    ConfigError,
    LogConfig,
    Registry,
    TrainConfig,
    build,
    choice,
    read_recipe,
)
from .vla.config import BCConfig, EnvConfig, PlanConfig, ReplayConfig, VLAConfig
from .vlm.config import DataConfig, ModelConfig, RolloutConfig, VideoConfig

CONFIGS = Path(__file__).resolve().parent / "configs"
"""the shipped recipes (``perceptrl train vlm_clevr`` reads configs/vlm_clevr.yaml)"""


def _import_sides() -> None:
    """The built-in sides' modules; importing one registers its `Side` in `SIDES`."""
    from .vla import builder, plan_builder  # noqa: F401  (sides plan and vla)
    from .vlm import builder as vlm_builder  # noqa: F401  (side vlm)


def _sides() -> list[str]:
    """The registered sides (the built-in ones and any registered before the recipe loads)."""
    _import_sides()
    return SIDES.names()


@dataclass
class Config:
    imports: list[str] = field(default_factory=list)
    """Python modules imported before the recipe's names are checked: your own registrations
    (estimators, losses, rewards, tools, tasks, generators, sides ...), so the ``perceptrl``
    command can run them; saved with the run, so a resume imports them too"""
    side: str = choice("vlm", _sides)
    """which policy side the recipe trains, an entry of ``SIDES`` (plan: a VLM planner whose
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
    bc: BCConfig = field(default_factory=BCConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """A `Config` from a YAML recipe and dotted ``key.sub=value`` overrides (see
    ``trainer.config.load``): unknown keys, wrong types and names outside a fixed set of values
    are `ConfigError`s that name the nearest valid key or the valid values. Every rule across
    keys is checked here too (each section's ``check``, then the side's), so a recipe that loads
    is one a run accepts."""
    raw = read_recipe(path, overrides)
    imports = raw.get("imports") or []
    if not isinstance(imports, list):
        raise ConfigError(f"imports={imports!r}: a list of module names, e.g. [mypkg.rewards]")
    try:
        import_modules(imports)  # the user's registrations, before their names are checked
    except ValueError as e:
        raise ConfigError(str(e)) from e
    cfg = build(Config, raw)
    rules = side(cfg).check
    if rules is not None:
        rules(cfg)
    return cfg


def side(cfg: Config) -> Side:
    """The `Side` record of ``cfg.side``: what the ``perceptrl`` command calls to build and
    evaluate its runs."""
    _import_sides()
    return SIDES.get(cfg.side)


def sides_with(command: str) -> list[str]:
    """The sides whose record has ``command`` (a `Side` field, e.g. ``run_pass_k``)."""
    return [name for name in _sides() if getattr(SIDES.get(name), command) is not None]


def new_run_dir(path: Path) -> Path:
    """``path``, made, for a run that starts from scratch there.

    Raises:
        ConfigError: ``path`` holds an earlier run (its metrics or checkpoints): a fresh run
            would append to its metrics and leave its checkpoints beside the new ones (its last
            model would then be whichever step is higher).
    """
    held = [p.name for p in (path / "metrics.jsonl", path / "checkpoints") if p.exists()]
    if held:
        raise ConfigError(
            f"{path} already holds a run ({', '.join(held)}). Continue it with --resume {path}, "
            "or give a new --run-dir / --out (or delete that directory) to start over."
        )
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------------------------
# The configuration reference (docs/config.md): the trainer's registries and the sides'
# ---------------------------------------------------------------------------------------------


def _tiny_archs() -> tuple[str, ...]:
    from .vlm.tiny import ARCHS

    return ARCHS


def _generators() -> list[str]:
    from .registry import GENERATORS

    return GENERATORS.names()


def _families() -> dict[str, tuple[str, ...]]:
    from .registry import GENERATORS

    return {name: GENERATORS.get(name).families for name in GENERATORS}


def _rewards() -> list[str]:
    from .registry import REWARDS

    return REWARDS.names()


def _process_rewards() -> list[str]:
    from .registry import STEP_REWARDS
    from .vlm.process import IMPLICIT

    return [*STEP_REWARDS.names(), IMPLICIT]


def _tools() -> list[str]:
    from .registry import TOOLS

    return TOOLS.names()


def _episode_envs() -> list[str]:
    from .registry import EPISODE_ENVS

    return EPISODE_ENVS.names()


def _env_ids() -> list[str]:
    from .sim import ENV_IDS

    return list(ENV_IDS.values())


def _vla_heads() -> list[str]:
    from .registry import VLA_HEADS

    return VLA_HEADS.names()


def _executors() -> list[str]:
    from .registry import EXECUTORS

    return EXECUTORS.names()


def _executor_families() -> list[str]:
    from .sim.composite import PRIMITIVES
    from .vla.config import ALL

    return [*PRIMITIVES, ALL]


REGISTRIES = (
    Registry("Sides", "`registry.py`, `SIDES` (each side's module registers its `Side`)",
             ("side",), _sides),
    *trainer_config.REGISTRIES,
    Registry("Tiny model architectures", "`vlm/tiny.py`, `ARCHS`", ("model.tiny_arch",),
             _tiny_archs),
    Registry("Synthetic generators", "`GENERATORS`, `Generator` records in "
             "`datasets/registry.py`", ("data.generator",), _generators),
    Registry("Question families", "each generator's module, `FAMILIES` (per generator)",
             ("data.families",), _families),
    Registry("Rewards", "`REWARDS`, entries in `rewards/`", ("rollout.reward",), _rewards),
    Registry("Process rewards", "`STEP_REWARDS`, entries in `rewards/`; and `implicit_prm`, "
             "`vlm/process.py`", ("rollout.process_reward",), _process_rewards),
    Registry("Episode environments", "`EPISODE_ENVS`, entries in `vlm/tool_env.py` (`tools`) and "
             "`vla/plan_env.py` (`plan`)", ("rollout.episode.env",), _episode_envs),
    Registry("Tools", "`TOOLS`, entries in `vlm/tools.py`", ("rollout.episode.tools",), _tools),
    Registry("Simulator tasks", "`TASKS`, entries in `sim/tasks.py` and `sim/composite.py`, as "
             "the gymnasium ids `sim/__init__.py` registers", ("env.id", "env.eval_tasks"),
             _env_ids),
    Registry("VLA action heads", "`registry.py`, `VLA_HEADS` (registered beside each policy "
             "class: `vla/compact.py`, `vla/flow.py`)", ("vla.head",), _vla_heads),
    Registry("Plan executors", "`registry.py`, `EXECUTORS` (entries in `vla/executors.py`)",
             ("plan.executor",), _executors),
    Registry("Executor policy families", "`sim/composite.py`, `PRIMITIVES`, and `all` "
             "(`vla/config.py`)", ("plan.policies",), _executor_families),
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
