"""The `perceptrl` command: reads a recipe, wires a side (vlm, vla, plan) into the shared trainer.

It parses arguments and prints; `wiring.py` resolves the recipe and the side's `Side` record,
whose functions build and evaluate the runs (what a side supports is what its record holds),
and `demo.py` runs ``perceptrl demo``. `trainer/` never imports `vlm/`, `vla/`, `sim/` or
`datasets/`.

The error boundary is `main`: every anticipated failure ends the command with one paragraph
(what is wrong, where, the fix) and the exit status of its class (``errors.py``): 2 config, 3
data, 4 model, 5 machine (GPU, disk, permissions, EGL, memory), 6 run (damaged checkpoints,
divergence, failing workers), 130 interrupted. Anything else is a bug: its traceback, then one
line saying so, status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from . import demo, errors, inspection, wiring
from .errors import ConfigError, ModelError, PerceptrlError, RunError, read_yaml
from .registry import GENERATORS, UnknownName
from .trainer.config import describe, format_valid, save_config, valid_values
from .trainer.files import replace_file
from .wiring import CONFIGS, Config, load_config, new_run_dir

EXIT_CONFIG_ERROR = errors.ConfigError.exit_status
EXIT_DATA_ERROR = errors.DataError.exit_status
EXIT_BUG = 1
EXIT_INTERRUPTED = 130


def resolve_recipe(name: str | None) -> Path | None:
    """A recipe path, or the name of a shipped recipe (``vlm_clevr`` -> configs/vlm_clevr.yaml)."""
    if name is None:
        return None
    path = Path(name)
    if path.is_dir():
        raise ConfigError(f"recipe {name!r} is a directory; give a YAML file or a shipped recipe")
    if not path.exists():
        path = CONFIGS / (name if name.endswith(".yaml") else f"{name}.yaml")
    if path.exists():
        read_yaml(path)  # not UTF-8, or a YAML syntax error: a ConfigError naming file and line
        return path
    names = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.yaml")))
    raise ConfigError(f"recipe {name!r} not found (neither a file nor a shipped recipe: {names})")


def make_run_dir(cfg: Config, recipe: Path | None, run_dir: str | None) -> Path:
    if run_dir:
        path = Path(run_dir)
    else:
        name = (
            cfg.log.name
            or f"{recipe.stem if recipe else cfg.side}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        path = Path(cfg.log.dir) / name
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run directory {path} is a file; give another --run-dir or log.dir")
    with errors.creating(path):
        return new_run_dir(path)


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved config, one key per line with its help and valid values (or, with
    ``--reference``, the configuration reference as Markdown)."""
    if args.reference:
        if args.recipe or args.overrides:
            raise ConfigError("config --reference documents the defaults: give no recipe")
        print(wiring.reference(), end="")
        return 0
    recipe, overrides = split_recipe(args.recipe, args.overrides)
    cfg = load_config(recipe, overrides)
    valid = valid_values(Config, wiring.REGISTRIES)
    for key, kind, _default, help_ in describe(Config):
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        names = f" [{format_valid(valid[key], label=True)}]" if key in valid else ""
        print(f"{key} = {value!r}  ({kind}) {help_}{names}")
    from .registry import REWARDS

    print(f"# rewards for rollout.reward: {', '.join(REWARDS.names())} (or module:function)")
    return 0


def split_recipe(recipe: str | None, overrides: list[str]) -> tuple[Path | None, list[str]]:
    """``perceptrl config algo.x=1`` has no recipe: an argument with ``=`` is an override."""
    if recipe is not None and "=" in recipe:
        return None, [recipe, *overrides]
    return resolve_recipe(recipe), list(overrides)


def prepare_run(args: argparse.Namespace) -> tuple[Config, Path]:
    """Resolve the config (a resumed run re-reads its saved one) and the run directory."""
    if getattr(args, "resume", None):
        run_dir = Path(args.resume)
        saved = run_dir / "config.yaml"
        if not saved.is_file():
            raise ConfigError(
                f"--resume {run_dir}: no config.yaml there; is it a perceptrl run directory?"
            )
        if not isinstance(read_yaml(saved), dict):
            raise RunError(
                f"--resume {run_dir}: its config.yaml is empty or not a recipe (the run was "
                "killed while writing it, before any step); start the run again in a new "
                "--run-dir"
            )
        overrides = [args.recipe, *args.overrides] if args.recipe else list(args.overrides)
        return load_config(saved, overrides), run_dir
    recipe, overrides = split_recipe(args.recipe, args.overrides)
    cfg = load_config(recipe, overrides)
    run_dir = make_run_dir(cfg, recipe, args.run_dir)
    save_config(cfg, run_dir / ".tmp-config.yaml")  # renamed into place: never half a config
    replace_file(run_dir / ".tmp-config.yaml", run_dir / "config.yaml")
    return cfg, run_dir


