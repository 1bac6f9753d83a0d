from __future__ import annotations

import pytest

from perceptrl.vlm.model import load_vlm
from perceptrl.vlm.prompts import (
    DEFAULT_SYSTEM_PROMPT,
    ImageLoadError,
    PromptConfig,
    PromptTooLongError,
    build_messages,
    encode_prompt,
    encode_prompts,
)


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
