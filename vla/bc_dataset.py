"""Behaviour cloning from a LeRobot dataset on disk (``bc.dataset``), as an SFT source.

`DatasetSource` reads a LeRobot v3.x dataset (`sim.lerobot_format.DatasetReader`: the Parquet
frames and, decoded with OpenCV, the MP4 frames of each camera) and yields `RolloutBatch`es laid
out as `vla.bc.ExpertSource`'s: ``tokens`` are the dataset's actions as targets of K actions
(`vla.bc.chunk_targets`), ``inputs`` the policy's own observations of the recorded frames
(``policy.observe`` of a `sim.backends.Batch` built from them), so any VLA policy clones it.

Which dataset feature feeds which input is ``bc.features`` over the defaults our export writes
(`feature_map`). The dataset is checked against the env's spaces when the source is built (every
mapped feature present, proprio, entity poses and actions of the env's sizes, three-channel
videos that decode); camera frames of another size are resized to the env's image size. Any
problem is a `DataError` naming the dataset, the feature and the setting to change.

Each batch holds ``rows`` windows of at most ``steps`` frames. A window starts uniformly in
[-(steps - 1), L - 1] of an episode of L frames (clipped to the episode; episodes drawn in
proportion to L + steps - 1), so every frame is drawn equally often; the draw is a pure
function of ``(seed, step)``, so a resumed run sees the same batches.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import cv2
import numpy as np
import torch

from ..errors import DataError
from ..sim.backends import Batch
from ..sim.demonstrations import ACTION, ENV_STATE, STATE, camera_feature, cameras_of
from ..sim.lerobot_format import DatasetReader
from ..trainer.batch import RolloutBatch
from .bc import chunk_targets
from .episode_runner import CUT, TERMINATED, Rows

log = logging.getLogger(__name__)

CACHE_BYTES = 1 << 30
"""decoded (resized) camera frames kept in memory, least recently used episodes evicted first"""


def feature_map(features: dict[str, str], cameras: list[str]) -> dict[str, str]:
    """Policy input -> dataset feature: the names our export writes (``proprio``:
    observation.state, ``objects``: observation.environment_state, ``action``: action, each
    camera: observation.images.<camera>), replaced where ``features`` (``bc.features``) names
    another."""
    out = {"proprio": STATE, "objects": ENV_STATE, "action": ACTION}
    out.update({cam: camera_feature(cam) for cam in cameras})
    return {**out, **features}


class DatasetSource:
    """``next_batch(step)``: ``rows`` windows of ``steps`` frames of the dataset at ``root``.

    Args:
        policy: provides ``observe(sim_batch) -> obs`` (its input layout).
        root: the dataset folder.
        spaces: the env's single spaces, ``{"observation": Dict, "action": Box}``; the dataset
            must match them (what the policy was sized from or checked against).
        features: ``bc.features`` (see `feature_map`).
        rows, steps: windows per batch and frames per window (``env.num_envs``,
            ``env.steps_per_rollout``, the expert source's shape).
        chunk: K, actions per target (the policy's action chunk).
        seed: the windows' draws (``train.seed``).
        fps: the env's control rate; a dataset recorded at another rate is cloned all the same
            (one action per env step), with a warning.
    """

    def __init__(self, policy, root: str | Path, spaces: dict, features: dict[str, str],
                 rows: int, steps: int, chunk: int = 1, seed: int = 0,
                 fps: int | None = None):  # fmt: skip
        self.policy, self.rows, self.steps, self.chunk, self.seed = policy, rows, steps, chunk, seed
        self.data = DatasetReader(root)
        obs = spaces["observation"]
        self.cameras = cameras_of(obs)
        self.size = tuple(obs[self.cameras[0]].shape[:2]) if self.cameras else None
        self.names = check_dataset(self.data, feature_map(features, self.cameras), spaces)
        self.lengths = np.array([ep["length"] for ep in self.data.episodes], np.int64)
        if fps is not None and self.data.fps != fps:
            log.warning(
                "bc.dataset %s was recorded at %d fps and the env acts at %d Hz: its actions "
                "are cloned as one per env step", self.data.root, self.data.fps, fps,
            )  # fmt: skip
        self._cache: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._cached = 0

    def next_batch(self, step: int) -> RolloutBatch:
        """Windows drawn for ``step`` -> targets of the next K recorded actions at each frame."""
        rows = self.window_rows(step)
        tokens, mask, rewards, inputs = chunk_targets(rows, self.chunk)
        return RolloutBatch(
            tokens=tokens, mask=mask, group_id=torch.arange(len(rows)), rewards=rewards,
            inputs=inputs,
        )  # fmt: skip

    def window_rows(self, step: int) -> Rows:
        """The windows of ``step`` as runner rows: actions [B, T, A] (a window that stops
        before its episode ends carries K - 1 more actions and ends ``CUT``, so its last
        frames' targets are whole chunks; one whose chunks reach the end runs to it and ends
        ``TERMINATED``, the last action repeated past it), inputs of the window's frames."""
        rng = np.random.default_rng([self.seed, step])
        T, K, L = self.steps, self.chunk, self.lengths
        span = L + T - 1
        episodes = rng.choice(len(L), size=self.rows, p=span / span.sum())
        actions, inputs, ends = [], {}, []
        for e in episodes.tolist():
            s = int(rng.integers(-(T - 1), L[e]))
            start, stop = max(s, 0), min(s + T, int(L[e]))
            if stop + K - 1 >= L[e]:
                stop, cut, end = int(L[e]), int(L[e]), TERMINATED
            else:
                cut, end = stop + K - 1, CUT
            cols = self.data.columns(e, [self.names["action"]])
            actions.append(
                torch.from_numpy(cols[self.names["action"]][start:cut].astype(np.float32))
            )
            for key, x in self.observe(e, start, stop).items():
                inputs.setdefault(key, []).append(x)
            ends.append(end)
        B, n = len(actions), max(len(a) for a in actions)
        padded = torch.zeros(B, n, actions[0].shape[-1])
        mask = torch.zeros(B, n)
        for b, a in enumerate(actions):
            padded[b, : len(a)], mask[b, : len(a)] = a, 1.0
        return Rows(
            padded, mask, torch.zeros(B, n), None, None, inputs, torch.zeros(B),
            np.array(ends, np.int8), -np.ones(B, np.int64), np.zeros(B, bool),
        )  # fmt: skip

    def observe(self, episode: int, start: int, stop: int) -> dict[str, torch.Tensor]:
        """The policy's observations of frames ``start:stop`` of ``episode``: key -> [n, ...]
        (a policy whose observations are lists of per-frame tensors gets them stacked)."""
        names = self.names
        wanted = [names[k] for k in ("proprio", "objects") if k in names]
        cols = self.data.columns(episode, wanted)
        batch = Batch(
            images={c: self.frames(names[c], episode)[start:stop] for c in self.cameras},
            proprio=cols[names["proprio"]][start:stop].astype(np.float32),
            objects=cols[names["objects"]][start:stop].astype(np.float32)
            if "objects" in names else None,
            instructions=cols["task"][start:stop],
        )  # fmt: skip
        obs = self.policy.observe(batch)
        return {k: torch.stack(list(v)) if isinstance(v, list) else v for k, v in obs.items()}

    def frames(self, feature: str, episode: int) -> np.ndarray:
        """Every frame of ``episode``'s video ``feature`` at the env's image size [L, H, W, 3],
        decoded once and kept (`CACHE_BYTES`)."""
        key = (feature, episode)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        x = self.data.frames(feature, episode)
        if x.shape[1:3] != self.size:
            h, w = self.size
            x = np.stack([cv2.resize(f, (w, h), interpolation=cv2.INTER_AREA) for f in x])
        self._cache[key] = x
        self._cached += x.nbytes
        while self._cached > CACHE_BYTES and len(self._cache) > 1:
            self._cached -= self._cache.popitem(last=False)[1].nbytes
        return x


def check_dataset(data: DatasetReader, names: dict[str, str], spaces: dict) -> dict[str, str]:
    """The mapped features of everything the env observes, checked against the dataset:
    present, of the env's sizes (videos: three channels; any height and width), every video
    file decodable. Returns the mapping of the inputs the source reads (``objects`` when the
    env observes entity poses: env.obs_mode=state, or env.privileged_state=true)."""
    obs, A = spaces["observation"], int(spaces["action"].shape[0])
    cams = cameras_of(obs)
    need = {"proprio": tuple(obs["proprio"].shape), "action": (A,)}
    if "objects" in obs.spaces:  # state mode, or rgb with env.privileged_state=true
        need["objects"] = tuple(obs["objects"].shape)
    for cam in cams:
        need[cam] = None
    for key, shape in need.items():
        ft = data.features.get(names[key])
        where = f"bc.dataset {data.root}: the {key} input reads feature {names[key]!r}"
        if ft is None:
            have = ", ".join(k for k in data.features if k not in _BOOKKEEPING)
            extra = (
                " (the env observes entity poses because env.obs_mode=state or "
                "env.privileged_state=true)"
                if key == "objects"
                else ""
            )
            raise DataError(
                f"{where}, which the dataset does not have (it has: {have}){extra}; name the "
                f"right one with bc.features.{key}=<feature>"
            )
        if shape is None and (ft["dtype"] != "video" or ft["shape"][-1] != 3):
            raise DataError(
                f"{where} of dtype {ft['dtype']} and shape {list(ft['shape'])}; a camera must be "
                "a three-channel video feature (H, W, 3)"
            )
        if shape is not None and tuple(ft["shape"]) != shape:
            raise DataError(
                f"{where} of shape {list(ft['shape'])}, and the env's {key} has shape "
                f"{list(shape)}; record the dataset for this env (env.obs_mode, env.control, "
                "env.id) or map another feature with bc.features"
            )
    for cam in cams:
        check_videos(data, names[cam])
    return {k: names[k] for k in need}


_BOOKKEEPING = ("timestamp", "frame_index", "episode_index", "index", "task_index")


def check_videos(data: DatasetReader, feature: str) -> None:
    """Decode the first frame of the first episode in each of ``feature``'s video files, so a
    damaged file or a codec FFmpeg cannot read ends the run before it starts."""
    seen = set()
    for i in range(len(data)):
        path = data.video_path(feature, i)
        if path in seen:
            continue
        seen.add(path)
        data.frames(feature, i, 0, 1)
