"""Demonstration recording/loading and the per-task demo videos."""

from __future__ import annotations

import json

import numpy as np

from perceptrl.sim import ENV_IDS
from perceptrl.sim.demonstrations import load_demos, load_episode, read_video, record_demos
from perceptrl.sim.showcase import main as demo_main


def test_record_and_load_round_trip(tmp_path):
    meta = record_demos(ENV_IDS["pick"], tmp_path, n_episodes=2, seed=5, width=32, height=32)
    assert [e["seed"] for e in meta["episodes"]] == [5, 6]
    assert json.loads((tmp_path / "meta.json").read_text()) == meta
    ep = load_episode(tmp_path, 1)
    steps = meta["episodes"][1]["steps"]
    assert ep["actions"].shape == (steps, 5) and np.abs(ep["actions"]).max() <= 1.0
    assert ep["proprio"].shape == (steps, 8) and ep["rewards"].shape == (steps,)
    assert ep["success"][-1] and ep["rewards"][-1] == 1.0
    assert ep["frames"]["agentview"].shape == (steps + 1, 32, 32, 3)
    assert ep["frames"]["wrist"].shape == (steps + 1, 32, 32, 3)
    assert any(w in ep["instruction"] for w in ("pick", "lift", "grab", "raise"))
    assert "reward/grasp" in ep and ep["reward/grasp"].max() == 1.0
    assert len(load_demos(tmp_path, videos=False)) == 2


def test_state_mode_demos_store_object_poses(tmp_path):
    record_demos(ENV_IDS["reach"], tmp_path, n_episodes=1, obs_mode="state")
    ep = load_episode(tmp_path, 0, videos=False)
    assert ep["objects"].shape[0] == ep["actions"].shape[0]


def test_demo_writes_one_video_per_task(tmp_path):
    results = demo_main(tmp_path, tasks=["reach", "push"], size=64)
    for r in results:
        video = read_video(r["video"])
        assert video.shape[1:] == (64, 128, 3) and len(video) > 5
        assert all(e["success"] for e in r["episodes"])
