"""Video input for VLM prompts: decord decoding, fps-based frame sampling and frame sizing.

The conventions are qwen-vl-utils' (``VideoConfig`` holds them, see ``trainer/config.py``):

- frames are sampled at ``fps`` per second of video, clamped to ``[min_frames, max_frames]``
  (each rounded to a multiple of ``frame_factor``) and to the frames the file has, then floored
  to a multiple of ``frame_factor``; the chosen frames are evenly spaced over the whole clip;
- each frame is resized (aspect ratio kept) to multiples of the vision tower's spatial factor
  (patch size x merge size) with an area of at most
  ``max(min(max_pixels, total_pixels / frames * frame_factor), 1.05 * min_pixels)``, so a long
  video shares ``total_pixels`` over its temporal patches (pairs of frames).

``load_video`` returns the frames as a uint8 array with the source fps and frame indices;
``Video.metadata()`` is what the Hugging Face processor needs to derive timestamps (Qwen3-VL
writes them into the prompt) and ``second_per_grid_ts`` (Qwen2.5-VL's temporal M-RoPE).

A missing, empty, corrupt or too-short file raises :class:`VideoLoadError`, which names the file
and the sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..datasets.loader import LENIENT, DataError
from .config import VideoConfig

__all__ = [
    "Video",
    "VideoConfig",
    "VideoLoadError",
    "frame_size",
    "load_video",
    "num_frames",
    "sample_indices",
    "shuffle_frames",
    "spatial_factor",
]


class VideoLoadError(DataError, RuntimeError):
    """A video of a sample is missing, empty, corrupt or too short (a `DataError`; also a
    RuntimeError, as it was before)."""

    def __init__(self, path: str, sample_id: Any, index: int | None, problem: str):
        where = f"sample {sample_id!r}" + (f" (index {index})" if index is not None else "")
        super().__init__(
            f"cannot load video {path!r} of {where}: {problem}. Fix or remove the file, or "
            f"{LENIENT}."
        )
        self.path, self.sample_id, self.index = path, sample_id, index


@dataclass
class Video:
    """Frames sampled from one file, resized for the model."""

    frames: np.ndarray
    """[T, H, W, 3] uint8 RGB"""
    indices: list[int]
    """source frame index of each sampled frame (increasing, even after ``shuffle_frames``)"""
    source_fps: float
    """frames per second of the file"""
    total_frames: int
    """frames in the file"""
    source_size: tuple[int, int]
    """(width, height) of the file's frames"""
    order: list[int] | None = None
    """after ``shuffle_frames``: frame k shows sampled frame ``order[k]``"""

    @property
    def duration(self) -> float:
        """Length of the clip in seconds."""
        return self.total_frames / self.source_fps

    @property
    def timestamps(self) -> list[float]:
        """Time in seconds of each sampled position (the positions keep their times when the
        frames are shuffled: only the content moves)."""
        return [i / self.source_fps for i in self.indices]

    @property
    def sampled_fps(self) -> float:
        return len(self.indices) / self.total_frames * self.source_fps

    def metadata(self):
        """``transformers.video_utils.VideoMetadata`` for the processor."""
        from transformers.video_utils import VideoMetadata

        return VideoMetadata(
            total_num_frames=self.total_frames,
            fps=self.source_fps,
            duration=self.duration,
            frames_indices=list(self.indices),
            height=int(self.frames.shape[1]),
            width=int(self.frames.shape[2]),
        )


def _ceil_to(x: float, f: int) -> int:
    return int(math.ceil(x / f)) * f


def _floor_to(x: float, f: int) -> int:
    return int(math.floor(x / f)) * f


def num_frames(total_frames: int, source_fps: float, cfg: VideoConfig) -> int:
    """Frames to sample from a clip of ``total_frames`` at ``source_fps`` (see module doc).

    Raises:
        ValueError: fewer than ``frame_factor`` frames in the clip, or a non-positive fps.
    """
    f = max(1, cfg.frame_factor)
    if source_fps <= 0 or not math.isfinite(source_fps):
        raise ValueError(f"invalid frame rate {source_fps!r}")
    if total_frames < f:
        raise ValueError(
            f"too short: {total_frames} frame(s), at least frame_factor={f} are needed"
        )
    lo = _ceil_to(cfg.min_frames, f)
    hi = _floor_to(min(cfg.max_frames, total_frames), f)
    want = total_frames / source_fps * cfg.fps
    n = _floor_to(min(max(want, lo), hi, total_frames), f)
    return max(f, n)