def cmd_train(args: argparse.Namespace) -> int:
    """RL training (GRPO, PPO, ...) of the recipe's side; one rank of several under torchrun or
    the deepspeed launcher (train.backend=deepspeed)."""
    cfg, run_dir, main = prepare_distributed_run(args)
    trainer = wiring.side(cfg).build_trainer(cfg, run_dir)
    trainer.fit(resume=bool(args.resume))
    if main:
        inspection.print_summary(run_dir)
    if cfg.train.backend == "deepspeed":
        from .trainer.distributed import shutdown_distributed

        shutdown_distributed()
    return 0


def prepare_distributed_run(args: argparse.Namespace) -> tuple[Config, Path, bool]:
    """``prepare_run`` once, on rank 0, its config and run directory shared with every rank (a
    timestamped directory name must not differ between ranks). Returns (cfg, run_dir, is_main)."""
    from .trainer.distributed import launched_distributed

    if not launched_distributed():
        return (*prepare_run(args), True)
    from .trainer.distributed import broadcast_object, init_distributed, rank_and_world

    init_distributed()
    rank, world = rank_and_world()
    result = None
    if rank == 0:
        try:
            result = prepare_run(args)
        except PerceptrlError as e:
            result = e
    result = broadcast_object(result)
    if isinstance(result, PerceptrlError):
        raise result
    cfg, run_dir = result
    if cfg.train.backend != "deepspeed":
        raise ConfigError(
            f"{world} processes were launched but train.backend={cfg.train.backend!r} trains in "
            "one process; add train.backend=deepspeed (train.zero_stage=2|3)"
        )
    return cfg, run_dir, rank == 0


