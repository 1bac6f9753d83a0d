"""Tiny random-initialised Qwen2.5-VL / Qwen3-VL models, built locally, saved as HF directories.

Everything is made here: a byte-level BPE tokenizer trained on an in-code corpus of the task
vocabulary (Qwen's pre-tokenizer and special tokens), a Qwen-style chat template, the image and
video processors, and a small model with the real architecture class. The result is an ordinary
Hugging Face directory that ``AutoModelForImageTextToText.from_pretrained`` and
``AutoProcessor.from_pretrained`` load with ``trust_remote_code=False``.

The processors normalise with mean 0.5 / std 0.5 (pixels to [-1, 1]) instead of CLIP's
statistics. A from-scratch tower is blind when a constant background maps far from zero: measured
here, mean 0 / std 0.5 on the synthetic tasks' mid-grey background put every pixel near 1.0, the
merger features varied 8x less across images than their constant part, and SFT on counting stayed
at chance with identical outputs for every image. With the background mapped to ~0 only the
objects carry signal.

    python -m perceptrl.vlm.tiny qwen2_5_vl /some/dir
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

ARCHS = ("qwen2_5_vl", "qwen3_vl")

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
"""Qwen's special tokens (ids 0..13 here; the real models put them after the BPE vocabulary)."""

TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
"""Reasoning-format tags, single ordinary (non-special) tokens so decoding keeps them."""

# Qwen2's pre-tokenizer: digits split one by one, letters grouped, punctuation runs.
_PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2-VL chat template: system / user / assistant turns, images and videos as
# <|vision_start|><|image_pad|><|vision_end|> placeholders that the processor expands.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COLOURS = "red green blue yellow purple orange cyan gray grey white black brown pink".split()
_SHAPES = "circle square triangle star cube sphere cylinder diamond rectangle hexagon cross".split()
_SIZES = "small large big tiny medium".split()
_RELATIONS = ["left of", "right of", "above", "below", "next to", "behind", "in front of"]
_TEMPLATES = [
    "How many {c} {s}s are there?",
    "How many objects are there in the image?",
    "How many {s}s are in the picture?",
    "Count the {z} {c} objects.",
    "What colour is the {z} {s}?",
    "What shape is the {c} object?",
    "Is the {c} {s} {r} the {c2} {s2}? Answer yes or no.",
    "Which object is {r} the {c} {s}?",
    "Give the bounding box of the {c} {s} as [x1, y1, x2, y2].",
    "Output the box of the {z} {c} {s} in pixel coordinates.",
    "What is the colour of the {s}? A. {c} B. {c2} C. red D. blue",
    "Choose the correct option. A. {s} B. {s2} C. circle D. square",
    "The robot should pick up the {c} {s} and place it on the {c2} plate.",
    "Push the {c} block to the goal. Open the drawer. Close the gripper.",
    "In the video, which {s} moves first? Does the {c} ball move {r} the box?",
]
_REASONING = [
    "<think>I see {n} {c} {s}s. There are also {m} other objects.</think><answer>{n}</answer>",
    "<think>The {c} {s} is {r} the {c2} {s2}, so the answer is yes.</think><answer>yes</answer>",
    "<think>Let me count: {seq}. So there are {n}.</think><answer>{n}</answer>",
    "<think>The {c} {s} is at the top left.</think><answer>[{a}, {b}, {n}{m}, {m}{n}]</answer>",
    "<think>The {s} is {c}, option B.</think><answer>B</answer>",
    "The answer is {n}. Therefore the total number is {m}, not {n}.",
    "You are a helpful assistant. A conversation between User and Assistant. The user asks a "
    "question, and the Assistant solves it. The assistant first thinks about the reasoning "
    "process in the mind and then provides the user with the answer. The reasoning process and "
    "answer are enclosed within <think> </think> and <answer> </answer> tags, respectively.",
]


def _corpus() -> list[str]:
    """Deterministic sentences covering the task vocabulary (questions, answers, reasoning)."""
    lines = []
    combos = itertools.product(range(len(_COLOURS)), range(len(_SHAPES)))
    for k, (ci, si) in enumerate(combos):
        fill = {
            "c": _COLOURS[ci], "s": _SHAPES[si], "z": _SIZES[k % len(_SIZES)],
            "r": _RELATIONS[k % len(_RELATIONS)], "c2": _COLOURS[(ci + 3) % len(_COLOURS)],
            "s2": _SHAPES[(si + 5) % len(_SHAPES)], "n": k % 10, "m": (k * 7) % 10,
            "a": (k * 13) % 224, "b": (k * 29) % 224,
            "seq": ", ".join(str(i) for i in range(1, k % 6 + 2)),
        }  # fmt: skip
        for t in _TEMPLATES + _REASONING:
            lines.append(t.format(**fill))
        lines.append(
            f"{_COLOURS[ci].capitalize()} {_SHAPES[si]}s: {k}. {k % 4 + 1}) A B C D yes no."
        )
    return lines


def build_tokenizer(vocab_size: int = 1024):
    """A Qwen2Tokenizer (byte-level BPE) trained on the in-code corpus; about ``vocab_size`` ids."""
    from transformers import Qwen2Tokenizer

    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    hf_tok = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(m) for m in model["merges"]],
        eos_token="<|im_end|>",  # as in Qwen's instruct tokenizers
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in TAG_TOKENS],
    )
    hf_tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return hf_tok


