"""Chat-template prompts with images and videos: messages, loading, processing, length check.

A sample is ``{"id", "images": [paths], "question", "answer", "reward", "family", "meta"}``, with
``"videos": [paths]`` for video questions (see ``vlm/video.py`` for frame sampling). Its
prompt is one user turn (the images, the videos, then the question) after a system turn that asks for
``<think>…</think><answer>…</answer>``. The processor expands each image placeholder into its
vision tokens; a prompt longer than ``max_prompt_length`` is an error, never truncated, because
cutting vision tokens breaks the model ("image features and image tokens do not match").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .config import RolloutConfig, VideoConfig
from .video import Video, VideoLoadError, load_video, shuffle_frames, spatial_factor

DEFAULT_SYSTEM_PROMPT = RolloutConfig.system_prompt
"""The recipes' default (``rollout.system_prompt``), so a policy built without a config prompts
as training did."""

IMAGE_PLACEHOLDER = "<image>"
"""Where a question writes this string, the next image goes there; otherwise images come first."""
VIDEO_PLACEHOLDER = "<video>"
"""Where a question writes this string, the next video goes there; otherwise videos come first."""

_PER_IMAGE_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)


class ImageLoadError(RuntimeError):
    """An image of a sample is missing or does not decode."""

    def __init__(self, path: str, sample_id: Any, index: int | None, cause: BaseException):
        where = f"sample {sample_id!r}" + (f" (index {index})" if index is not None else "")
        super().__init__(
            f"cannot load image {path!r} of {where}: {type(cause).__name__}: {cause}. Fix or remove "
            "the file, or run lenient (strict=False) to skip and count such samples."
        )
        self.path, self.sample_id, self.index = path, sample_id, index


class PromptTooLongError(ValueError):
    """A prompt (with its vision tokens) longer than ``max_prompt_length``."""


@dataclass
class PromptConfig:
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    """system turn; None or "" leaves it to the chat template's default"""
    max_prompt_length: int = 1024
    """longest prompt in tokens, vision tokens included; longer prompts raise (never truncated)"""
    min_pixels: int | None = None
    """smallest image area after resizing (None keeps the processor's setting)"""
    max_pixels: int | None = None
    """largest image area after resizing; lower it to get fewer vision tokens per image"""
    video: VideoConfig = field(default_factory=VideoConfig)
    """video frame sampling (fps, frame counts) and frame pixel bounds"""


@dataclass
class EncodedPrompt:
    """One sample's processed prompt, unpadded, ready to be collated with others."""

    sample: dict
    """the sample, with meta["image_size"] = [w, h] and meta["model_image_size"] = [w', h']"""
    input_ids: Tensor
    """[L] long prompt token ids (vision placeholders expanded)"""
    token_extras: dict[str, Tensor] = field(default_factory=dict)
    """per-token inputs the processor returned, each [L] (e.g. mm_token_type_ids)"""
    vision: dict[str, Tensor] = field(default_factory=dict)
    """per-sample vision inputs: pixel_values [P, D], image_grid_thw [n_images, 3] ..."""
    num_vision_tokens: int = 0


def load_images(sample: dict, index: int | None = None) -> list[Image.Image]:
    """Open the sample's images as RGB; ImageLoadError names the file and the sample."""
    out = []
    for img in sample.get("images") or []:
        if isinstance(img, Image.Image):
            out.append(img.convert("RGB"))
            continue
        try:
            with Image.open(Path(img)) as im:
                out.append(im.convert("RGB"))
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise ImageLoadError(str(img), sample.get("id"), index, e) from e
    return out


def load_videos(
    sample: dict,
    cfg: VideoConfig,
    factor: int,
    index: int | None = None,
    shuffle_seed: int | None = None,
) -> list[Video]:
    """Decode and sample the sample's videos; VideoLoadError names the file and the sample.
    With ``shuffle_seed`` each video's frames come in a seeded random order (T-GRPO)."""
    out = []
    for k, path in enumerate(sample.get("videos") or []):
        v = load_video(path, cfg, factor, sample_id=sample.get("id"), index=index)
        if shuffle_seed is not None:
            v = shuffle_frames(v, np.random.default_rng([shuffle_seed, k]))
        out.append(v)
    return out


