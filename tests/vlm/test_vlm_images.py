"""What reaches the model from awkward image files (vlm/prompts.py through datasets/images.py),
and questions that hold the model's special tokens; each file is made here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from perceptrl.vlm.model import load_vlm
from perceptrl.vlm.prompts import (
    ImageLoadError,
    PromptConfig,
    PromptLengths,
    SpecialTokenError,
    encode_prompt,
    encode_prompts,
)


@pytest.fixture(scope="module")
def processor(tiny_dirs):
    return load_vlm(tiny_dirs["qwen2_5_vl"])[1]


def _sample(path, question: str = "How bright is it?") -> dict:
    return {"id": "x", "images": [str(path)], "question": question, "answer": "1", "meta": {}}


def _pixels(processor, path) -> torch.Tensor:
    return encode_prompt(processor, _sample(path), PromptConfig()).vision["pixel_values"]


def test_a_16_bit_png_reaches_the_model_as_its_8_bit_image(processor, tmp_path):
    ramp = np.linspace(0, 65535, 56 * 56).reshape(56, 56).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "g16.png")
    Image.fromarray(np.round(ramp / 257).astype(np.uint8)).convert("RGB").save(tmp_path / "g8.png")
    torch.testing.assert_close(_pixels(processor, tmp_path / "g16.png"),
                               _pixels(processor, tmp_path / "g8.png"))  # fmt: skip


def test_transparency_reaches_the_model_over_mid_grey(processor, tmp_path):
    Image.new("RGBA", (56, 56), (255, 255, 255, 0)).save(tmp_path / "clear.png")
    Image.new("RGB", (56, 56), (128, 128, 128)).save(tmp_path / "grey.png")
    torch.testing.assert_close(_pixels(processor, tmp_path / "clear.png"),
                               _pixels(processor, tmp_path / "grey.png"))  # fmt: skip


def test_an_exif_rotated_photo_is_upright_for_the_model(processor, tmp_path):
    im = Image.new("RGB", (112, 56), (200, 40, 40))
    exif = im.getexif()
    exif[0x0112] = 6  # shown turned a quarter: 56 wide, 112 high
    im.save(tmp_path / "r.jpg", exif=exif.tobytes())
    enc = encode_prompt(processor, _sample(tmp_path / "r.jpg"), PromptConfig())
    w, h = enc.sample["meta"]["model_image_size"]
    assert enc.sample["meta"]["image_size"] == [56, 112] and h > w
    assert PromptLengths(processor, PromptConfig())(_sample(tmp_path / "r.jpg"))[0] == len(
        enc.input_ids
    )


def test_an_extreme_aspect_ratio_is_an_image_error_not_a_processor_crash(processor, tmp_path):
    Image.new("RGB", (2000, 4)).save(tmp_path / "strip.png")
    s = _sample(tmp_path / "strip.png")
    for measure in (lambda: encode_prompt(processor, s, PromptConfig(), index=3),
                    lambda: PromptLengths(processor, PromptConfig())(s, index=3)):  # fmt: skip
        with pytest.raises(ImageLoadError, match=r"strip.png.*index 3.*2000x4 pixels"):
            measure()
    assert encode_prompts(processor, [s], PromptConfig(), strict=False)[1][0]["index"] == 0


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|vision_start|>", "<|im_end|>"])
def test_a_special_token_in_a_question_is_refused_by_name(processor, tmp_path, token):
    Image.new("RGB", (56, 56)).save(tmp_path / "ok.png")
    s = _sample(tmp_path / "ok.png", f"What is {token} here?")
    with pytest.raises(SpecialTokenError, match=f"holds '{token.replace('|', '.')}'"):
        encode_prompt(processor, s, PromptConfig())
    with pytest.raises(SpecialTokenError):
        PromptLengths(processor, PromptConfig())(s)
    kept, skipped = encode_prompts(processor, [s], PromptConfig(), strict=False)
    assert not kept and skipped[0]["id"] == "x"


def test_a_lenient_run_skips_and_counts_such_samples_and_trains(tmp_path, capsys):
    """A wide strip and a question with <|image_pad|> among good samples: strict, the run
    stops with a data error naming the reason; lenient, it trains and counts both."""
    from perceptrl.cli import main
    from perceptrl.trainer.metrics import read_metrics

    Image.new("RGB", (56, 56), (128, 128, 128)).save(tmp_path / "ok.png")
    Image.new("RGB", (3000, 8), (128, 128, 128)).save(tmp_path / "strip.png")
    ok = {"image": "ok.png", "question": "How many?", "answer": "2"}
    bad = [{**ok, "image": "strip.png"}, {**ok, "question": "How many <|image_pad|>?"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [ok, *bad, ok, ok]))
    args = ["train", "vlm_clevr", f"data.train={tmp_path / 'd.jsonl'}", "model.path=",
            "train.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=4", "train.eval_samples=0", "train.eval_every=0",
            "log.progress=false", "log.tensorboard=false", "algo.dynamic_sampling=false"]  # fmt: skip
    assert main([*args, "--run-dir", str(tmp_path / "strict")]) == 3
    assert "line 2" in capsys.readouterr().err
    assert main([*args, "data.strict=false", "--run-dir", str(tmp_path / "lenient")]) == 0
    step = next(r for r in read_metrics(tmp_path / "lenient" / "metrics.jsonl") if "lr" in r)
    assert step["data/skipped_aspect_ratio"] == 1.0 and step["data/skipped_special_tokens"] == 1.0
