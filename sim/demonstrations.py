"""Scripted-expert demonstrations on disk: one Parquet file and one MP4 per camera per episode.

Layout of a demonstration folder::

    meta.json                          {"env_id", "env_kwargs", "fps", "cameras", "episodes": [...]}
    episode_00000.parquet              one row per step t = 0 .. T-1
    episode_00000_agentview.mp4        T + 1 frames (mp4v): frame t is the observation of row t,
    episode_00000_wrist.mp4            the last frame is the final observation

Parquet columns: ``step`` int32; ``action`` list<float32> (A); ``proprio`` list<float32> (8) of
the observation the action was taken in; ``objects`` list<float32> (state mode only); ``reward``
float32; ``terminated``, ``truncated``, ``success`` bool; ``instruction`` string; one float32
column per shaping term (``reward/<term>``). Each ``meta.json`` episode entry: ``index``,
``seed``, ``steps``, ``success``, ``instruction``, ``parquet``, ``videos`` (camera -> file).
MP4 frames are lossy (mp4v); use them for behaviour cloning, not for exact replays.
"""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import gymnasium as gym
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .expert import ScriptedExpert
from .focus import make_env


def write_video(path: str | Path, frames: list[np.ndarray], fps: int) -> Path:
    """Write RGB frames (each (H, W, 3) uint8) to ``path`` as mp4v MP4."""
    path = Path(path)
    h, w = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
    if not writer.isOpened():
        raise RuntimeError(
            f"OpenCV could not open a mp4v writer for {path}; check the folder "
            "exists and OpenCV was built with FFmpeg or its own MP4 muxer"
        )
    for frame in frames:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def annotate(
    frame: np.ndarray, top: list[str] | tuple[str, ...] = (), bottom: str = "",
    colour: tuple[int, int, int] = (255, 255, 255),
) -> np.ndarray:  # fmt: skip
    """A copy of the RGB ``frame`` with lines of text drawn at the top (``top``, white) and one
    at the bottom (``bottom`` in ``colour``), each on a dark band so it reads on any scene; the
    font scales with the frame's width."""
    out = frame.copy()
    h, w = out.shape[:2]
    scale = max(w / 640, 0.35)
    line = int(26 * scale) + 4
    font = cv2.FONT_HERSHEY_SIMPLEX
    rows = [(text, (4, line * (i + 1) - 6), (255, 255, 255)) for i, text in enumerate(top)]
    if bottom:
        rows.append((bottom, (4, h - 6), colour))
    for text, (x, y), col in rows:
        out[max(y - line + 6, 0) : min(y + 6, h), :] //= 3
        cv2.putText(out, text, (x, y), font, scale, col, 1, cv2.LINE_AA)
    return out


def read_video(path: str | Path) -> np.ndarray:
    """All frames of a video as RGB [T, H, W, 3] uint8."""
    cap = cv2.VideoCapture(str(path))
    frames = []
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    cap.release()
    if not frames:
        raise RuntimeError(f"no frames could be decoded from {path}")
    return np.stack(frames)


def _episode(env: gym.Env, seed: int, cameras: tuple[str, ...]) -> tuple[dict, dict]:
    """Run the expert once; returns (columns of the step table, camera -> frames)."""
    obs, _ = env.reset(seed=seed)
    expert = ScriptedExpert(env)
    rows: dict[str, list] = {
        "step": [],
        "action": [],
        "proprio": [],
        "reward": [],
        "terminated": [],
        "truncated": [],
        "success": [],
        "instruction": [],
    }
    if "objects" in obs:
        rows["objects"] = []
    frames = {cam: [obs[cam]] for cam in cameras}
    for t in range(env.spec.max_episode_steps if env.spec else 200):
        action = expert.act(obs)
        rows["proprio"].append(obs["proprio"].tolist())
        if "objects" in rows:
            rows["objects"].append(obs["objects"].tolist())
        obs, reward, term, trunc, info = env.step(action)
        for key, value in (
            ("step", t),
            ("action", action.tolist()),
            ("reward", reward),
            ("terminated", term),
            ("truncated", trunc),
            ("success", info["success"]),
            ("instruction", obs["instruction"]),
        ):
            rows[key].append(value)
        for key in (k for k in info if k.startswith("reward/")):
            rows.setdefault(key, []).append(info[key])
        for cam in cameras:
            frames[cam].append(obs[cam])
        if term or trunc:
            break
    return rows, frames


