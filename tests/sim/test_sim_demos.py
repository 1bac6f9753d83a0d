"""Recorded episodes as LeRobot v3.0 datasets (written and read back without LeRobot), and the
per-task demo videos."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from perceptrl.errors import DataError
from perceptrl.sim import ENV_IDS
from perceptrl.sim.demonstrations import load_demos, load_episode, read_video, record_demos
from perceptrl.sim.lerobot_format import DatasetReader, DatasetWriter
from perceptrl.sim.showcase import main as demo_main

CAM = "observation.images.agentview"


def test_record_writes_the_lerobot_v3_layout(tmp_path):
    root = tmp_path / "pick"
    info = record_demos(ENV_IDS["pick"], root, n_episodes=2, seed=5, width=32, height=32)
    for rel in ("meta/info.json", "meta/stats.json", "meta/tasks.parquet",
                "meta/episodes/chunk-000/file-000.parquet", "data/chunk-000/file-000.parquet",
                f"videos/{CAM}/chunk-000/file-000.mp4",
                "videos/observation.images.wrist/chunk-000/file-000.mp4"):  # fmt: skip
        assert (root / rel).is_file(), rel
    assert json.loads((root / "meta/info.json").read_text()) == info
    assert info["codebase_version"] == "v3.0" and info["fps"] == 20
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == (
        "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    )
    ft = info["features"]
    assert ft[CAM]["dtype"] == "video" and ft[CAM]["shape"] == [32, 32, 3]
    assert ft["observation.state"] == {"dtype": "float32", "shape": [8], "names": ft[
        "observation.state"]["names"]} and len(ft["observation.state"]["names"]) == 8  # fmt: skip
    assert ft["action"]["shape"] == [5] and ft["action"]["names"][0] == "dx"
    assert ft["next.reward_terms"]["names"] == ["reach", "grasp", "lift"]
    assert {"timestamp", "frame_index", "episode_index", "index", "task_index"} <= set(ft)

    data = DatasetReader(root)
    eps = data.episodes
    assert [e["seed"] for e in eps] == [5, 6] and all(e["success"] for e in eps)
    assert info["total_episodes"] == 2 and info["total_frames"] == sum(e["length"] for e in eps)
    assert eps[1]["dataset_from_index"] == eps[0]["dataset_to_index"] == eps[0]["length"]
    assert eps[1][f"videos/{CAM}/from_timestamp"] == pytest.approx(eps[0]["length"] / 20)
    assert set(data.tasks.values()) == {e["tasks"][0] for e in eps}
    ep = load_episode(root, 1)
    steps = eps[1]["length"]
    assert ep["actions"].shape == (steps, 5) and np.abs(ep["actions"]).max() <= 1.0
    assert ep["proprio"].shape == (steps, 8) and ep["rewards"].shape == (steps,)
    assert ep["success"][-1] and ep["rewards"][-1] == 1.0
    assert ep["frames"]["agentview"].shape == ep["frames"]["wrist"].shape == (steps, 32, 32, 3)
    assert any(w in ep["instruction"] for w in ("pick", "lift", "grab", "raise"))
    assert "reward/grasp" in ep and ep["reward/grasp"].max() == 1.0
    assert len(load_demos(root, videos=False)) == 2


def test_state_mode_demos_store_object_poses(tmp_path):
    record_demos(ENV_IDS["reach"], tmp_path / "d", n_episodes=1, obs_mode="state")
    ep = load_episode(tmp_path / "d", 0, videos=False)
    assert ep["objects"].shape == (len(ep["actions"]), 21) and "reward/reach" in ep
    assert DatasetReader(tmp_path / "d").info["video_path"] is None


def _synthetic(root, lengths=(7, 5, 9), size=16, task="go"):
    """Episodes whose frame k (over the whole dataset) is one flat grey level 11 k + 20, so a
    decoded frame names its place (within half a step: the codec moves it a few levels); actions and state count the frames."""
    features = {CAM: {"dtype": "video", "shape": [size, size, 3], "names": None},
                "observation.state": {"dtype": "float32", "shape": [2], "names": None},
                "action": {"dtype": "float32", "shape": [3], "names": None},
                "next.done": {"dtype": "bool", "shape": [1], "names": None}}  # fmt: skip
    w, k = DatasetWriter(root, 10, features), 0
    for e, n in enumerate(lengths):
        idx = np.arange(k, k + n)
        w.add_episode({
            CAM: np.broadcast_to((11 * idx + 20)[:, None, None, None], (n, size, size, 3)).astype(np.uint8),
            "observation.state": np.stack([idx, np.full(n, e)], 1).astype(np.float32),
            "action": np.stack([idx, idx * 2, np.full(n, e)], 1).astype(np.float32),
            "next.done": np.arange(n) == n - 1,
        }, f"{task} {e % 2}")  # fmt: skip
        k += n
    return w.finalize()


def test_episode_boundaries_frames_stats_and_tasks_round_trip(tmp_path):
    info = _synthetic(tmp_path / "s")
    data = DatasetReader(tmp_path / "s")
    assert info["total_frames"] == 21 and info["total_tasks"] == 2 and data.fps == 10
    assert data.tasks == {0: "go 0", 1: "go 1"}
    k = 0
    for e, ep in enumerate(data.episodes):
        n = ep["length"]
        cols = data.columns(e)
        assert cols["frame_index"].tolist() == list(range(n))
        assert cols["index"].tolist() == list(range(k, k + n))
        assert np.allclose(cols["timestamp"], np.arange(n) / 10)
        assert cols["action"][:, 0].tolist() == list(range(k, k + n))
        assert cols["task"] == [f"go {e % 2}"] * n and cols["next.done"][-1]
        frames = data.frames(CAM, e)  # the whole episode, then a window in the middle
        assert frames.shape == (n, 16, 16, 3)
        assert np.abs(frames.mean((1, 2, 3)) - (11 * np.arange(k, k + n) + 20)).max() < 5
        window = data.frames(CAM, e, 2, 4).mean((1, 2, 3))
        assert np.abs(window - (11 * np.arange(k + 2, k + 4) + 20)).max() < 5
        k += n
    stats = json.loads((tmp_path / "s/meta/stats.json").read_text())
    actions = np.arange(21, dtype=float)
    assert stats["action"]["mean"][0] == pytest.approx(actions.mean())
    assert stats["action"]["std"][0] == pytest.approx(actions.std())
    assert stats["action"]["min"][0] == 0 and stats["action"]["max"][0] == 20
    assert stats["action"]["count"] == [21] and len(stats["action"]["q50"]) == 3
    assert np.array(stats[CAM]["mean"]).shape == (3, 1, 1) and stats[CAM]["max"][0][0][0] <= 1
    ep_stats = pq.read_table(tmp_path / "s/meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert ep_stats[1]["stats/action/min"] == [7, 14, 1] and ep_stats[1]["stats/index/max"] == [11]


def test_tasks_parquet_reads_as_lerobot_reads_it(tmp_path):
    pd = pytest.importorskip("pandas")
    _synthetic(tmp_path / "s")
    tasks = pd.read_parquet(tmp_path / "s/meta/tasks.parquet")  # LeRobot's load_tasks
    assert tasks.index.tolist() == ["go 0", "go 1"] and tasks.iloc[1].name == "go 1"
    assert tasks.loc["go 1"].task_index == 1


def test_malformed_datasets_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="meta/info.json is missing"):
        DatasetReader(tmp_path)
    _synthetic(tmp_path / "s")
    info = json.loads((tmp_path / "s/meta/info.json").read_text())
    (tmp_path / "s/meta/info.json").write_text(json.dumps({**info, "codebase_version": "v2.1"}))
    with pytest.raises(DataError, match="v2.1.*convert"):
        DatasetReader(tmp_path / "s")
    (tmp_path / "s/meta/info.json").write_text(json.dumps(info))
    video = tmp_path / "s/videos" / CAM / "chunk-000/file-000.mp4"
    video.write_bytes(video.read_bytes()[:200])  # truncated
    with pytest.raises(DataError, match="file-000.mp4"):
        DatasetReader(tmp_path / "s").frames(CAM, 1)
    with pytest.raises(DataError, match="already holds a dataset"):
        _synthetic(tmp_path / "s")


def test_demo_writes_one_video_per_task(tmp_path):
    results = demo_main(tmp_path, tasks=["reach", "push"], size=64)
    for r in results:
        video = read_video(r["video"])
        assert video.shape[1:] == (64, 128, 3) and len(video) > 5
        assert all(e["success"] for e in r["episodes"])
