from __future__ import annotations

import dataclasses

import pytest
from PIL import Image

from perceptrl.datasets.loader import DataError, load_samples
from perceptrl.vlm.model import load_vlm
from perceptrl.vlm.prompts import (
    DEFAULT_SYSTEM_PROMPT,
    ImageLoadError,
    PromptConfig,
    PromptLengths,
    PromptTooLongError,
    build_messages,
    encode_prompt,
    encode_prompts,
    too_long_error,
)
from perceptrl.vlm.video import VideoLoadError


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def processor(request, tiny_dirs):
    return load_vlm(tiny_dirs[request.param])[1]


def test_messages_system_images_question():
    msgs = build_messages({"images": ["a.png"], "question": "How many?"})
    assert msgs[0] == {
        "role": "system",
        "content": [{"type": "text", "text": DEFAULT_SYSTEM_PROMPT}],
    }
    assert msgs[1]["content"] == [{"type": "image"}, {"type": "text", "text": "How many?"}]
    assert "<think>" in DEFAULT_SYSTEM_PROMPT and "<answer>" in DEFAULT_SYSTEM_PROMPT
    inline = build_messages({"images": ["a", "b"], "question": "A <image> or B <image>?"}, None)
    assert [m["role"] for m in inline] == ["user"]
    assert [c["type"] for c in inline[0]["content"]] == ["text", "image", "text", "image", "text"]


