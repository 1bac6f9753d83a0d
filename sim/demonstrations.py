"""Recorded episodes on disk as LeRobot datasets (format v3.0, `sim.lerobot_format`), and the
MP4 helpers the other modules use (`write_video`, `read_video`, `annotate`).

`record_episode` is the one loop that records an episode of a sim env, whoever acts (the
scripted expert here, a policy in ``vla/evaluate.py``); `record_demos` writes scripted-expert
episodes of a task as a dataset, `load_episode`/`load_demos` read one back as arrays. Features
of a dataset written from a sim env (`sim_features`):

=================================  ==========  ===============================================
feature                            shape       what
=================================  ==========  ===============================================
``observation.images.<camera>``    (H, W, 3)   video, one per camera of the env (rgb mode)
``observation.state``              (8,)        proprio: tcp position, quaternion, gripper width
``observation.environment_state``  (E * 7,)    entity poses (state mode, or privileged_state)
``action``                         (A,)        the action taken in that observation
``next.reward``                    (1,)        the env's reward for it
``next.done``                      (1,)        bool: the episode ended with it
``next.success``                   (1,)        bool: the task reported success after it
``next.reward_terms``              (n,)        the task's shaping terms (names: the terms)
=================================  ==========  ===============================================

The task of every frame is the episode's instruction; each episodes-metadata row also has the
reset ``seed`` and ``success`` (any step succeeded). Frames are the observations the actions were
taken in: the final observation after the last action is not stored. MP4 frames are lossy
(mp4v); use them for behaviour cloning, not for exact replays.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import cv2
import gymnasium as gym
import numpy as np

from .expert import ScriptedExpert
from .focus import make_env
from .lerobot_format import DatasetReader, DatasetWriter


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


STATE, ENV_STATE, ACTION = "observation.state", "observation.environment_state", "action"
"""the names our export gives proprio, entity poses and actions (`camera_feature` the cameras')"""
ROBOT_TYPE = "perceptrl_arm7"
PROPRIO_NAMES = ["tcp_x", "tcp_y", "tcp_z", "tcp_qw", "tcp_qx", "tcp_qy", "tcp_qz", "gripper"]
ACTION_NAMES = {5: ["dx", "dy", "dz", "dyaw", "gripper"],
                8: [*(f"q{i}" for i in range(1, 8)), "gripper"]}  # fmt: skip


def camera_feature(camera: str) -> str:
    """The dataset feature of a camera's frames: ``observation.images.<camera>``."""
    return f"observation.images.{camera}"


def cameras_of(space: gym.spaces.Dict) -> list[str]:
    """The image entries of a sim env's observation space, in order."""
    return [k for k in space.spaces if k not in ("proprio", "objects", "instruction")]


def record_episode(
    env: gym.Env, act: Callable[[dict], np.ndarray], seed: int | None = None,
    on_reset: Callable[[], None] | None = None,
) -> dict:  # fmt: skip
    """Run one episode of ``env`` (a sim env, any wrappers) and keep every step.

    Args:
        act: observation dict -> one action [A] or a chunk [K, A], executed open-loop (the
            observation of each of its steps is recorded).
        seed: the reset seed.
        on_reset: called after the reset (a scripted expert's ``reset``).

    Returns:
        ``{"columns": {feature: [T, ...]}, "instruction": str, "success": bool, "terms": names}``
        with the features of `sim_features` (the shaping terms in ``next.reward_terms``).
    """
    obs, _ = env.reset(seed=seed)
    if on_reset is not None:
        on_reset()
    cams = cameras_of(env.observation_space)
    keys = {STATE: "proprio", ENV_STATE: "objects", **{camera_feature(c): c for c in cams}}
    cols: dict[str, list] = {k: [] for k, o in keys.items() if o in obs}
    cols.update({ACTION: [], "next.reward": [], "next.done": [], "next.success": []})
    terms: dict[str, list] = {}
    instruction, done = str(obs["instruction"]), False
    while not done:
        for action in np.asarray(act(obs), np.float32).reshape(-1, env.action_space.shape[0]):
            for key, o in keys.items():
                if o in obs:
                    cols[key].append(obs[o])
            obs, reward, term, trunc, info = env.step(action)
            done = bool(term or trunc)
            for key, value in ((ACTION, action), ("next.reward", reward), ("next.done", done),
                               ("next.success", bool(info.get("success", False)))):  # fmt: skip
                cols[key].append(value)
            for name in (k for k in info if k.startswith("reward/") and k != "reward/success"):
                terms.setdefault(name[len("reward/") :], []).append(info[name])
            if done:
                break
    columns = {k: np.asarray(v) for k, v in cols.items()}
    columns["next.reward_terms"] = np.asarray(list(terms.values()), np.float32).T.reshape(
        len(columns[ACTION]), len(terms)
    )
    success = bool(columns["next.success"].any())
    return {"columns": columns, "instruction": instruction, "success": success,
            "terms": list(terms)}  # fmt: skip


def sim_features(env: gym.Env, terms: list[str]) -> dict:
    """The LeRobot features of a dataset recorded from ``env`` (see the module docstring);
    ``terms``: the task's shaping-term names (`record_episode` returns them)."""
    space, A = env.observation_space, int(env.action_space.shape[0])
    out = {camera_feature(c): {"dtype": "video", "shape": list(space[c].shape),
                               "names": ["height", "width", "channels"]}
           for c in cameras_of(space)}  # fmt: skip
    out[STATE] = {"dtype": "float32", "shape": [8], "names": PROPRIO_NAMES}
    if "objects" in space.spaces:
        out[ENV_STATE] = {"dtype": "float32", "shape": list(space["objects"].shape), "names": None}
    out[ACTION] = {"dtype": "float32", "shape": [A], "names": ACTION_NAMES.get(A)}
    out["next.reward"] = {"dtype": "float32", "shape": [1], "names": None}
    out["next.done"] = {"dtype": "bool", "shape": [1], "names": None}
    out["next.success"] = {"dtype": "bool", "shape": [1], "names": None}
    out["next.reward_terms"] = {"dtype": "float32", "shape": [len(terms)], "names": terms}
    return out


class EpisodeWriter:
    """Episodes of `record_episode` into a LeRobot dataset at ``root``, its features taken from
    ``env`` and the first episode's shaping terms; `close` writes the metadata.

    Episodes of one dataset share their features: one task's env (its entities, cameras and
    shaping terms)."""

    def __init__(self, root: str | Path, env: gym.Env):
        self.root, self.env = Path(root), env
        self.writer: DatasetWriter | None = None

    def add(self, episode: dict, **extra) -> int:
        """Append ``episode``; ``extra``: more columns of its episodes-metadata row."""
        if self.writer is None:
            features = sim_features(self.env, episode["terms"])
            fps = int(self.env.metadata.get("render_fps", 20))
            self.writer = DatasetWriter(self.root, fps, features, robot_type=ROBOT_TYPE)
        return self.writer.add_episode(episode["columns"], episode["instruction"], **extra)

    def close(self) -> dict:
        """Write the metadata; returns ``info.json``'s content."""
        if self.writer is None:
            raise ValueError(f"no episode was recorded into {self.root}")
        return self.writer.finalize()


def record_demos(
    env_id: str,
    out_dir: str | Path,
    n_episodes: int,
    seed: int = 0,
    only_success: bool = True,
    max_attempts: int | None = None,
    **env_kwargs,
) -> dict:
    """Record ``n_episodes`` scripted-expert episodes of ``env_id`` as a LeRobot dataset.

    Args:
        env_id: registered id, e.g. ``"perceptrl/Put-v0"``; ``env_kwargs`` go to
            `sim.focus.make_env` (``gymnasium.make``'s options and ``subgoal_focus``).
        out_dir: the dataset folder (created; see the module docstring).
        n_episodes: episodes to keep.
        seed: attempt ``k`` uses reset seed ``seed + k``.
        only_success: keep only successful episodes (up to ``max_attempts``, default 2 n).

    Returns:
        The dataset's ``meta/info.json`` content.
    """
    env = make_env(env_id, **env_kwargs)
    expert = ScriptedExpert(env)
    out = EpisodeWriter(out_dir, env)
    kept = 0
    try:
        for k in range(max_attempts or 2 * n_episodes):
            if kept >= n_episodes:
                break
            ep = record_episode(env, expert.act, seed + k, on_reset=expert.reset)
            if only_success and not ep["success"]:
                continue
            out.add(ep, seed=seed + k, success=ep["success"])
            kept += 1
        return out.close()
    finally:
        env.close()


def load_episode(root: str | Path | DatasetReader, index: int, videos: bool = True) -> dict:
    """Episode ``index`` of a dataset `record_demos` (or the evaluation's export) wrote.

    Returns:
        dict with ``actions`` [T, A] float32, ``proprio`` [T, 8] float32, ``rewards`` [T]
        float32, ``success`` [T] bool, ``instruction`` str, ``seed``, ``objects`` [T, D] (when
        recorded), ``reward/<term>`` [T], and with ``videos`` ``frames``: camera -> [T, H, W, 3]
        uint8.
    """
    data = root if isinstance(root, DatasetReader) else DatasetReader(root)
    if not 0 <= index < len(data):
        raise IndexError(f"episode {index} not in {data.root} (it holds {len(data)} episodes)")
    cols = data.columns(index)
    ep = {
        "actions": cols[ACTION].astype(np.float32),
        "proprio": cols[STATE].astype(np.float32),
        "rewards": cols["next.reward"].astype(np.float32),
        "success": cols["next.success"].astype(bool),
        "instruction": cols["task"][0],
        "seed": data.episodes[index].get("seed"),
    }
    if ENV_STATE in cols:
        ep["objects"] = cols[ENV_STATE].astype(np.float32)
    names = data.features.get("next.reward_terms", {}).get("names") or []
    terms = cols["next.reward_terms"].reshape(len(ep["actions"]), -1) if names else None
    for j, name in enumerate(names):
        ep[f"reward/{name}"] = terms[:, j].astype(np.float32)
    if videos:
        prefix = camera_feature("")
        ep["frames"] = {k[len(prefix) :]: data.frames(k, index) for k in data.video_keys}
    return ep


def load_demos(root: str | Path, videos: bool = True) -> list[dict]:
    """Every episode of a dataset (see `load_episode`)."""
    data = DatasetReader(root)
    return [load_episode(data, i, videos) for i in range(len(data))]