def _text_config(arch: str, vocab: int, hidden: int, layers: int, heads: int, ids: dict) -> dict:
    head_dim = hidden // heads
    half = head_dim // 2  # rotary frequencies per head, split over (t, h, w)
    cfg = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), max_position_embeddings=4096,
        rms_norm_eps=1e-6, initializer_range=0.02,
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )  # fmt: skip
    if arch == "qwen2_5_vl":
        hw = 3 * half // 8
        cfg["rope_parameters"] = {
            "rope_type": "default", "rope_theta": 1e6, "mrope_section": [half - 2 * hw, hw, hw]
        }  # fmt: skip
        cfg["bos_token_id"] = ids["<|endoftext|>"]
    else:  # qwen3_vl: interleaved M-RoPE, each of h/w takes every third frequency
        hw = (half - 1) // 3
        cfg["rope_parameters"] = {
            "rope_type": "default", "rope_theta": 5e6,
            "mrope_section": [half - 2 * hw, hw, hw], "mrope_interleaved": True,
        }  # fmt: skip
        cfg["head_dim"] = head_dim
    return cfg


def _vision_config(arch: str, hidden: int, depth: int, out: int, patch: int) -> dict:
    cfg = dict(
        depth=depth, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=max(1, hidden // 32),
        in_channels=3, patch_size=patch, spatial_merge_size=2, temporal_patch_size=2,
        out_hidden_size=out, initializer_range=0.02,
    )  # fmt: skip
    if arch == "qwen2_5_vl":
        cfg.update(window_size=4 * patch * 2, fullatt_block_indexes=[depth - 1], hidden_act="silu")
    else:
        cfg.update(
            num_position_embeddings=64,
            deepstack_visual_indexes=[0] if depth > 1 else [],
            hidden_act="gelu_pytorch_tanh",
        )
    return cfg


def _processor(arch: str, tokenizer, patch: int, min_pixels: int, max_pixels: int):
    from transformers import AutoProcessor  # noqa: F401  (registers the auto classes)
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    norm = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    common = dict(patch_size=patch, temporal_patch_size=2, merge_size=2, **norm)
    image_proc = Qwen2VLImageProcessor(size=size, **common)
    if arch == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        video_proc = Qwen2VLVideoProcessor(size=size, cap_pixels_per_frame=True, **common)
        cls = Qwen2_5_VLProcessor
    else:
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        # Qwen3-VL's video budget is for the whole clip, not per frame: allow 16 frames' worth
        video_size = {"shortest_edge": min_pixels, "longest_edge": 16 * max_pixels}
        video_proc = Qwen3VLVideoProcessor(size=video_size, cap_pixels_per_frame=True, **common)
        cls = Qwen3VLProcessor
    return cls(
        image_processor=image_proc,
        tokenizer=tokenizer,
        video_processor=video_proc,
        chat_template=CHAT_TEMPLATE,
    )


def _model_config(
    arch,
    tokenizer,
    ids,
    hidden_size,
    layers,
    heads,
    vision_hidden_size,
    vision_depth,
    patch,
    tie_word_embeddings,
):
    """The HF config of a tiny model (embedding padded to a multiple of 64 ids)."""
    from transformers import AutoConfig

    vocab = -(-len(tokenizer) // 64) * 64
    return AutoConfig.for_model(
        arch,
        text_config=_text_config(arch, vocab, hidden_size, layers, heads, ids),
        vision_config=_vision_config(arch, vision_hidden_size, vision_depth, hidden_size, patch),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings,
    )


def build_tiny(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    layers: int = 4,
    heads: int = 4,
    vision_hidden_size: int = 64,
    vision_depth: int = 2,
    patch_size: int | None = None,
    vocab_size: int = 1024,
    min_pixels: int = 56 * 56,
    max_pixels: int = 224 * 224,
    tie_word_embeddings: bool = True,
) -> Path:
    """Build, randomly initialise and save a tiny Qwen2.5-VL or Qwen3-VL model with its processor.

    Args:
        arch: ``"qwen2_5_vl"`` or ``"qwen3_vl"``.
        out_dir: directory to write (created; existing files are overwritten).
        seed: torch seed for the weight initialisation (the tokenizer is deterministic).
        hidden_size, layers, heads: text decoder width, depth and attention heads.
        vision_hidden_size, vision_depth: vision tower width and depth.
        patch_size: vision patch size; ``None`` uses the family's (14 for Qwen2.5-VL, 16 for Qwen3-VL).
        vocab_size: BPE vocabulary target (the corpus may yield slightly fewer ids).
        min_pixels, max_pixels: image processor resize bounds (a 112x112 image with patch 14 gives
            8x8 patches, merged 2x2 into 16 visual tokens).
        tie_word_embeddings: share the input embedding and the LM head.

    Returns:
        ``Path(out_dir)``.
    """
    from transformers import AutoModelForImageTextToText, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; valid: {', '.join(ARCHS)}")
    if hidden_size % heads or (hidden_size // heads) % 2:
        raise ValueError(f"hidden_size {hidden_size} must split into {heads} heads of even size")
    patch = patch_size or (14 if arch == "qwen2_5_vl" else 16)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = _model_config(
        arch, tokenizer, ids, hidden_size, layers, heads, vision_hidden_size, vision_depth,
        patch, tie_word_embeddings,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
    )
    model.save_pretrained(out)
    _processor(arch, tokenizer, patch, min_pixels, max_pixels).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Build a tiny random-initialised VLM directory.")
    p.add_argument("arch", choices=ARCHS)
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vision-depth", type=int, default=2)
    a = p.parse_args(argv)
    path = build_tiny(
        a.arch,
        a.out_dir,
        seed=a.seed,
        hidden_size=a.hidden_size,
        layers=a.layers,
        vision_depth=a.vision_depth,
    )
    print(path)


if __name__ == "__main__":
    main()