def cmd_sft(args: argparse.Namespace) -> int:
    """Supervised warm start of the recipe's side."""
    cfg, run_dir = prepare_run(args)
    run_sft = wiring.side(cfg).run_sft
    if run_sft is None:
        raise ConfigError(
            f"side {cfg.side} has no supervised warm start; sides with one: "
            f"{', '.join(wiring.sides_with('run_sft'))}"
        )
    run_sft(cfg, run_dir)
    inspection.print_summary(run_dir)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a saved model on the recipe's held-out data (vlm) or tasks (vla); with
    ``--pass-k``, pass@k of one or more models (vlm); several VLA models or planners side by
    side."""
    more = [a for a in args.overrides if "=" not in a]  # further recipes: more task sets (vlm)
    recipe, overrides = split_recipe(args.recipe, [a for a in args.overrides if "=" in a])
    models = _named_models(args.model)
    out = _mkdir(Path(args.out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}"))
    if args.pass_k:
        ks = _int_list(args.pass_k, "--pass-k")
        cfgs = {name: load_config(recipe, [*overrides, f"model.path={path}"])
                for name, path in models.items()}  # fmt: skip
        first = next(iter(cfgs.values()))
        run_pass_k = wiring.side(first).run_pass_k
        if run_pass_k is None or more:
            raise ConfigError(
                f"--pass-k evaluates recipes of side {' | '.join(wiring.sides_with('run_pass_k'))},"
                " one task set per command"
            )
        _check_found(models)
        result = run_pass_k(cfgs, out, ks, args.pass_n or max(ks))
    elif len(models) > 1:
        cfgs = {name: load_config(recipe, [*overrides, f"model.path={path}"])
                for name, path in models.items()}  # fmt: skip
        first = next(iter(cfgs.values()))
        run_compare = wiring.side(first).run_compare
        if run_compare is None or more:
            raise ConfigError(
                "several --model values compare saved models side by side on side "
                f"{' | '.join(wiring.sides_with('run_compare'))} (success table, chart and "
                f"videos) or, with --pass-k, on side {' | '.join(wiring.sides_with('run_pass_k'))}"
            )
        _check_found(models)
        result = run_compare(cfgs, out)
    else:
        path = next(iter(models.values()))
        cfg = load_config(recipe, [*overrides, f"model.path={path}"])
        sets = [load_config(resolve_recipe(r), [*overrides, f"model.path={path}"]) for r in more]
        _check_found(models)
        result = wiring.side(cfg).run_eval(cfg, out, more=sets)
    print(result["table"])
    for path in result["files"]:
        print(f"wrote {path}")
    return 0


def _named_models(values: list[str]) -> dict[str, str]:
    """``--model`` values (``path`` or ``name=path``) as name -> path (name: the folder's, or
    its parent's when the folder is a checkpoint's ``model``)."""
    out: dict[str, str] = {}
    for v in values:
        name, _, path = v.rpartition("=") if "=" in v else ("", "", v)
        if not path.strip():
            raise ConfigError(f"--model {v!r} names no directory; give --model PATH or NAME=PATH")
        if not name:
            p = Path(path)
            name = p.parent.parent.parent.name if p.name == "model" else p.name
        if name in out:
            name = f"{name}_{len(out)}"
        out[name] = path
    return out


def _check_found(models: dict[str, str]) -> None:
    """A `ModelError` naming the first ``--model`` folder that does not exist (all are checked
    before any is evaluated)."""
    from .trainer.runtime import resolve_path

    for name, path in models.items():
        if not resolve_path(path).exists():
            raise ModelError(
                f"--model {name}={path}: no directory {path!r}; give a saved model folder (a "
                "checkpoint's model/, or an HF model folder for vlm and plan recipes)"
            )


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ConfigError(f"{flag} takes integers separated by commas, e.g. 1,2,4,8") from e
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text}: takes positive integers separated by commas, e.g. 1,2,4")
    return values


def cmd_data_generate(args: argparse.Namespace) -> int:
    """Write a synthetic set of the registered generator ``--kind`` (datasets/registry.py)."""
    gen = GENERATORS.get(args.kind)
    families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else []
    splits = {"train": args.n_train, "val": args.n_val, "test": args.n_test, "ood": args.n_ood}
    try:
        given = {"image_size": args.image_size, "seconds": args.seconds, "fps": args.fps,
                 "views": args.views, "depth": args.depth}  # fmt: skip
        options = {k: v for k, v in given.items() if v is not None}  # unset: the generator's own
        paths = gen.generate(
            args.out, splits, families or list(gen.families), seed=args.seed, **options
        )
    except ValueError as e:
        raise ConfigError(f"data generate --kind {args.kind}: {e}") from e
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The default job on the embedded default (tiny models, synthetic data, CPU): GRPO on
    synthetic counting, the base against the trained model on fresh held-out questions, then PPO
    on the MuJoCo reach task (``demo.py``). Writes ``demo.json`` and ``demo.md``."""
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    demo.run_demo(
        out, args.overrides, steps=args.steps, minutes=args.minutes,
        test_questions=args.test_questions, vla_steps=args.vla_steps, summary=inspection.print_summary,
    )  # fmt: skip
    return 0


def _mkdir(path: Path) -> Path:
    with errors.creating(path):
        path.mkdir(parents=True, exist_ok=True)
    return path


def cmd_sim_demo(args: argparse.Namespace) -> int:
    """An mp4 of the scripted expert on every MuJoCo task."""
    from .sim.showcase import main as sim_demo

    tasks = args.tasks.split(",") if args.tasks else None
    for row in sim_demo(
        args.out, tasks=tasks, seed=args.seed, size=args.size, episodes=args.episodes
    ):
        print(row)
    print(f"videos: {args.out}")
    return 0


def cmd_sim_record(args: argparse.Namespace) -> int:
    """Scripted-expert episodes of one MuJoCo task as a LeRobot dataset (format v3.0)."""
    from .sim import ENV_IDS
    from .sim.demonstrations import record_demos

    if args.task not in ENV_IDS:
        raise ConfigError(f"--task {args.task!r}: not a task (valid: {', '.join(ENV_IDS)})")
    kw = dict(obs_mode=args.obs_mode, width=args.size, height=args.size,
              cameras=tuple(c for c in args.cameras.split(",") if c))  # fmt: skip
    if args.privileged_state:
        kw["privileged_state"] = True
    info = record_demos(ENV_IDS[args.task], args.out, args.episodes, seed=args.seed, **kw)
    print(f"{info['total_episodes']} episodes, {info['total_frames']} frames -> {args.out}")
    return 0


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="YAML recipe or shipped recipe name (configs/*.yaml)")
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. algo.kl_coef=0.01 train.steps=50"
    )
    p.add_argument("--run-dir", help="run directory (default: log.dir/<recipe>-<time>)")


