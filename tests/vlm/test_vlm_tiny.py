from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from perceptrl.vlm import rollout
from perceptrl.vlm.prompts import PromptConfig, encode_prompt
from perceptrl.vlm.tiny import ARCHS, SPECIAL_TOKENS, TAG_TOKENS, build_tiny, build_tokenizer

EXPECTED_CLASSES = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor"),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_dir_loads_with_auto_classes(tiny_dirs, arch):
    d = tiny_dirs[arch]
    for f in ("config.json", "model.safetensors", "tokenizer.json", "processor_config.json"):
        assert (d / f).is_file(), f
    assert (d / "model.safetensors").stat().st_size < 20e6  # fits the shipped-asset limit
    assert json.loads((d / "config.json").read_text())["model_type"] == arch
    model = AutoModelForImageTextToText.from_pretrained(d, trust_remote_code=False)
    proc = AutoProcessor.from_pretrained(d, trust_remote_code=False)
    assert (type(model).__name__, type(proc).__name__) == EXPECTED_CLASSES[arch]
    assert len(proc.tokenizer) <= model.config.text_config.vocab_size <= 2048
    assert list(proc.image_processor.image_std) == [0.5, 0.5, 0.5]
    assert proc.video_processor is not None
    assert model.config.image_token_id == proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")


def test_tokenizer_special_tokens_and_roundtrip():
    tok = build_tokenizer()
    for t in SPECIAL_TOKENS + TAG_TOKENS:
        assert len(tok(t)["input_ids"]) == 1, t
    text = "<think>I see 3 red circles left of the blue square.</think><answer>3</answer>"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < 30  # the task vocabulary is merged, not spelled byte by byte
    assert tok.decode(tok("x<|im_end|>")["input_ids"], skip_special_tokens=True) == "x"


@pytest.mark.parametrize("arch", ARCHS)
def test_output_depends_on_image(tiny_dirs, scene, arch):
    """A from-scratch tower on black-background scenes must not be blind (see DESIGN.md)."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_dirs[arch]).eval()
    proc = AutoProcessor.from_pretrained(tiny_dirs[arch])
    scenes = [scene([("red", 30, 30)]), scene([("blue", 80, 70)]), scene([])]
    outs = []
    for im in scenes:
        enc = encode_prompt(
            proc, {"id": "x", "images": [im], "question": "How many?"}, PromptConfig()
        )
        kwargs = rollout.collate(rollout.prompt_inputs([enc]), 0, torch.device("cpu"))
        with torch.no_grad():
            outs.append(model(**kwargs).logits[0, -1].log_softmax(-1))
    assert (outs[0] - outs[1]).abs().max() > 1e-2
    assert (outs[0] - outs[2]).abs().max() > 1e-2


def test_build_is_deterministic_and_validates(tmp_path):
    a = build_tiny("qwen2_5_vl", tmp_path / "a", seed=3, hidden_size=64, layers=1)
    b = build_tiny("qwen2_5_vl", tmp_path / "b", seed=3, hidden_size=64, layers=1)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="valid: qwen2_5_vl, qwen3_vl"):
        build_tiny("llava", tmp_path / "c")
