"""The LeRobot lane (`make test-lerobot`): our datasets against LeRobot's own reader and writer.

LeRobot pins an older torch than this project, so it lives in a venv of its own
(``make setup-lerobot``: .venv-lerobot, requirements-lerobot.txt). These tests run in our venv
and call that venv's Python on ``tests/sim/lerobot_venv.py`` (which imports lerobot and not
perceptrl): each library runs where it is installed. ``PERCEPTRL_LEROBOT_PYTHON`` names another
interpreter; without one the tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from perceptrl.sim import ENV_IDS
from perceptrl.sim.demonstrations import load_episode, record_demos
from perceptrl.sim.lerobot_format import DatasetReader

pytestmark = pytest.mark.lerobot

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "lerobot_venv.py"
PYTHON = Path(os.environ.get("PERCEPTRL_LEROBOT_PYTHON", ROOT / ".venv-lerobot/bin/python"))
QUIET = ["log.progress=false", "log.tensorboard=false", "train.device=cpu"]


def lerobot(*args) -> None:
    """Run the LeRobot side (`lerobot_venv.py`) in the lane's venv."""
    if not PYTHON.exists():
        pytest.skip(f"no LeRobot venv at {PYTHON}; run `make setup-lerobot`")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    res = subprocess.run([str(PYTHON), str(SCRIPT), *map(str, args)], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.parametrize("mode", ["rgb", "state"])
def test_lerobot_reads_our_export(tmp_path, mode):
    """Shapes, fps, tasks, episodes and frames of `record_demos`'s dataset, as LeRobot's
    `LeRobotDataset` (root = the folder, no hub) reads them: the same numbers as our reader's,
    and video frames that decode to ours."""
    root = tmp_path / "demos"
    kw = {"width": 32, "height": 32} if mode == "rgb" else {"obs_mode": "state"}
    info = record_demos(ENV_IDS["pick"], root, n_episodes=3, seed=1, **kw)
    lerobot("read", root, tmp_path / "out")
    got = json.loads((tmp_path / "out/summary.json").read_text())
    ours = DatasetReader(root)
    assert got["codebase_version"] == "v3.0" and got["fps"] == 20
    assert got["num_episodes"] == 3 and got["num_frames"] == info["total_frames"]
    assert got["lengths"] == [e["length"] for e in ours.episodes]
    assert got["tasks"] == {t: i for i, t in ours.tasks.items()}
    assert got["shapes"]["observation.state"] == [8] and got["shapes"]["action"] == [5]
    cams = ["observation.images.agentview", "observation.images.wrist"] if mode == "rgb" else []
    assert got["video_keys"] == cams
    for cam in cams:
        assert got["shapes"][cam] == [32, 32, 3]
    if mode == "state":
        assert got["shapes"]["observation.environment_state"] == [21]
    assert {"action", "observation.state", *cams} <= set(got["stats_keys"])
    starts = np.cumsum([0] + got["lengths"])
    frames = np.load(tmp_path / "out/frames.npz")
    for j, (index, item) in enumerate(zip(got["picks"], got["items"])):
        e = int(np.searchsorted(starts, index, side="right") - 1)
        t = index - starts[e]
        ep = load_episode(ours, e, videos=mode == "rgb")
        assert item["episode_index"] == e and item["frame_index"] == t and item["index"] == index
        assert item["task"] == ep["instruction"]
        assert np.allclose(item["action"], ep["actions"][t], atol=1e-6)
        assert np.allclose(item["observation.state"], ep["proprio"][t], atol=1e-6)
        for cam in cams:
            mine = ep["frames"][cam.rsplit(".", 1)[1]][t].astype(float)
            assert np.abs(frames[cam][j].astype(float) - mine).mean() < 3


def test_a_dataset_lerobot_wrote_trains_here(tmp_path):
    """LeRobot's writer (create, add_frame, save_episode, finalize; H.264) -> our reader reads
    its episodes, tasks and frames -> `perceptrl sft` clones it for a few steps. The same
    dataset in AV1, LeRobot's default codec, reads the same frames (within the two codecs'
    loss)."""
    from perceptrl.cli import main
    from perceptrl.trainer.metrics import read_metrics

    root = tmp_path / "teleop"
    lerobot("write", root, "h264")
    data = DatasetReader(root)
    assert [e["length"] for e in data.episodes] == [12, 7, 15] and data.fps == 20
    assert set(data.tasks.values()) == {"reach the red target", "reach the blue target"}
    k = 0
    for e in range(3):
        cols, frames = data.columns(e), data.frames("observation.images.front", e)
        n = len(frames)
        assert cols["observation.state"][:, 0].tolist() == list(range(k, k + n))
        levels = (11 * np.arange(k, k + n)) % 220 + 20
        assert np.abs(frames.mean((1, 2, 3)) - levels).max() < 3
        k += n
    # the sim has no camera named front: the policy's agentview input reads the dataset's front
    args = ["vla_ppo_reach", "env.cameras=[agentview]",
            "bc.features.agentview=observation.images.front", "env.image_size=24",
            "env.privileged_state=false", "vla.critic=shared", "vla.aux=none",
            "vla.channels=[4,8,8]", "vla.hidden=32", "env.num_envs=2", "env.steps_per_rollout=8",
            "env.eval_episodes=0", "train.steps=3", f"bc.dataset={root}", *QUIET]  # fmt: skip
    assert main(["sft", *args, "--run-dir", str(tmp_path / "run")]) == 0
    losses = [
        r["sft/loss"] for r in read_metrics(tmp_path / "run/metrics.jsonl") if "sft/loss" in r
    ]
    assert len(losses) == 3 and all(np.isfinite(losses))

    av1 = tmp_path / "teleop_av1"
    lerobot("write", av1, "libsvtav1")
    from perceptrl.vla.bc_dataset import check_videos

    again = DatasetReader(av1)
    assert again.features["observation.images.front"]["info"]["video.codec"] == "av1"
    check_videos(again, "observation.images.front")
    for e in range(3):
        h264, frames = (
            data.frames("observation.images.front", e),
            again.frames("observation.images.front", e, 2, 6),
        )
        assert frames.shape == (4, *h264.shape[1:])
        assert np.abs(frames.mean((1, 2, 3)) - h264[2:6].mean((1, 2, 3))).max() < 3