def _add_sim_parser(sub) -> None:
    """``perceptrl sim demo`` and ``perceptrl sim record``."""
    p = sub.add_parser("sim", help="MuJoCo manipulation suite")
    sim = p.add_subparsers(dest="sim_command", metavar="ACTION", required=True)
    g = sim.add_parser("demo", help="write an mp4 of the scripted expert on every task")
    g.add_argument("--out", default="runs/sim_demo", help="output directory")
    g.add_argument("--tasks", default="", help="comma-separated task names (default: all)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--size", type=int, default=224, help="camera resolution")
    g.add_argument("--episodes", type=int, default=1)
    g.set_defaults(func=cmd_sim_demo)
    g = sim.add_parser(
        "record", help="record scripted-expert episodes of a task as a LeRobot dataset (v3.0)"
    )
    g.add_argument("--task", required=True, help="task name (reach, push, pick, put, ...)")
    g.add_argument("--out", required=True, help="dataset folder to create")
    g.add_argument("--episodes", type=int, default=50, help="successful episodes to keep")
    g.add_argument("--seed", type=int, default=0, help="reset seed of the first attempt")
    g.add_argument("--obs-mode", choices=["rgb", "state"], default="rgb")
    g.add_argument("--size", type=int, default=64, help="camera resolution (rgb)")
    g.add_argument("--cameras", default="agentview,wrist", help="comma-separated cameras (rgb)")
    g.add_argument(
        "--privileged-state", action="store_true",
        help="rgb: also record the entity poses (observation.environment_state)",
    )  # fmt: skip
    g.set_defaults(func=cmd_sim_record)


def _add_data_parser(sub) -> None:
    """``perceptrl data generate`` over the registered generators."""
    p = sub.add_parser("data", help="synthetic data sets")
    data = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    g = data.add_parser(
        "generate",
        help="write synthetic questions: CLEVR-like images (PNG) or videos (mp4) + JSONL",
    )
    g.add_argument(
        "--kind", choices=list(GENERATORS), default="clevr",
        help="; ".join(f"{g.name}: {g.description}" for g in map(GENERATORS.get, GENERATORS)),
    )  # fmt: skip
    g.add_argument("--out", required=True, help="output directory")
    g.add_argument("--n-train", type=int, default=2000)
    g.add_argument("--n-val", type=int, default=200)
    g.add_argument("--n-test", type=int, default=500)
    g.add_argument("--n-ood", type=int, default=500, help="held-out colour-shape pairs and counts")
    g.add_argument(
        "--families",
        default=None,
        help="comma-separated families (default: all of the kind); docs/config.md lists each "
        "generator's families under data.families",
    )
    g.add_argument("--seed", type=int, default=0)
    own = "default: the generator's own"
    g.add_argument("--image-size", type=int, help=f"image side / video frame side ({own})")
    g.add_argument("--seconds", type=float, help=f"video clip length (video; {own})")
    g.add_argument("--fps", type=int, help=f"frames per second written (video; {own})")
    g.add_argument("--views", type=int, help=f"views along the camera path (spatial; {own})")
    g.add_argument("--depth", action="store_true", help="also write depth PNGs in mm (spatial)")
    g.set_defaults(func=cmd_data_generate)


