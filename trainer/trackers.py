"""Experiment trackers beside ``metrics.jsonl``: Weights & Biases (``log.wandb``) and MLflow
(``log.mlflow``).

``metrics.jsonl`` and TensorBoard stay the record of a run; a tracker gets a copy of every row
(`Trackers`, which `trainer.metrics.MetricsLogger` feeds), the resolved recipe (W&B's config,
MLflow's params and a ``recipe.yaml`` artifact) and the files an evaluation of the run's
checkpoints writes (`log_eval_files`: images, videos and JSON tables as W&B media, every file as
an MLflow artifact).

* ``<run>/trackers.json`` keeps each tracker's settings and run id, so ``--resume`` continues the
  same W&B run (``resume="allow"``) and the same MLflow run; a resumed run sends no step at or
  below the highest step the run had logged, so no step reaches a tracker twice.
* A tracker that fails (package missing, no network, a server gone) warns once, naming itself and
  what to do, and is off for the rest of the run: training and the local files go on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Protocol

from .files import atomic_write_text

log = logging.getLogger(__name__)

EXTRA = "tracking"
"""the pip extra that installs the trackers at the tested versions"""
STATE = "trackers.json"
"""each tracker's settings and run id, in the run directory"""
IMAGES = (".png", ".jpg", ".jpeg")
VIDEOS = (".mp4", ".gif", ".webm")
ADVICE = {
    "wandb": "check `wandb login` and the network, or set log.wandb_mode=offline and upload "
    "<run>/wandb later with `wandb sync`",
    "mlflow": "check log.mlflow_tracking_uri (is the server up?), or leave it empty for the "
    "store in the run directory",
}


class Tracker(Protocol):
    """One experiment tracker's run: rows of metrics by step, files, and what continues it."""

    monotonic: bool
    """its steps only grow (a row below its last step is dropped): files take a step of their
    own, after every step the run logged"""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_artifacts(self, step: int, paths: Sequence[Path]) -> None:
        """``paths`` at ``step``, the step after the last one the run logged."""

    def state(self) -> dict:
        """Settings and run id: what `trackers.json` keeps to continue this run."""

    def close(self, failed: bool = False) -> None: ...


def wanted(log_cfg: Any, run_dir: Path) -> dict[str, dict]:
    """The enabled trackers' settings from the recipe's ``log`` section: name -> settings."""
    out: dict[str, dict] = {}
    if getattr(log_cfg, "wandb", False):
        out["wandb"] = {
            "project": log_cfg.wandb_project, "entity": log_cfg.wandb_entity,
            "name": log_cfg.wandb_name or Path(run_dir).resolve().name,
            "tags": list(log_cfg.wandb_tags), "mode": log_cfg.wandb_mode,
        }  # fmt: skip
    if getattr(log_cfg, "mlflow", False):
        out["mlflow"] = {
            "tracking_uri": log_cfg.mlflow_tracking_uri,
            "experiment": log_cfg.mlflow_experiment, "name": Path(run_dir).resolve().name,
        }  # fmt: skip
    return out


def missing_packages(log_cfg: Any) -> dict[str, list[str]]:
    """Enabled tracker -> the packages it needs that are not installed (the load-time check)."""
    need = {"wandb": ["wandb"], "mlflow": ["mlflow"]}
    uri = getattr(log_cfg, "mlflow_tracking_uri", "")
    if not uri or uri.startswith("sqlite"):  # MLflow's SQL store; mlflow-skinny has not these
        need["mlflow"] += ["sqlalchemy", "alembic"]
    out = {}
    for name in wanted(log_cfg, Path(".")):
        gone = [p for p in need[name] if not _installed(p)]
        if gone:
            out[name] = gone
    return out


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it fail
    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------------------------------------
# The two trackers
# ---------------------------------------------------------------------------------------------


