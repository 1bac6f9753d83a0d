"""The VLA side through the Ray rollout pipeline (trainer/pipeline.py, vla/workers.py): the
shipped PPO recipe from state with one_step_off and async workers (slow: every worker builds its
own envs and policy copy)."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest  # noqa: E402

from perceptrl.trainer.metrics import read_metrics  # noqa: E402
from perceptrl.trainer.records import read_records  # noqa: E402
from perceptrl.vla.builder import build_trainer  # noqa: E402
from perceptrl.wiring import load_config  # noqa: E402

pytest.importorskip("ray")


@pytest.mark.slow
@pytest.mark.parametrize("mode, workers", [("one_step_off", 1), ("async", 2)])
def test_vla_recipe_trains_through_the_pipeline(tmp_path, mode, workers):
    import ray

    cfg = load_config(
        "configs/vla_ppo_reach_state.yaml",
        [f"train.pipeline={mode}", f"rollout.workers={workers}", "train.steps=3",
         "env.eval_episodes=2", "log.progress=false", "log.tensorboard=false",
         "algo.tis_cap=2", "checkpoint.every=0"],
    )  # fmt: skip
    trainer = build_trainer(cfg, tmp_path)
    try:
        trainer.fit()
    finally:
        trainer.source.close()
        ray.shutdown()
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "pipeline/staleness_max" in r]
    per_step = cfg.env.num_envs * cfg.env.steps_per_rollout * cfg.env.action_chunk
    assert len(rows) == 3 and all(r["rollout/env_steps"] == per_step for r in rows)
    assert rows[0]["pipeline/staleness_max"] == 0.0 and rows[-1]["pipeline/staleness_max"] >= 1
    assert "correction/weight_mean" in rows[-1] and "critic/vf_explained_var" in rows[-1]
    # the rollout records hold the VLA side's fields (read in the trainer's process)
    group = read_records(tmp_path)[0]["groups"][0]
    assert group["env"] == cfg.env.id and group["rows"][0]["actions"]
