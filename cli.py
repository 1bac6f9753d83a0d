"""The `perceptrl` command: reads a recipe, wires a side (vlm or vla) into the shared trainer.

This is the only module that knows both the trainer and the sides; `trainer/` never imports
`vlm/`, `vla/`, `sim/` or `datasets/`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .trainer.config import Config, ConfigError, describe, load_config

CONFIGS = Path(__file__).resolve().parent / "configs"


def resolve_recipe(name: str | None) -> Path | None:
    """A recipe path, or the name of a shipped recipe (``vlm_clevr`` -> configs/vlm_clevr.yaml)."""
    if name is None:
        return None
    path = Path(name)
    if path.exists():
        return path
    shipped = CONFIGS / (name if name.endswith(".yaml") else f"{name}.yaml")
    if shipped.exists():
        return shipped
    names = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.yaml")))
    raise ConfigError(f"recipe {name!r} not found (neither a file nor a shipped recipe: {names})")


def make_run_dir(cfg: Config, recipe: Path | None, run_dir: str | None) -> Path:
    if run_dir:
        path = Path(run_dir)
    else:
        name = cfg.log.name or f"{recipe.stem if recipe else cfg.side}-{time.strftime('%Y%m%d-%H%M%S')}"
        path = Path(cfg.log.dir) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved config, one key per line with its help."""
    recipe, overrides = split_recipe(args.recipe, args.overrides)
    cfg = load_config(recipe, overrides)
    for key, kind, _default, help_ in describe(Config):
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        print(f"{key} = {value!r}  ({kind}) {help_}")
    return 0


def split_recipe(recipe: str | None, overrides: list[str]) -> tuple[Path | None, list[str]]:
    """``perceptrl config algo.x=1`` has no recipe: an argument with ``=`` is an override."""
    if recipe is not None and "=" in recipe:
        return None, [recipe, *overrides]
    return resolve_recipe(recipe), list(overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="perceptrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("config", help="print the resolved config of a recipe with each field's help")
    p.add_argument("recipe", nargs="?", help="YAML recipe or shipped recipe name (default: all defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.kl_coef=0.01")
    p.set_defaults(func=cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"perceptrl: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