def _table(rows: dict) -> pa.Table:
    types = {
        "step": pa.int32(),
        "action": pa.list_(pa.float32()),
        "proprio": pa.list_(pa.float32()),
        "objects": pa.list_(pa.float32()),
        "reward": pa.float32(),
        "terminated": pa.bool_(),
        "truncated": pa.bool_(),
        "success": pa.bool_(),
        "instruction": pa.string(),
    }
    return pa.table({k: pa.array(v, type=types.get(k, pa.float32())) for k, v in rows.items()})


def _write_episode(out: Path, idx: int, rows: dict, frames: dict, fps: int) -> dict:
    """Write one episode's Parquet table and videos; returns its ``meta.json`` entry (partial)."""
    name = f"episode_{idx:05d}"
    pq.write_table(_table(rows), out / f"{name}.parquet")
    videos = {cam: write_video(out / f"{name}_{cam}.mp4", f, fps).name for cam, f in frames.items()}
    return {"index": idx, "steps": len(rows["step"]), "instruction": rows["instruction"][0],
            "parquet": f"{name}.parquet", "videos": videos}  # fmt: skip


def record_demos(
    env_id: str,
    out_dir: str | Path,
    n_episodes: int,
    seed: int = 0,
    only_success: bool = True,
    max_attempts: int | None = None,
    **env_kwargs,
) -> dict:
    """Record ``n_episodes`` scripted-expert episodes of ``env_id`` into ``out_dir``.

    Args:
        env_id: registered id, e.g. ``"perceptrl/Put-v0"``; ``env_kwargs`` go to
            `sim.focus.make_env` (``gymnasium.make``'s options and ``subgoal_focus``).
        out_dir: folder (created) for the files described in the module docstring.
        n_episodes: episodes to keep.
        seed: episode ``k`` of the attempts uses reset seed ``seed + k``.
        only_success: keep only successful episodes (up to ``max_attempts``, default 2 n).

    Returns:
        The ``meta.json`` content.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = make_env(env_id, **env_kwargs)
    cameras = tuple(
        k for k in env.observation_space.spaces if k not in ("proprio", "objects", "instruction")
    )
    fps = int(env.metadata["render_fps"])
    meta = {
        "env_id": env_id,
        "env_kwargs": env_kwargs,
        "fps": fps,
        "cameras": list(cameras),
        "episodes": [],
    }
    attempts = max_attempts or 2 * n_episodes
    for k in range(attempts):
        if len(meta["episodes"]) >= n_episodes:
            break
        rows, frames = _episode(env, seed + k, cameras)
        success = bool(any(rows["success"]))
        if only_success and not success:
            continue
        entry = _write_episode(out, len(meta["episodes"]), rows, frames, fps)
        meta["episodes"].append({**entry, "seed": seed + k, "success": success})
    env.close()
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def load_episode(demo_dir: str | Path, index: int, videos: bool = True) -> dict:
    """One recorded episode as arrays.

    Returns:
        dict with ``actions`` [T, A] float32, ``proprio`` [T, 8] float32, ``rewards`` [T]
        float32, ``success`` [T] bool, ``instruction`` str, ``objects`` [T, D] (state mode),
        ``reward/<term>`` [T], and with ``videos`` ``frames``: camera -> [T + 1, H, W, 3] uint8.
    """
    demo_dir = Path(demo_dir)
    meta = json.loads((demo_dir / "meta.json").read_text())
    entries = meta["episodes"]
    if not 0 <= index < len(entries):
        raise IndexError(f"episode {index} not in {demo_dir} (it holds {len(entries)} episodes)")
    entry = entries[index]
    table = pq.read_table(demo_dir / entry["parquet"]).to_pydict()
    ep = {
        "actions": np.asarray(table["action"], np.float32),
        "proprio": np.asarray(table["proprio"], np.float32),
        "rewards": np.asarray(table["reward"], np.float32),
        "success": np.asarray(table["success"], bool),
        "instruction": entry["instruction"],
        "seed": entry["seed"],
    }
    if "objects" in table:
        ep["objects"] = np.asarray(table["objects"], np.float32)
    for key in (k for k in table if k.startswith("reward/")):
        ep[key] = np.asarray(table[key], np.float32)
    if videos:
        ep["frames"] = {cam: read_video(demo_dir / f) for cam, f in entry["videos"].items()}
    return ep


def load_demos(demo_dir: str | Path, videos: bool = True) -> list[dict]:
    """Every episode of a demonstration folder (see ``load_episode``)."""
    meta = json.loads((Path(demo_dir) / "meta.json").read_text())
    return [load_episode(demo_dir, e["index"], videos) for e in meta["episodes"]]
