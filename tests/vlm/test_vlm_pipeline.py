"""The VLM side through the Ray rollout pipeline (trainer/pipeline.py): the shipped counting
recipe with one_step_off and async workers, end to end on the tiny model (slow: each worker
process loads its own model copy)."""

from __future__ import annotations

import pytest

from perceptrl.trainer.metrics import read_metrics
from perceptrl.vlm.run import build_trainer
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