def test_encode_prompt_tokens_and_sizes(processor, samples):
    enc = encode_prompt(processor, samples[0], PromptConfig(system_prompt="Be brief."))
    text = processor.tokenizer.decode(enc.input_ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert enc.num_vision_tokens == 16  # 112x112 -> 16 merged tokens for both patch sizes
    assert enc.input_ids.dim() == 1
    assert enc.token_extras["mm_token_type_ids"].shape == enc.input_ids.shape
    assert int(enc.token_extras["mm_token_type_ids"].sum()) == 16
    assert enc.vision["image_grid_thw"].shape == (1, 3)
    meta = enc.sample["meta"]
    patch = processor.image_processor.patch_size
    assert meta["image_size"] == [112, 112]
    assert meta["model_image_size"] == [112, 112] if patch == 14 else [128, 128]
    assert samples[0]["meta"] == {}  # the caller's sample is not mutated


def test_encode_prompt_non_square_and_pixel_bounds(processor, samples):
    enc = encode_prompt(processor, samples[1], PromptConfig())  # 168 x 112 image
    assert enc.sample["meta"]["image_size"] == [168, 112]
    w, h = enc.sample["meta"]["model_image_size"]
    assert w > h
    small = encode_prompt(processor, samples[1], PromptConfig(max_pixels=64 * 64))
    assert small.num_vision_tokens < enc.num_vision_tokens
    assert small.sample["meta"]["model_image_size"][0] < w


def test_too_long_prompt_names_both_settings(processor, samples):
    cfg = PromptConfig(max_prompt_length=40, max_pixels=224 * 224)
    with pytest.raises(PromptTooLongError) as e:
        encode_prompt(processor, samples[2], cfg, index=2)
    msg = str(e.value)
    for part in ("max_prompt_length=40", "max_pixels", str(224 * 224), "'s2'", "index 2", "16 of"):
        assert part in msg, (part, msg)
    assert "vision tokens" in msg


def test_missing_and_corrupt_images(processor, samples, tmp_path):
    bad = tmp_path / "corrupt.png"
    bad.write_bytes(b"not a png at all")
    missing = {**samples[0], "id": "gone", "images": [str(tmp_path / "missing.png")]}
    corrupt = {**samples[0], "id": "broken", "images": [str(bad)]}
    with pytest.raises(ImageLoadError, match=r"missing\.png.*sample 'gone' \(index 7\)"):
        encode_prompt(processor, missing, PromptConfig(), index=7)
    with pytest.raises(ImageLoadError, match=r"corrupt\.png.*sample 'broken'"):
        encode_prompts(processor, [samples[0], corrupt], PromptConfig(), strict=True)
    enc, skipped = encode_prompts(
        processor, [samples[0], corrupt, samples[1]], PromptConfig(), strict=False
    )
    assert [e.sample["id"] for e in enc] == ["s0", "s1"]
    assert [(s["index"], s["id"]) for s in skipped] == [(1, "broken")]


def test_data_errors_share_one_class():
    """The command maps one class to its data-error exit status."""
    for cls in (ImageLoadError, VideoLoadError, PromptTooLongError):
        assert issubclass(cls, DataError), cls


def _exact(processor, sample, cfg):
    enc = encode_prompt(processor, sample, dataclasses.replace(cfg, max_prompt_length=0))
    return enc.input_ids.numel(), enc.num_vision_tokens


def test_prompt_lengths_without_pixels_equal_the_encoding(processor, samples, images):
    """Lengths come from the text and the image sizes: one full encoding per distinct set of
    image sizes, the same counts as encoding every sample."""
    two = {
        **samples[0],
        "id": "two",
        "images": [images[0], images[1]],
        "question": "<image> or <image>?",
    }
    for cfg in (PromptConfig(), PromptConfig(system_prompt="Be brief.", max_pixels=64 * 64)):
        lengths = PromptLengths(processor, cfg)
        for i, s in enumerate([*samples, two]):
            assert lengths(s, index=i) == _exact(processor, s, cfg), (s["id"], cfg)
        assert lengths.encodes == 3  # 112x112, 168x112, and the pair


def test_prompt_lengths_use_the_loaders_sizes(processor, samples, tmp_path, monkeypatch):
    """With the loader's record of image sizes, only one sample per distinct size is opened."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(
        f'{{"images": ["{s["images"][0]}"], "question": "{s["question"]}", "answer": "1"}}\n'
        for s in samples
    ))  # fmt: skip
    media = {}
    loaded, _ = load_samples(path, media=media)
    assert media[samples[1]["images"][0]] == (168, 112)
    cfg = PromptConfig()
    want = [_exact(processor, s, cfg) for s in loaded]
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k))
    lengths = PromptLengths(processor, cfg, media=media)
    assert [lengths(s) for s in loaded] == want
    assert len(opened) == 2, opened


def test_too_long_says_which_part_and_only_the_setting_that_helps(processor, samples):
    long_question = {**samples[0], "id": "wordy", "question": "How many circles? " * 40}
    with pytest.raises(PromptTooLongError) as e:
        encode_prompt(processor, long_question, PromptConfig(max_prompt_length=100), index=3)
    msg = str(e.value)
    assert "'wordy' (index 3)" in msg and "rollout.max_prompt_length=100" in msg
    assert "model.max_pixels=" in msg  # both settings are listed ...
    assert "text alone" in msg and "raise rollout.max_prompt_length" in msg
    assert "lower model.max_pixels" not in msg  # ... but fewer pixels cannot help
    tokens, vision = _exact(processor, samples[1], PromptConfig())
    with pytest.raises(PromptTooLongError) as e:
        encode_prompt(processor, samples[1], PromptConfig(max_prompt_length=tokens - 1))
    msg = str(e.value)
    assert f"{vision} vision tokens" in msg and "lower model.max_pixels" in msg
    assert "video." not in msg  # no video, no video settings


def test_too_long_error_lists_the_samples(processor, samples):
    cfg = PromptConfig(max_prompt_length=50)
    rows = [(s, i, 60 + i, 5) for i, s in enumerate(samples)] + [
        ({**samples[0], "id": "big"}, 9, 90, 45)
    ]
    msg = str(too_long_error(rows, cfg, processor, where="data.train=d.jsonl"))
    assert msg.startswith(
        "7 prompts of data.train=d.jsonl are longer than rollout.max_prompt_length=50"
    )
    assert "'s0' (index 0): 60 tokens, 5 of them vision tokens" in msg and "and 2 more" in msg
    assert "text alone is too long in 6 (e.g. 's0', 's1', 's2')" in msg
    assert "raise rollout.max_prompt_length to at least 65" in msg
    assert "vision tokens make 1 too long (e.g. 'big')" in msg and "lower model.max_pixels" in msg
    assert "data.strict=false" in msg and "\n" not in msg