def _add_demo_parser(sub) -> None:
    """``perceptrl demo``."""
    p = sub.add_parser(
        "demo", help="the default job: GRPO on synthetic visual counting, before/after table"
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides of configs/vlm_demo.yaml")
    p.add_argument("--out", help="output directory (default: runs/demo-<time>)")
    p.add_argument(
        "--steps", type=int, default=0, help="GRPO steps (default: the recipe's train.steps)"
    )
    p.add_argument(
        "--minutes", type=float, default=0.0,
        help="stop GRPO early after this many minutes (default: no limit; a slower machine "
        "takes longer and learns as much)",
    )  # fmt: skip
    p.add_argument(
        "--test-questions", type=int, default=500,
        help="fresh held-out questions scoring the base against the trained model",
    )  # fmt: skip
    p.add_argument(
        "--vla-steps", type=int, default=0,
        help="PPO steps of part 2 (default: the recipe's train.steps)",
    )  # fmt: skip
    p.set_defaults(func=cmd_demo)


def _add_eval_parser(sub) -> None:
    """``perceptrl eval``."""
    p = sub.add_parser(
        "eval",
        help="evaluate a saved model: accuracy per modality and family + bar chart (vlm), "
        "success per task + mp4 (vla)",
    )
    p.add_argument("recipe", help="recipe whose data/env settings define the evaluation")
    p.add_argument(
        "overrides", nargs="*",
        help="dotted overrides (e.g. env.eval_episodes=100) and, for vlm, more recipes whose task "
        "sets join the table (e.g. vlm_spatial vlm_video)",
    )  # fmt: skip
    p.add_argument(
        "--model",
        required=True,
        action="append",
        help="saved model directory (HF dir for vlm and plan, VLA checkpoint for vla); repeat it "
        "as name=path to compare several models side by side (VLAs, planners, or with --pass-k "
        "on one chart)",
    )
    p.add_argument(
        "--pass-k", help="vlm: pass@k for these k (e.g. 1,2,4,8,16) from sampled answers"
    )
    p.add_argument(
        "--pass-n", type=int, default=0,
        help="answers sampled per question for --pass-k (default: the largest k)",
    )  # fmt: skip
    p.add_argument("--out", help="output directory (default: runs/eval-<time>)")
    p.set_defaults(func=cmd_eval)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="perceptrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "config", help="print the resolved config of a recipe with each field's help"
    )
    p.add_argument(
        "recipe", nargs="?", help="YAML recipe or shipped recipe name (default: all defaults)"
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.kl_coef=0.01")
    p.add_argument(
        "--reference", action="store_true",
        help="print the configuration reference instead (Markdown: every key's type, default, "
        f"help and valid values, and the registries; {wiring.REFERENCE_COMMAND})",
    )  # fmt: skip
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("train", help="RL training from a recipe (GRPO/PPO/... on the vlm side)")
    _add_run_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sft", help="supervised warm start (format-following reasoning traces)")
    _add_run_args(p)
    p.set_defaults(func=cmd_sft, resume=None)

    inspection.add_parsers(sub)

    _add_demo_parser(sub)
    _add_eval_parser(sub)
    _add_sim_parser(sub)
    _add_data_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # the deepspeed launcher appends --local_rank=N (LOCAL_RANK is in the environment as well)
    argv = [a for a in argv if not a.startswith(("--local_rank=", "--local-rank="))]
    args, extra = parser.parse_known_args(argv)
    # overrides may follow options (`train r.yaml --run-dir x train.steps=5`)
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader went away (`perceptrl config x | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(
            "\nperceptrl: interrupted. A training run continues from its last checkpoint with "
            "`perceptrl train --resume <run dir>`.",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except Exception as e:  # the error boundary: a known class, or a bug
        return report(e, args)
    finally:
        if "torch.distributed" in sys.modules:  # a rank leaves its group on every exit path
            from .trainer.distributed import shutdown_distributed

            shutdown_distributed(barrier=False)


def report(e: Exception, args: argparse.Namespace | None = None) -> int:
    """Print ``e`` as the command's last word and return its exit status: an anticipated failure
    (`explain`) as one paragraph ``perceptrl: <kind> error: ...``; anything else with its
    traceback and a line saying it is a bug to report."""
    known = explain(e, args)
    if known is not None:
        print(f"perceptrl: {known.kind} error: {_paragraph(known)}", file=sys.stderr)
        return known.exit_status
    traceback.print_exception(e)
    print(
        f"perceptrl: unexpected error ({type(e).__name__}). This is a bug in perceptrl: please "
        "report it with the command you ran and the traceback above.",
        file=sys.stderr,
    )
    return EXIT_BUG


def explain(e: BaseException, args: argparse.Namespace | None = None) -> PerceptrlError | None:
    """The anticipated failure ``e`` is, as an error class of ``errors.py``, None for a bug: a
    YAML syntax error located in the recipe or override that holds it, an unregistered name, and
    what `errors.explain` translates (disk, permissions, memory)."""
    import yaml

    if isinstance(e, yaml.YAMLError):
        return _locate_yaml(e, args)
    if isinstance(e, UnknownName):
        return ConfigError(str(e))
    return errors.explain(e)


def _locate_yaml(e: BaseException, args: argparse.Namespace | None) -> ConfigError:
    """The `ConfigError` for YAML error ``e``, naming the recipe file (and line) or the override
    of this command that holds it."""
    given = [a for a in [getattr(args, "recipe", None), *getattr(args, "overrides", [])] if a]
    files = [Path(args.resume) / "config.yaml"] if getattr(args, "resume", None) else []
    files += [Path(a) for a in given if "=" not in a and Path(a).is_file()]
    return errors.locate_yaml_error(e, files, [a for a in given if "=" in a])


def _paragraph(e: BaseException) -> str:
    """The message on one line (a decoder's message may bring its own line breaks)."""
    return " ".join(str(e).split())


if __name__ == "__main__":
    sys.exit(main())
