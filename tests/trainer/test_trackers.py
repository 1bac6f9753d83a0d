"""Experiment trackers (trainer/trackers.py) on real runs through the `perceptrl` command: W&B in
offline mode (read back from its transaction log, decoded with W&B's own protobuf records) and
MLflow's store in the run directory (read back with `MlflowClient`). Both hold the recipe and
every metrics.jsonl row; a resume continues the same runs with no step twice; an evaluation of a
checkpoint adds its report as media and artifacts; a tracker that fails warns once and the run
finishes with all of its metrics."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("MUJOCO_GL", "egl")
import torch  # noqa: E402,F401  (before any rendering, as the CLI does)

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

from perceptrl.cli import main  # noqa: E402
from perceptrl.trainer.config import ConfigError  # noqa: E402
from perceptrl.trainer.engine import build_engine  # noqa: E402
from perceptrl.trainer.loop import Trainer  # noqa: E402
from perceptrl.trainer.metrics import read_metrics  # noqa: E402
from perceptrl.trainer.trackers import flatten, mlflow_key, read_state  # noqa: E402
from perceptrl.wiring import load_config  # noqa: E402

TRACKED = ["log.wandb=true", "log.wandb_mode=offline", "log.mlflow=true", "log.wandb_tags=[t1]"]
QUIET = ["log.progress=false", "log.tensorboard=false", "log.rollouts_every=0"]
VLA = ["vla_ppo_reach_state", "env.num_envs=2", "env.eval_episodes=2", "vla.hidden=32",
       "env.steps_per_rollout=8", "env.max_episode_steps=12", "train.ppo_epochs=1"]  # fmt: skip
VLM = ["vlm_clevr", "model.path=", "data.n_train=8", "data.n_val=4", "rollout.prompts_per_step=2",
       "rollout.group_size=2", "rollout.max_new_tokens=8", "train.micro_batch_size=4",
       "train.eval_samples=4", "algo.dynamic_sampling=false"]  # fmt: skip


@pytest.fixture(autouse=True)
def quiet_trackers(monkeypatch):
    """No phoning home, no system-metrics sampler, W&B's terminal lines off."""
    for key, value in {
        "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false", "WANDB__DISABLE_STATS": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "OMP_NUM_THREADS": "1",
    }.items():  # fmt: skip
        monkeypatch.setenv(key, value)


def _cli(*args: str, cwd: Path) -> None:
    old = Path.cwd()
    os.chdir(cwd)
    try:
        assert main(list(args)) == 0
    finally:
        os.chdir(old)


