"""The VLM side through the Ray rollout pipeline (trainer/pipeline.py): the shipped counting
recipe with one_step_off and async workers, end to end on the tiny model (slow: each worker
process loads its own model copy)."""

from __future__ import annotations

import os

import pytest

from perceptrl.trainer.metrics import read_metrics
from perceptrl.trainer.records import read_records
from perceptrl.vlm.builder import build_trainer
from perceptrl.wiring import load_config

pytest.importorskip("ray")

TINY = [
    "model.path=", "train.steps=3", "train.device=cpu", "rollout.prompts_per_step=4",
    "rollout.group_size=4", "rollout.max_new_tokens=16", "data.n_train=32", "data.n_val=4",
    "train.eval_samples=4", "algo.dynamic_sampling=false", "algo.tis_cap=2",
    "checkpoint.every=0", "log.progress=false", "log.tensorboard=false",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mode, workers", [("one_step_off", 1), ("async", 2)])
def test_vlm_recipe_trains_through_the_pipeline(tmp_path, mode, workers):
    import ray

    cfg = load_config(
        "configs/vlm_clevr.yaml", [*TINY, f"train.pipeline={mode}", f"rollout.workers={workers}"]
    )
    trainer = build_trainer(cfg, tmp_path)
    try:
        trainer.fit()
    finally:
        trainer.source.close()
        ray.shutdown()
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "pipeline/staleness_max" in r]
    assert len(rows) == 3 and rows[0]["pipeline/staleness_max"] == 0.0
    assert all(r["pipeline/staleness_max"] <= 1.0 for r in rows)
    assert all(r["rollout/samples"] == 16.0 for r in rows)  # 4 prompts x 4 per step
    stale = [r for r in rows if r["pipeline/staleness_max"] == 1.0]
    assert stale and all("correction/weight_mean" in r for r in stale)
    # the rollout records hold the VLM side's fields (read in the trainer's process)
    group = read_records(tmp_path)[0]["groups"][0]
    assert group["prompt"] and group["images"] and isinstance(group["rows"][0]["text"], str)


@pytest.mark.slow
def test_two_ranks_train_from_one_pipeline_driven_by_rank_0(tmp_path):
    """`perceptrl train` as 2 DeepSpeed ranks (torchrun, gloo) with train.pipeline=one_step_off:
    rank 0 is the only Ray driver, each step's 4 groups are split 2 and 2 over the ranks, and
    the run trains and logs like a single-process pipeline run."""
    import subprocess
    import sys

    run = tmp_path / "ranks"
    overrides = [
        *TINY, "train.steps=2", "train.backend=deepspeed", "train.zero_stage=2",
        "train.pipeline=one_step_off", "rollout.workers=1", "train.micro_batch_size=4",
    ]  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "perceptrl.cli", "train", "vlm_clevr", "--run-dir", str(run), *overrides,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "pipeline/staleness_max" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/samples"] == 16.0 for r in rows)  # the global batch, 4 prompts x 4
    assert rows[1]["pipeline/staleness_max"] == 1.0 and "correction/weight_mean" in rows[1]
    assert all(r["pipeline/dropped_groups_uneven"] == 0.0 for r in rows)
