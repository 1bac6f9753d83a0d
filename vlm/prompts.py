"""Chat-template prompts with images and videos: messages, loading, processing, length check.

A sample is ``{"id", "images": [paths], "question", "answer", "reward", "family", "meta"}``, with
``"videos": [paths]`` for video questions (see ``vlm/video.py`` for frame sampling). Its
prompt is one user turn (the images, the videos, then the question) after a system turn that asks for
``<think>…</think><answer>…</answer>``. The processor expands each image placeholder into its
vision tokens; a prompt longer than ``max_prompt_length`` is an error, never truncated, because
cutting vision tokens breaks the model ("image features and image tokens do not match").
`PromptLengths` counts a prompt's tokens without processing its pixels, so a whole data set can be
checked when it loads; `too_long_error` says which part of a prompt is too long (its text, or its
vision tokens) and names only the settings that help.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ..datasets.images import image_size, open_image, shape_problem
from ..datasets.loader import LENIENT, DataError
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


class ImageLoadError(DataError, RuntimeError):
    """An image of a sample is missing or does not decode (a `DataError`; also a RuntimeError,
    as it was before)."""

    def __init__(
        self, path: str, sample_id: Any, index: int | None, cause: BaseException,
        reason: str = "images",
    ):  # fmt: skip
        where = f"sample {sample_id!r}" + (f" (index {index})" if index is not None else "")
        super().__init__(
            f"cannot load image {path!r} of {where}: {type(cause).__name__}: {cause}. Fix or remove "
            f"the file, or {LENIENT}."
        )
        self.path, self.sample_id, self.index = path, sample_id, index
        self.reason = reason
        """what a lenient run counts it as: ``data/skipped_<reason>`` (images, aspect_ratio)"""


class SpecialTokenError(DataError):
    """A question that holds one of the model's special tokens (``<|image_pad|>``,
    ``<|im_start|>`` ...), which would pass for a vision placeholder or a turn marker."""


class PromptTooLongError(DataError):
    """Prompts (with their vision tokens) longer than ``max_prompt_length`` (see
    `too_long_error` for the message)."""


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
    tools: dict[str, str] = field(default_factory=dict)
    """tool name -> usage line, listed after the system prompt for multi-turn episodes (a
    sample's own ``tools`` list keeps only those it allows)"""


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
    """Open the sample's images as a person sees them (``datasets/images.py``: upright,
    transparency over mid-grey, 16-bit scaled) in RGB; ImageLoadError names the file and the
    sample (also for an aspect ratio the processor refuses)."""
    out = []
    for img in sample.get("images") or []:
        try:
            rgb = open_image(img)
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise ImageLoadError(str(img), sample.get("id"), index, e) from e
        problem = shape_problem(rgb.size)
        if problem is not None:
            cause = ValueError(f"the image {problem}")
            raise ImageLoadError(str(img), sample.get("id"), index, cause, "aspect_ratio")
        out.append(rgb)
    return out


_SPECIALS: dict[int, tuple[Any, frozenset[str]]] = {}


def special_tokens(processor) -> frozenset[str]:
    """The special tokens of ``processor``'s tokenizer (chat markers, vision placeholders)."""
    tok = getattr(processor, "tokenizer", processor)
    if id(tok) not in _SPECIALS or _SPECIALS[id(tok)][0] is not tok:
        names = set(getattr(tok, "all_special_tokens", ()) or ())
        added = getattr(tok, "added_tokens_decoder", None) or {}
        names |= {t.content for t in added.values() if getattr(t, "special", False)}
        names |= {getattr(processor, a, None) for a in ("image_token", "video_token")}
        _SPECIALS[id(tok)] = (tok, frozenset(n for n in names if isinstance(n, str) and n))
    return _SPECIALS[id(tok)][1]


def check_text(processor, sample: dict, index: int | None = None) -> None:
    """`SpecialTokenError` when the sample's question holds one of the model's special tokens
    (the loader refuses the ``<|...|>`` ones when the data loads; this catches any model's).
    ``<image>`` and ``<video>`` are this project's placeholders, whatever the model calls them."""
    question = str(sample.get("question", ""))
    ours = (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)
    found = sorted(t for t in special_tokens(processor) if t in question and t not in ours)
    if found:
        raise SpecialTokenError(
            f"the question of {_name(sample, index)} holds {found[0]!r}, one of the model's "
            "special tokens (the chat template and the processor write those); remove it from "
            f"the text (write {IMAGE_PLACEHOLDER} where an image goes), or {LENIENT}."
        )


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


def build_messages(
    sample: dict,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    tools: dict[str, str] | None = None,
) -> list[dict]:
    """Chat messages: [system], user (images + videos + question). ``<image>``/``<video>`` in
    the question place images/videos inline (when their count matches); otherwise all images,
    then all videos, precede the text. ``tools`` (name -> usage line) are described after the
    system prompt (only those the sample's ``tools`` list allows, when it has one)."""
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
    system = "\n\n".join(p for p in (system_prompt, _tools_text(sample, tools)) if p)
    if system:
        messages.append({"role": "system", "content": [{"type": "text", "text": system}]})
    messages.append({"role": "user", "content": content})
    return messages


def _tools_text(sample: dict, tools: dict[str, str] | None) -> str:
    """The paragraph that lists the tools this sample allows and how to call one ("" without)."""
    if not tools:
        return ""
    from .tools import CALL_CLOSE, CALL_OPEN, tool_name

    allowed = sample.get("tools")
    if allowed is not None:
        short = {tool_name(str(n)) for n in allowed}
        tools = {k: v for k, v in tools.items() if k in short}
    if not tools:
        return ""

    lines = "\n".join(f"- {usage}" for usage in tools.values())
    return (
        f"You may call a tool: write {CALL_OPEN}name(arguments){CALL_CLOSE} and end your turn; "
        f"its result comes back as the next message. Tools:\n{lines}"
    )


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


def _processor_kwargs(processor, cfg: PromptConfig, has_images: bool, videos: list) -> dict:
    """The processor call's pixel bounds for images and its already-sampled video frames."""
    kwargs: dict[str, Any] = {}
    if has_images and (cfg.min_pixels is not None or cfg.max_pixels is not None):
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
    return kwargs


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
        PromptTooLongError: the prompt exceeds ``cfg.max_prompt_length`` (says whether its text
            or its vision tokens make it too long, and which setting helps).
    """
    check_text(processor, sample, index)
    images = load_images(sample, index)
    videos = []
    if sample.get("videos"):
        factor = spatial_factor(processor)
        videos = load_videos(sample, cfg.video, factor, index, shuffle_seed)
    text = processor.apply_chat_template(
        build_messages(sample, cfg.system_prompt, cfg.tools),
        tokenize=False,
        add_generation_prompt=True,
    )
    kwargs = _processor_kwargs(processor, cfg, bool(images), videos)
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
        raise too_long_error([(sample, index, input_ids.numel(), n_vis)], cfg, processor)
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
        except (ImageLoadError, VideoLoadError, SpecialTokenError) as e:
            if strict:
                raise
            skipped.append({"index": idx, "id": s.get("id"), "error": str(e)})
    return encoded, skipped


# ---------------------------------------------------------------------------------------------
# prompt lengths without pixels, and what to do about long ones
# ---------------------------------------------------------------------------------------------


class PromptLengths:
    """Token counts of prompts (vision tokens included) without processing their pixels.

    A prompt is its text (each image or video one placeholder) plus what the processor's
    expansion of the placeholders adds, and that depends only on the sizes of the images and the
    size, frame count and fps of the videos. So the expansion is measured by encoding one sample
    per distinct set of those and reused for every other sample: a synthetic set of one image
    size costs one encoding, the rest is chat template and tokenizer.

    Args:
        processor: the policy's processor.
        cfg: prompt settings (system prompt, pixel bounds, video sampling); the length limit is
            the caller's to apply.
        media: path -> ``(width, height)`` of an image or ``(width, height, frames, fps)`` of a
            video, as ``load_samples(media=...)`` records them; other paths are opened (an
            image's header, a video's first and last frames).
    """

    def __init__(self, processor, cfg: PromptConfig, media: dict[str, tuple] | None = None):
        self.processor = processor
        self.cfg = dataclasses.replace(cfg, max_prompt_length=0)
        self.media = media if media is not None else {}
        self.encodes = 0
        """full encodings so far (one per distinct set of image sizes and video shapes)"""
        self._added: dict[tuple, tuple[int, int]] = {}

    def __call__(self, sample: dict, index: int | None = None) -> tuple[int, int]:
        """(tokens, vision tokens) of the sample's prompt, as ``encode_prompt`` would make it.

        Raises:
            ImageLoadError, VideoLoadError: a file that cannot be read (names it and the sample).
        """
        check_text(self.processor, sample, index)
        key = self._shapes(sample, index)
        text = self._text_tokens(sample)
        if key not in self._added:
            enc = encode_prompt(self.processor, sample, self.cfg, index=index)
            self._added[key] = (enc.input_ids.numel() - text, enc.num_vision_tokens)
            self.encodes += 1
        added, vision = self._added[key]
        return text + added, vision

    def _text_tokens(self, sample: dict) -> int:
        messages = build_messages(sample, self.cfg.system_prompt, self.cfg.tools)
        text = self.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return len(self.processor.tokenizer(text)["input_ids"])

    def _shapes(self, sample: dict, index: int | None) -> tuple:
        """What the placeholders' expansion depends on: image sizes, video (size, frames, fps)."""
        images = []
        for img in sample.get("images") or []:
            size = img.size if isinstance(img, Image.Image) else self.media.get(str(img))
            try:
                size = size or image_size(img)
                problem = shape_problem(size)
                if problem is not None:
                    raise ValueError(f"the image {problem}")
            except (OSError, ValueError, Image.DecompressionBombError) as e:
                raise ImageLoadError(str(img), sample.get("id"), index, e) from e
            images.append(tuple(size))
        videos = []
        for path in sample.get("videos") or []:
            info = self.media.get(str(path))
            if info is None:
                from ..datasets.video import check_video

                try:
                    info = check_video(path)
                except ValueError as e:
                    raise VideoLoadError(str(path), sample.get("id"), index, str(e)) from e
            videos.append(tuple(info))
        return tuple(images), tuple(videos)


def too_long_error(
    rows: list[tuple[dict, int | None, int, int]],
    cfg: PromptConfig,
    processor,
    where: str | None = None,
) -> PromptTooLongError:
    """One error for prompts longer than ``cfg.max_prompt_length``: the samples (the first five),
    the length and pixel settings, and per cause only the settings that help. A prompt whose
    text alone is too long needs a larger ``rollout.max_prompt_length`` (fewer pixels cannot
    help); one made too long by its vision tokens needs fewer pixels or frames (or the larger
    limit).

    Args:
        rows: ``(sample, index, tokens, vision tokens)`` of each prompt that is too long.
        where: what the samples are, e.g. ``data.train=<file>``; None for one prompt being
            encoded (the message then speaks of it alone).
    """
    limit = cfg.max_prompt_length
    settings = _vision_settings(rows, cfg, processor)
    text = [r for r in rows if r[2] - r[3] > limit]
    vision = [r for r in rows if r[2] - r[3] <= limit]
    one = where is None and len(rows) == 1
    parts = [_too_long_head(rows, one, where, limit, settings)]
    if text:
        parts.append(_text_fix(text, one))
    if vision:
        parts.append(_vision_fix(vision, one, cfg, processor))
    parts.append("Prompts are never truncated: cutting vision tokens breaks the model.")
    if not one:
        parts.append(f"Or {LENIENT}.")
    return PromptTooLongError(" ".join(parts))


def _too_long_head(rows: list, one: bool, where: str | None, limit: int, settings: str) -> str:
    """The error's first sentence: the one prompt's length (``one``), or how many prompts of
    ``where`` are too long and the first five of them, with the limit and pixel ``settings``."""
    if one:
        s, i, n, v = rows[0]
        return (
            f"prompt of {_name(s, i)} is {n} tokens, {v} of them vision tokens, longer than "
            f"rollout.max_prompt_length={limit}{settings}."
        )
    listed = "; ".join(
        f"{_name(s, i)}: {n} tokens, {v} of them vision tokens" for s, i, n, v in rows[:5]
    )
    more = f"; and {len(rows) - 5} more" if len(rows) > 5 else ""
    return (
        f"{len(rows)} prompts of {where or 'the data'} are longer than "
        f"rollout.max_prompt_length={limit}{settings}: {listed}{more}."
    )


def _text_fix(text: list, one: bool) -> str:
    """The sentence for the ``(sample, index, tokens, vision tokens)`` rows whose text alone is
    over the limit: only a larger max_prompt_length helps."""
    who = (
        f"Its text alone (system prompt and question) is {text[0][2] - text[0][3]} tokens"
        if one
        else f"The text alone is too long in {len(text)} ({_ids(text)})"
    )
    no_pixels = "; fewer pixels cannot help" if any(r[3] for r in text) else ""
    return (
        f"{who}: raise rollout.max_prompt_length to at least {max(r[2] for r in text)}{no_pixels}."
    )


def _vision_fix(vision: list, one: bool, cfg: PromptConfig, processor) -> str:
    """The sentence for the ``(sample, index, tokens, vision tokens)`` rows made too long by
    their vision tokens: fewer pixels or frames help, or a larger max_prompt_length."""
    who = (
        f"Its {vision[0][3]} vision tokens make it too long (the text is "
        f"{vision[0][2] - vision[0][3]} tokens)"
        if one
        else f"The vision tokens make {len(vision)} too long ({_ids(vision)})"
    )
    return (
        f"{who}: {_fewer_pixels([r[0] for r in vision], cfg, processor)}, or raise "
        f"rollout.max_prompt_length to at least {max(r[2] for r in vision)}."
    )


def _name(sample: dict, index: int | None) -> str:
    return f"sample {sample.get('id')!r}" + (f" (index {index})" if index is not None else "")


def _ids(rows: list) -> str:
    return "e.g. " + ", ".join(repr(r[0].get("id")) for r in rows[:3])


def _vision_settings(rows: list, cfg: PromptConfig, processor) -> str:
    """`` (model.max_pixels=..., video.max_frames=...)`` for the kinds of input in ``rows``."""
    out = []
    if any(r[0].get("images") for r in rows):
        out.append(f"model.max_pixels={current_max_pixels(processor, cfg)}")
    if any(r[0].get("videos") for r in rows):
        v = cfg.video
        out.append(
            f"video.max_frames={v.max_frames}, video.max_pixels={v.max_pixels}, "
            f"video.total_pixels={v.total_pixels}"
        )
    return f" ({', '.join(out)})" if out else ""


def _fewer_pixels(samples: list[dict], cfg: PromptConfig, processor) -> str:
    """The settings that give these samples fewer vision tokens."""
    out = []
    if any(s.get("images") for s in samples):
        out.append(
            f"lower model.max_pixels (now {current_max_pixels(processor, cfg)}) so each image "
            "yields fewer vision tokens"
        )
    if any(s.get("videos") for s in samples):
        v = cfg.video
        out.append(
            f"lower video.max_frames (now {v.max_frames}), video.max_pixels ({v.max_pixels}) or "
            f"video.total_pixels ({v.total_pixels}) for fewer video tokens"
        )
    return "; ".join(out) or "use fewer images or videos"