class WandbTracker:
    """A W&B run whose files live under ``<run>/wandb/``; ``settings["id"]`` continues one."""

    monotonic = True

    def __init__(self, settings: dict, run_dir: Path, recipe: dict | None):
        import wandb

        self.wandb, self.settings = wandb, dict(settings)
        kept = settings.get("id")
        self.run = wandb.init(
            project=settings["project"], entity=settings["entity"] or None,
            name=settings["name"], tags=settings["tags"] or None, mode=settings["mode"],
            dir=str(Path(run_dir).resolve()), id=kept, resume="allow" if kept else None,
            config=recipe if not kept else None,
        )  # fmt: skip
        if kept and recipe is not None:  # a resume may override keys (train.steps=...)
            self.run.config.update(recipe, allow_val_change=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_artifacts(self, step: int, paths: Sequence[Path]) -> None:
        media: dict[str, Any] = {}
        for path in map(Path, paths):
            suffix = path.suffix.lower()
            if suffix in IMAGES:
                media[f"media/{path.stem}"] = self.wandb.Image(str(path))
            elif suffix in VIDEOS:
                media[f"media/{path.stem}"] = self.wandb.Video(str(path))
            elif suffix == ".json":
                columns, rows = json_table(json.loads(path.read_text()))
                media[f"table/{path.stem}"] = self.wandb.Table(columns=columns, data=rows)
        if media:
            self.run.log(media, step=step)

    def state(self) -> dict:
        return {**self.settings, "id": self.run.id}

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """An MLflow run; ``settings["run_id"]`` continues one. An empty tracking URI is the store
    in the run directory: ``<run>/mlflow.db``, artifacts in ``<run>/mlartifacts``."""

    monotonic = False

    def __init__(self, settings: dict, run_dir: Path, recipe: dict | None):
        from mlflow.tracking import MlflowClient

        self.settings = dict(settings)
        local = not settings["tracking_uri"]
        run_dir = Path(run_dir).resolve()
        uri = f"sqlite:///{run_dir / 'mlflow.db'}" if local else settings["tracking_uri"]
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = settings.get("run_id")
        if self.run_id:
            self.client.update_run(self.run_id, status="RUNNING")  # raises if it is gone
        else:
            name = settings["experiment"]
            exp = self.client.get_experiment_by_name(name)
            where = (run_dir / "mlartifacts").as_uri() if local else None
            eid = exp.experiment_id if exp else self.client.create_experiment(name, where)
            self.run_id = self.client.create_run(eid, run_name=settings["name"]).info.run_id
        if recipe is not None:
            self._log_recipe(recipe)

    def _log_recipe(self, recipe: dict) -> None:
        """The flattened recipe as params (a param never changes in MLflow: a resume's new
        values are in its ``recipe.yaml``, rewritten) and the recipe as ``recipe.yaml``."""
        from mlflow.entities import Param

        held = self.client.get_run(self.run_id).data.params
        params = [Param(k, v) for k, v in flatten(recipe).items() if k not in held]
        for i in range(0, len(params), 100):  # MLflow takes 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_dict(self.run_id, recipe, "recipe.yaml")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(rows), 1000):  # MLflow takes 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=rows[i : i + 1000])

    def log_artifacts(self, step: int, paths: Sequence[Path]) -> None:
        for path in map(Path, paths):
            self.client.log_artifact(self.run_id, str(path), f"eval/{path.parent.name}")

    def state(self) -> dict:
        return {**self.settings, "run_id": self.run_id}

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


KINDS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


# ---------------------------------------------------------------------------------------------
# The run's trackers as one sink, and the hook for evaluation files
# ---------------------------------------------------------------------------------------------


class Trackers:
    """The trackers a recipe enables, fed the rows of `MetricsLogger`. They start at the first
    row, or at a resume (`resume`), which continues the runs ``trackers.json`` names.

    ``trackers.json`` also keeps the last step each tracker got (written when the run closes,
    and by `log_eval_files`): a resume sends a tracker nothing at or below it."""

    def __init__(self, run_dir: Path, recipe: Any = None):
        self.run_dir = Path(run_dir)
        self.wanted = wanted(getattr(recipe, "log", None), self.run_dir)
        self.recipe = asdict(recipe) if self.wanted and is_dataclass(recipe) else None
        self.live: dict[str, Tracker] | None = None  # None: not started
        self.floor: dict[str, int] = {}  # per tracker: steps at or below it are not sent
        self.state: dict[str, dict] = {}  # trackers.json

    def resume(self, step: int, logged: int) -> None:
        """A resume from the checkpoint of ``step`` (-1: starting over) in a run whose rows went
        up to step ``logged``: continue the stored tracker runs past both steps."""
        if not self.wanted or self.live is not None:
            return
        if step < 0:  # starting over: new tracker runs, every step sent again
            self._start({}, -1)
        else:
            self._start(read_state(self.run_dir), max(step, logged))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.wanted:
            return
        if self.live is None:
            self._start({}, -1)  # a fresh run (a resume calls `resume` first)
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        for name in [n for n in self.live or {} if step > self.floor[n]]:
            if self._guard(name, "log", lambda t: t.log(step, numbers)):
                self.state[name]["step"] = step

    def close(self) -> None:
        failed = sys.exc_info()[0] is not None  # closed while an error stops the run
        for name in list(self.live or {}):
            self._guard(name, "finish", lambda t: t.close(failed))
        if self.wanted and self.live is not None:
            write_state(self.run_dir, self.state)
        self.live = {}

    def _start(self, kept: dict, floor: int) -> None:
        self.live, self.state = {}, dict(kept)
        for name, settings in self.wanted.items():
            same = kept.get(name, {})
            ids = {k: same[k] for k in ("id", "run_id") if k in same}
            tracker = start(name, {**settings, **ids}, self.run_dir, self.recipe)
            if tracker is not None:
                self.live[name] = tracker
                self.floor[name] = max(floor, same.get("step", -1))
                self.state[name] = {**tracker.state(), "step": self.floor[name]}
        write_state(self.run_dir, self.state)

    def _guard(self, name: str, what: str, call) -> bool:
        """``call(tracker)``; on any error, warn once and turn that tracker off."""
        try:
            call(self.live[name])
        except Exception as e:  # noqa: BLE001  (a tracker never stops the run)
            self.live.pop(name)
            _warn(name, what, e)
            return False
        return True


def start(name: str, settings: dict, run_dir: Path, recipe: dict | None) -> Tracker | None:
    """Tracker ``name`` (`KINDS`) with ``settings``; None, with one warning, when it cannot
    start (its package missing, no network, a server gone)."""
    try:
        return KINDS[name](settings, run_dir, recipe)
    except Exception as e:  # noqa: BLE001
        _warn(name, "start", e)
        return None


def _warn(name: str, what: str, e: Exception) -> None:
    fix = (
        f"install it with pip install 'perceptrl[{EXTRA}]'"
        if isinstance(e, ImportError)
        else ADVICE[name]
    )
    log.warning(
        "experiment tracker %s could not %s (%s: %s); it is off for the rest of this run, "
        "metrics.jsonl and TensorBoard go on. To use it: %s.",
        name, what, type(e).__name__, str(e).strip()[:300], fix,
    )  # fmt: skip


def read_state(run_dir: Path) -> dict:
    """``<run>/trackers.json`` (empty when there is none or it does not read)."""
    path = Path(run_dir) / STATE
    try:
        state = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        log.warning("%s does not read (%s): the trackers start new runs", path, e)
        return {}
    return state if isinstance(state, dict) else {}


def write_state(run_dir: Path, state: dict) -> None:
    atomic_write_text(Path(run_dir) / STATE, json.dumps(state, indent=1) + "\n")


def log_eval_files(models: Iterable[str | Path], files: Sequence[Path]) -> None:
    """An evaluation's ``files`` (report, charts, videos) into the tracker runs of the training
    run each of ``models`` (saved by a run: ``<run>/checkpoints/step_N/model``) belongs to: the
    nearest folder above it with a ``trackers.json``. Nothing for a model outside a tracked
    run; a tracker that fails warns once."""
    runs = {run for run in map(tracked_run, models) if run is not None}
    for run_dir in sorted(runs):
        state = read_state(run_dir)
        for name, settings in state.items():
            tracker = start(name, settings, run_dir, None) if name in KINDS else None
            step = settings.get("step", -1) + 1
            if tracker is not None and _attach(name, tracker, step, files) and tracker.monotonic:
                state[name]["step"] = step  # the files' row: a resume sends no step up to it
        write_state(run_dir, state)


def _attach(name: str, tracker: Tracker, step: int, files: Sequence[Path]) -> bool:
    """``files`` at ``step`` into an opened ``tracker``, then close it; an error warns once."""
    try:
        tracker.log_artifacts(step, files)
    except Exception as e:  # noqa: BLE001
        _warn(name, "log the evaluation files", e)
        with contextlib.suppress(Exception):
            tracker.close(failed=True)
        return False
    try:
        tracker.close()
    except Exception as e:  # noqa: BLE001
        _warn(name, "finish", e)
    log.info("%s: logged %d evaluation files at step %d", name, len(files), step)
    return True


def tracked_run(model: str | Path) -> Path | None:
    """The run directory (one with ``trackers.json``) that holds ``model``, if any."""
    path = Path(model).expanduser().resolve()
    for folder in [path, *path.parents]:
        if (folder / STATE).is_file():
            return folder
    return None


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts (letters, digits, ``_-. :/``): ``success/Reach@paraphrase``
    is logged as ``success/Reach_paraphrase``."""
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in key)


def flatten(tree: Mapping, prefix: str = "") -> dict[str, str]:
    """A nested mapping as dotted keys -> strings (lists and empty mappings as JSON)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        elif isinstance(value, (list, tuple, Mapping)):
            out[f"{prefix}{key}"] = json.dumps(value)
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def json_table(record: Any) -> tuple[list[str], list[list]]:
    """A report's JSON as a table: its first list of rows (``rows``, ``tasks``) or, without
    one, its numbers as (key, value) rows. Cells that are lists or mappings become JSON text."""
    lists = [v for v in record.values() if _rows(v)] if isinstance(record, Mapping) else []
    if _rows(record) or lists:
        rows = record if _rows(record) else lists[0]
        columns = list(dict.fromkeys(k for row in rows for k in row))
        cell = lambda v: json.dumps(v) if isinstance(v, (list, dict)) else v  # noqa: E731
        return columns, [[cell(row.get(c)) for c in columns] for row in rows]
    if not isinstance(record, Mapping):
        return ["value"], [[json.dumps(record)]]
    numbers = {k: float(v) for k, v in flatten(record).items() if _number(v)}
    return ["key", "value"], [[k, v] for k, v in numbers.items()]


def _rows(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(r, dict) for r in value)


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