# ---- reading the trackers back ---------------------------------------------------------------


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (``run-<id>.wandb``): a ``:W&B`` header, then
    LevelDB-log framing (32 KiB blocks; 7-byte chunk headers: checksum, length, kind) around
    serialized `wandb_internal_pb2.Record` messages."""
    data, pos, out, part = path.read_bytes(), 7, [], b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        part, pos = part + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def wandb_segments(run: Path) -> list[dict]:
    """Each offline W&B run directory under ``<run>/wandb`` (one per process that logged), in
    order: its run id, config, history rows by step and media files."""
    out = []
    for folder in sorted((run / "wandb").glob("offline-run-*")):
        seg = {"config": {}, "history": {}, "files": set(), "dir": folder}
        for rec in wandb_records(next(folder.glob("run-*.wandb"))):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                seg["id"], seg["tags"] = rec.run.run_id, list(rec.run.tags)
                seg["config"] = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                       for i in rec.history.item}  # fmt: skip
                step = row.pop("_step")
                assert step not in seg["history"], f"step {step} logged twice"
                seg["history"][step] = row
            elif kind == "files":
                seg["files"] |= {f.path for f in rec.files.files}
        out.append(seg)
    return out


def jsonl_by_step(run: Path) -> dict[int, dict]:
    """metrics.jsonl's numbers merged by step (a step's training row and evaluation row)."""
    out: dict[int, dict] = {}
    for row in read_metrics(run / "metrics.jsonl"):
        if "resumed_from_step" in row:
            continue
        step = row.pop("step")
        out.setdefault(step, {}).update({k: v for k, v in row.items() if v is not None})
    return out


def mlflow_run(run: Path):
    client = MlflowClient(tracking_uri=f"sqlite:///{run.resolve() / 'mlflow.db'}")
    return client, client.get_run(read_state(run)["mlflow"]["run_id"])


def assert_trackers_hold_the_metrics(run: Path, not_in_wandb: tuple = ()) -> None:
    """Every metrics.jsonl value at its step, in W&B (over its segments, but for the steps
    ``not_in_wandb``) and in MLflow; no step twice in either."""
    expected = jsonl_by_step(run)
    history: dict[int, dict] = {}
    for seg in wandb_segments(run):
        assert not history.keys() & seg["history"].keys(), "a resume sent a step again"
        history.update(seg["history"])
    for step, row in expected.items():
        for key, value in row.items() if step not in not_in_wandb else ():
            assert history[step][key] == pytest.approx(value, rel=1e-6), (step, key)
    client, mrun = mlflow_run(run)
    for key in {k for row in expected.values() for k in row}:
        got = client.get_metric_history(mrun.info.run_id, mlflow_key(key))
        want = {s: row[key] for s, row in expected.items() if key in row}
        assert [m.step for m in got] == sorted(want), key  # each step once
        assert {m.step: m.value for m in got} == pytest.approx(want, rel=1e-6), key


# ---- the tests -------------------------------------------------------------------------------


def test_vla_run_resumed_then_evaluated_keeps_one_tracker_run_each(tmp_path):
    _cli("train", *VLA, "train.steps=2", "checkpoint.every=1", *QUIET, *TRACKED,
         "--run-dir", "run", cwd=tmp_path)  # fmt: skip
    run = tmp_path / "run"
    recipe = asdict(load_config(run / "config.yaml"))
    (first,) = wandb_segments(run)
    assert {k: first["config"][k] for k in recipe} == recipe and first["tags"] == ["t1"]
    assert sorted(first["history"]) == [0, 1, 2]
    client, mrun = mlflow_run(run)
    assert mrun.data.params == flatten(recipe) and mrun.info.status == "FINISHED"
    saved = client.download_artifacts(mrun.info.run_id, "recipe.yaml", str(tmp_path))
    assert yaml.safe_load(Path(saved).read_text()) == recipe
    assert_trackers_hold_the_metrics(run)

    _cli("train", "--resume", "run", "train.steps=4", cwd=tmp_path)
    first, second = wandb_segments(run)
    assert second["id"] == first["id"] and sorted(second["history"]) == [3, 4]
    assert read_state(run)["mlflow"]["run_id"] == mrun.info.run_id
    assert_trackers_hold_the_metrics(run)  # steps 0..4 once each, in the same runs

    model = run / "checkpoints" / "step_000004" / "model"
    _cli("eval", *VLA, "env.eval_videos=1", "--model", str(model), "--out", "report",
         cwd=tmp_path)  # fmt: skip
    media = wandb_segments(run)[-1]
    assert media["id"] == first["id"] and list(media["history"]) == [5]  # after the run's steps
    row = media["history"][5]
    assert row["media/Reach/_type"] == "video-file" and row["table/eval/_type"] == "table-file"
    assert row["media/Reach/path"] in media["files"]
    assert (media["dir"] / "files" / row["media/Reach/path"]).stat().st_size > 0
    arts = {a.path for a in client.list_artifacts(mrun.info.run_id, "eval/report")}
    assert arts == {f"eval/report/{n}" for n in ("eval.json", "eval.md", "Reach.mp4")}

    # W&B's steps only grow: resumed again, its step 5 stays the evaluation's row
    _cli("train", "--resume", "run", "train.steps=6", cwd=tmp_path)
    assert sorted(wandb_segments(run)[-1]["history"]) == [6]
    assert_trackers_hold_the_metrics(run, not_in_wandb=(5,))


def test_vlm_run_logs_its_metrics_and_the_evaluation_chart(tmp_path):
    _cli("train", *VLM, "train.steps=1", *QUIET, *TRACKED, "--run-dir", "run", cwd=tmp_path)
    run = tmp_path / "run"
    assert_trackers_hold_the_metrics(run)
    model = run / "checkpoints" / "step_000001" / "model"
    _cli("eval", *VLM, "--model", str(model), "--out", "report", cwd=tmp_path)
    history = wandb_segments(run)[-1]["history"]
    assert list(history) == [2]  # the step after the run's 0 (evaluation) and 1
    row = history[2]
    assert row["media/eval/_type"] == "image-file" and row["table/eval/_type"] == "table-file"
    assert row["table/eval/nrows"] == 3  # one row per question family
    client, mrun = mlflow_run(run)
    arts = {a.path for a in client.list_artifacts(mrun.info.run_id, "eval/report")}
    assert "eval/report/eval.png" in arts and "eval/report/eval.json" in arts


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the socket is


def test_an_unreachable_tracker_warns_once_and_the_run_finishes(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    uri = f"log.mlflow_tracking_uri=http://127.0.0.1:{_closed_port()}"
    with caplog.at_level(logging.WARNING, logger="perceptrl.trainer.trackers"):
        _cli("train", *VLA, "train.steps=3", *QUIET, "log.mlflow=true", uri,
             "--run-dir", "run", cwd=tmp_path)  # fmt: skip
    (warning,) = [r.getMessage() for r in caplog.records if "tracker" in r.getMessage()]
    assert "mlflow could not start" in warning and "log.mlflow_tracking_uri" in warning
    assert sorted(jsonl_by_step(tmp_path / "run")) == [0, 1, 2, 3]


def test_a_tracker_failing_mid_run_is_turned_off_and_metrics_go_on(toy, tmp_path, caplog):
    """The MLflow run is deleted under the trainer (its store refuses every later row): one
    warning, the steps before it in MLflow, every step in metrics.jsonl."""
    Policy, Source, config = toy
    cfg = config(steps=4, eval_every=2)
    cfg.log.mlflow = True
    run = tmp_path / "run"

    def evaluator(policy) -> dict[str, float]:
        if (run / "trackers.json").exists() and (run / "metrics.jsonl").exists():
            if len(read_metrics(run / "metrics.jsonl")) >= 3:  # after step 2
                client, mrun = mlflow_run(run)
                client.delete_run(mrun.info.run_id)
        return {"score": 1.0}

    policy = Policy()
    trainer = Trainer(cfg, policy, Source(), run, engine=build_engine(policy, cfg.train),
                      evaluator=evaluator)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="perceptrl.trainer.trackers"):
        trainer.fit()
    (warning,) = [r.getMessage() for r in caplog.records if "tracker" in r.getMessage()]
    assert "mlflow could not log" in warning
    assert sorted(jsonl_by_step(run)) == [0, 1, 2, 3, 4]
    client, mrun = mlflow_run(run)
    steps = [m.step for m in client.get_metric_history(mrun.info.run_id, "reward/mean")]
    assert steps == [1, 2]


def test_a_resume_that_starts_over_starts_new_tracker_runs(toy, tmp_path):
    """Killed before its first checkpoint, a run starts over: a new MLflow run gets every step
    once; the old one keeps what it had."""
    Policy, Source, config = toy
    cfg = config(steps=2)
    cfg.log.mlflow = True
    policy = Policy()
    Trainer(cfg, policy, Source(), tmp_path, engine=build_engine(policy, cfg.train)).fit()
    old = read_state(tmp_path)["mlflow"]["run_id"]
    for path in sorted((tmp_path / "checkpoints").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()  # as if killed before it
    policy = Policy()
    trainer = Trainer(cfg, policy, Source(), tmp_path, engine=build_engine(policy, cfg.train))
    trainer.fit(resume=True)
    client, mrun = mlflow_run(tmp_path)
    assert mrun.info.run_id != old
    for run_id in (old, mrun.info.run_id):
        assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == [1, 2]


def test_a_tracker_whose_package_is_missing(toy, tmp_path, monkeypatch, caplog):
    """Refused when the recipe loads, naming the pip extra; a run built without the loader
    (a script) warns once and trains."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails
    with pytest.raises(ConfigError, match=r"log.wandb=true needs wandb.*perceptrl\[tracking\]"):
        load_config(None, ["log.wandb=true"])
    Policy, Source, config = toy
    cfg = config(steps=2)
    cfg.log.wandb = True
    policy = Policy()
    trainer = Trainer(cfg, policy, Source(), tmp_path, engine=build_engine(policy, cfg.train))
    with caplog.at_level(logging.WARNING, logger="perceptrl.trainer.trackers"):
        trainer.fit()
    (warning,) = [r.getMessage() for r in caplog.records if "tracker" in r.getMessage()]
    assert "wandb could not start" in warning and "perceptrl[tracking]" in warning
    assert sorted(jsonl_by_step(tmp_path)) == [1, 2]