def build_messages(sample: dict, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> list[dict]:
    """Chat messages: [system], user (images + videos + question). ``<image>``/``<video>`` in
    the question place images/videos inline (when their count matches); otherwise all images,
    then all videos, precede the text."""
    n_images = len(sample.get("images") or [])
    n_videos = len(sample.get("videos") or [])
    question = str(sample.get("question", ""))
    inline = {
        kind: n > 0 and question.count(mark) == n
        for kind, mark, n in (
            ("image", IMAGE_PLACEHOLDER, n_images),
            ("video", VIDEO_PLACEHOLDER, n_videos),
        )
    }
    content: list[dict] = [{"type": "image"} for _ in range(n_images * (not inline["image"]))]
    content += [{"type": "video"} for _ in range(n_videos * (not inline["video"]))]
    marks = [
        m for k, m in (("image", IMAGE_PLACEHOLDER), ("video", VIDEO_PLACEHOLDER)) if inline[k]
    ]
    if not marks:
        content.append({"type": "text", "text": question})
    else:
        pattern = "(" + "|".join(re.escape(m) for m in marks) + ")"
        for piece in re.split(pattern, question):
            if piece == IMAGE_PLACEHOLDER and inline["image"]:
                content.append({"type": "image"})
            elif piece == VIDEO_PLACEHOLDER and inline["video"]:
                content.append({"type": "video"})
            elif piece:
                content.append({"type": "text", "text": piece})
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    messages.append({"role": "user", "content": content})
    return messages


def vision_token_ids(processor) -> list[int]:
    """Ids of the placeholder tokens that the processor expands into vision features."""
    ids = [getattr(processor, a, None) for a in ("image_token_id", "video_token_id")]
    return [int(i) for i in ids if isinstance(i, int)]


def current_max_pixels(processor, cfg: PromptConfig) -> int | None:
    if cfg.max_pixels is not None:
        return cfg.max_pixels
    size = getattr(getattr(processor, "image_processor", None), "size", None)
    return size.get("longest_edge") if size is not None and hasattr(size, "get") else None


def _model_image_sizes(processor, vision: dict[str, Tensor]) -> list[list[int]]:
    """[w', h'] of each image as the vision tower saw it (after the processor's resize)."""
    grid = vision.get("image_grid_thw")
    if grid is not None:
        patch = int(getattr(processor.image_processor, "patch_size", 14))
        return [[int(w) * patch, int(h) * patch] for _, h, w in grid.tolist()]
    pv = vision.get("pixel_values")
    if pv is not None and pv.dim() == 4:  # [n_images, C, H, W]
        return [[int(pv.shape[3]), int(pv.shape[2])] for _ in range(pv.shape[0])]
    return []


def _with_video_meta(sample: dict, videos: list[Video]) -> dict:
    """meta: seconds and frame count of each video, the model's frame size and timestamps."""
    if not videos:
        return sample
    meta = dict(sample.get("meta") or {})
    meta["video_seconds"] = [round(v.duration, 4) for v in videos]
    meta["video_frames"] = [len(v.indices) for v in videos]
    meta["video_timestamps"] = [[round(t, 4) for t in v.timestamps] for v in videos]
    meta["model_video_size"] = [int(videos[0].frames.shape[2]), int(videos[0].frames.shape[1])]
    if any(v.order is not None for v in videos):
        meta["frame_order"] = [v.order for v in videos]
    return {**sample, "meta": meta}


def _with_sizes(sample: dict, images: list[Image.Image], model_sizes: list[list[int]]) -> dict:
    if not images:
        return sample
    meta = dict(sample.get("meta") or {})
    meta.setdefault("image_size", [images[0].width, images[0].height])
    if model_sizes:
        meta["model_image_size"] = model_sizes[0]
        if len(model_sizes) > 1:
            meta["model_image_sizes"] = model_sizes
    return {**sample, "meta": meta}


def encode_prompt(
    processor,
    sample: dict,
    cfg: PromptConfig,
    *,
    index: int | None = None,
    shuffle_seed: int | None = None,
) -> EncodedPrompt:
    """Render, load the images and videos and process one sample.

    Args:
        shuffle_seed: shuffle each video's frames with this seed (T-GRPO's shuffled prompts);
            the frame positions keep their timestamps.

    Raises:
        ImageLoadError: an image is missing or corrupt (names the file, sample id and index).
        VideoLoadError: a video is missing, empty, corrupt or too short (names file and sample).
        PromptTooLongError: the prompt exceeds ``cfg.max_prompt_length`` (names it and max_pixels).
    """
    images = load_images(sample, index)
    videos = []
    if sample.get("videos"):
        factor = spatial_factor(processor)
        videos = load_videos(sample, cfg.video, factor, index, shuffle_seed)
    text = processor.apply_chat_template(
        build_messages(sample, cfg.system_prompt), tokenize=False, add_generation_prompt=True
    )
    kwargs: dict[str, Any] = {}
    if images and (cfg.min_pixels is not None or cfg.max_pixels is not None):
        size = dict(processor.image_processor.size)
        if cfg.min_pixels is not None:
            size["shortest_edge"] = cfg.min_pixels
        if cfg.max_pixels is not None:
            size["longest_edge"] = cfg.max_pixels
        kwargs["images_kwargs"] = {"size": size}
    if videos:  # frames are sampled and sized already (vlm/video.py): the processor keeps them
        kwargs["videos"] = [v.frames for v in videos]
        kwargs["videos_kwargs"] = {
            "video_metadata": [v.metadata() for v in videos],
            "do_sample_frames": False,
            "do_resize": False,
        }
    enc = processor(text=[text], images=images or None, return_tensors="pt", **kwargs)
    input_ids = enc["input_ids"][0]
    token_extras, vision = {}, {}
    for k, v in enc.items():
        if k in ("input_ids", "attention_mask") or not isinstance(v, Tensor):
            continue
        if k not in _PER_IMAGE_KEYS and v.shape == enc["input_ids"].shape:
            token_extras[k] = v[0]
        else:
            vision[k] = v
    n_vis = int(torch.isin(input_ids, torch.tensor(vision_token_ids(processor))).sum())
    sample_out = _with_sizes(sample, images, _model_image_sizes(processor, vision))
    sample_out = _with_video_meta(sample_out, videos)
    if cfg.max_prompt_length and input_ids.numel() > cfg.max_prompt_length:
        raise PromptTooLongError(
            f"prompt of sample {sample.get('id')!r}"
            + (f" (index {index})" if index is not None else "")
            + f" is {input_ids.numel()} tokens, {n_vis} of them vision tokens, but "
            f"max_prompt_length={cfg.max_prompt_length}: truncating it would cut vision tokens "
            "(the 'image features and image tokens do not match' failure). Raise "
            f"max_prompt_length or lower max_pixels (now {current_max_pixels(processor, cfg)}) "
            "so each image yields fewer vision tokens"
            + (
                f"; for videos lower video.max_frames (now {cfg.video.max_frames}), "
                f"video.max_pixels ({cfg.video.max_pixels}) or video.total_pixels "
                f"({cfg.video.total_pixels})."
                if videos
                else "."
            )
        )
    return EncodedPrompt(sample_out, input_ids, token_extras, vision, n_vis)


def encode_prompts(
    processor,
    samples: list[dict],
    cfg: PromptConfig,
    *,
    strict: bool = True,
    indices: list[int] | None = None,
) -> tuple[list[EncodedPrompt], list[dict]]:
    """Encode many samples. Strict raises on the first unreadable image or video; lenient
    skips it.

    Returns:
        (encoded prompts, skipped) where skipped holds ``{"index", "id", "error"}`` per sample
        whose image or video failed to load (always empty when strict). Over-long prompts always raise.
    """
    encoded, skipped = [], []
    for j, s in enumerate(samples):
        idx = indices[j] if indices is not None else j
        try:
            encoded.append(encode_prompt(processor, s, cfg, index=idx))
        except (ImageLoadError, VideoLoadError) as e:
            if strict:
                raise
            skipped.append({"index": idx, "id": s.get("id"), "error": str(e)})
    return encoded, skipped