def sample_indices(total_frames: int, n: int) -> list[int]:
    """``n`` evenly spaced frame indices from 0 to ``total_frames - 1`` (rounded)."""
    return [int(round(x)) for x in np.linspace(0, total_frames - 1, n)]


def spatial_factor(processor) -> int:
    """Frame sides must be multiples of patch size x merge size of the video processor."""
    vp = getattr(processor, "video_processor", None) or processor.image_processor
    return int(getattr(vp, "patch_size", 14)) * int(getattr(vp, "merge_size", 2))


def frame_size(height: int, width: int, n: int, cfg: VideoConfig, factor: int) -> tuple[int, int]:
    """(height, width) of each of ``n`` frames after the per-frame cap and the total budget."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    min_px = cfg.min_pixels or factor * factor
    cap = min(cfg.max_pixels, cfg.total_pixels / n * max(1, cfg.frame_factor))
    max_px = int(max(cap, min_px * 1.05))
    return smart_resize(height, width, factor=factor, min_pixels=min_px, max_pixels=max_px)


def _resize(frames: np.ndarray, h: int, w: int) -> np.ndarray:
    import cv2

    if frames.shape[1:3] == (h, w):
        return np.ascontiguousarray(frames)
    shrink = h * w < frames.shape[1] * frames.shape[2]
    interp = cv2.INTER_AREA if shrink else cv2.INTER_CUBIC
    return np.stack([cv2.resize(f, (w, h), interpolation=interp) for f in frames])


def _reader(path: str):
    import decord

    return decord.VideoReader(path, ctx=decord.cpu(0), num_threads=1)


def load_video(
    path: str | Path,
    cfg: VideoConfig | None = None,
    factor: int = 28,
    *,
    sample_id: Any = None,
    index: int | None = None,
) -> Video:
    """Decode, sample and resize one video.

    Args:
        path: a video file decord reads (mp4, avi, webm ...).
        cfg: sampling and pixel settings (defaults: 2 fps, 4..16 frames, factor 2).
        factor: spatial factor of the model (``spatial_factor(processor)``).
        sample_id, index: named in the error message.

    Returns:
        the sampled, resized frames and their source indices.

    Raises:
        VideoLoadError: missing, empty, corrupt or too short (names the file and the sample).
    """
    cfg = cfg or VideoConfig()
    p = str(path)
    if not Path(p).is_file():
        raise VideoLoadError(p, sample_id, index, "file not found")
    if Path(p).stat().st_size == 0:
        raise VideoLoadError(p, sample_id, index, "the file is empty (0 bytes)")
    try:
        vr = _reader(p)
        total, fps = len(vr), float(vr.get_avg_fps())
    except Exception as e:  # decord raises its own DECORDError for undecodable files
        raise VideoLoadError(p, sample_id, index, f"not a decodable video ({_short(e)})") from e
    try:
        n = num_frames(total, fps, cfg)
    except ValueError as e:
        raise VideoLoadError(p, sample_id, index, str(e)) from e
    idx = sample_indices(total, n)
    try:
        frames = vr.get_batch(idx).asnumpy()  # [T, H, W, 3] uint8
    except Exception as e:
        raise VideoLoadError(
            p, sample_id, index, f"frames {idx[0]}..{idx[-1]} do not decode ({_short(e)})"
        ) from e
    if frames.ndim != 4 or frames.shape[0] != n or frames.shape[-1] != 3:
        raise VideoLoadError(p, sample_id, index, f"decoded frames have shape {frames.shape}")
    H, W = int(frames.shape[1]), int(frames.shape[2])
    try:
        h, w = frame_size(H, W, n, cfg, factor)
    except ValueError as e:  # extreme aspect ratios
        raise VideoLoadError(p, sample_id, index, str(e)) from e
    return Video(_resize(frames, h, w), idx, fps, total, (W, H))


def shuffle_frames(video: Video, rng: np.random.Generator) -> Video:
    """The same video with its frames in a random order that is never the original one (for
    two or more frames); indices and timestamps stay in place, so only the content moves."""
    n = len(video.indices)
    order = rng.permutation(n)
    if n > 1 and np.array_equal(order, np.arange(n)):
        order = np.roll(order, 1)
    return replace(video, frames=video.frames[order], order=[int(i) for i in order])


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
