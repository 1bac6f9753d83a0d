from __future__ import annotations

import shutil

import pytest
import torch

from perceptrl.vlm.model import ModelLoadError, load_vlm
from perceptrl.vlm.prompts import PromptConfig, encode_prompt


def test_load_vlm_defaults(tiny_dirs):
    model, proc = load_vlm(tiny_dirs["qwen2_5_vl"])
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert next(model.parameters()).device.type == "cpu"
    assert hasattr(proc, "image_processor") and hasattr(proc, "tokenizer")


def test_load_vlm_dtype_and_checkpointing(tiny_dirs):
    model, _ = load_vlm(tiny_dirs["qwen3_vl"], dtype="bfloat16", gradient_checkpointing=True)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.is_activation_checkpointing
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_vlm(tiny_dirs["qwen3_vl"], dtype="float8")


def test_load_vlm_pixel_bounds_change_vision_tokens(tiny_dirs, images):
    sample = {"id": "a", "images": [images[1]], "question": "How many?"}  # 168x112 image
    _, proc = load_vlm(tiny_dirs["qwen2_5_vl"])
    _, small = load_vlm(tiny_dirs["qwen2_5_vl"], max_pixels=56 * 56)
    assert small.image_processor.size["longest_edge"] == 56 * 56
    n_default = encode_prompt(proc, sample, PromptConfig()).num_vision_tokens
    n_small = encode_prompt(small, sample, PromptConfig()).num_vision_tokens
    assert n_default == 24 and n_small < n_default  # 168x112 -> 12x8 patches -> 6x4 tokens


def test_load_vlm_clear_errors(tmp_path, tiny_dirs):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_vlm(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_vlm(tmp_path / "empty")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_dirs["qwen2_5_vl"] / "config.json", no_weights / "config.json")
    with pytest.raises(ModelLoadError, match="no safetensors weights"):
        load_vlm(no_weights)


def test_load_vlm_rejects_text_only_model(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "lm")
    with pytest.raises(ModelLoadError, match="not an image-text-to-text model"):
        load_vlm(tmp_path / "lm")
