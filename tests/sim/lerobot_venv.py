"""The LeRobot side of the LeRobot lane (`make test-lerobot`): run by the lane venv's Python
(.venv-lerobot, which has lerobot and no perceptrl), never imported by the tests themselves.

    python lerobot_venv.py read ROOT OUT_DIR     LeRobotDataset(root=ROOT) -> OUT_DIR/summary.json
                                                 and OUT_DIR/frames.npz (decoded frames of a few
                                                 items, [N, H, W, 3] uint8 per camera)
    python lerobot_venv.py write ROOT CODEC      LeRobotDataset.create + add_frame + save_episode +
                                                 finalize: `EPISODES` episodes (see `frame`)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

FPS, SIZE = 20, 32
EPISODES = (12, 7, 15)
"""lengths of the episodes `write` records"""
CAMERA = "observation.images.front"


def frame(k: int, episode: int) -> dict:
    """Frame ``k`` of the whole dataset (in episode ``episode``): a flat grey image of level
    11 k % 220 + 20, state [k, episode, 0 ...] (8 values), action [sin k, cos k, 0.1 episode,
    0, 0.5] (5 values), task "reach the <red|blue> target"."""
    level = (11 * k) % 220 + 20
    state = np.zeros(8, np.float32)
    state[:2] = k, episode
    action = np.array([np.sin(k), np.cos(k), 0.1 * episode, 0.0, 0.5], np.float32)
    return {
        CAMERA: np.full((SIZE, SIZE, 3), level, np.uint8),
        "observation.state": state,
        "action": action,
        "task": f"reach the {('red', 'blue')[episode % 2]} target",
    }


def write(root: str, codec: str) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    features = {
        CAMERA: {
            "dtype": "video",
            "shape": (SIZE, SIZE, 3),
            "names": ["height", "width", "channels"],
        },
        "observation.state": {"dtype": "float32", "shape": (8,), "names": None},
        "action": {"dtype": "float32", "shape": (5,), "names": None},
    }
    ds = LeRobotDataset.create(
        "local/teleop", FPS, features, root=root, robot_type="test_arm", vcodec=codec,
        video_backend="pyav",
    )  # fmt: skip
    k = 0
    for e, n in enumerate(EPISODES):
        for _ in range(n):
            ds.add_frame(frame(k, e))
            k += 1
        ds.save_episode(parallel_encoding=False)
    ds.finalize()


def read(root: str, out: str) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset("local/ours", root=root, video_backend="pyav")
    picks = sorted({0, len(ds) // 2, len(ds) - 1})
    items = [ds[i] for i in picks]
    summary = {
        "fps": ds.fps,
        "num_episodes": ds.num_episodes,
        "num_frames": ds.num_frames,
        "codebase_version": ds.meta.info["codebase_version"],
        "shapes": {k: list(v) for k, v in ds.meta.shapes.items()},
        "video_keys": list(ds.meta.video_keys),
        "tasks": {str(t): int(i) for t, i in zip(ds.meta.tasks.index, ds.meta.tasks.task_index)},
        "lengths": [int(e["length"]) for e in ds.meta.episodes],
        "stats_keys": sorted(ds.meta.stats),
        "picks": picks,
        "items": [
            {
                k: (v.tolist() if hasattr(v, "tolist") and k not in ds.meta.video_keys else None)
                for k, v in it.items()
                if k not in ds.meta.video_keys
            }
            | {"task": it["task"]}
            for it in items
        ],  # fmt: skip
    }
    frames = {  # LeRobot gives [C, H, W] floats in [0, 1]
        k: np.stack(
            [(it[k].numpy().transpose(1, 2, 0) * 255).round().astype(np.uint8) for it in items]
        )
        for k in ds.meta.video_keys
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "summary.json").write_text(json.dumps(summary))
    np.savez(Path(out) / "frames.npz", **frames)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"read": read, "write": write}[command](*args)
