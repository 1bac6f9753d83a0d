"""Load any local Hugging Face image-text-to-text model and its processor.

Only local directories are accepted (the development and CI machines never download weights), and
only safetensors weights. ``trust_remote_code`` stays off unless asked for.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..errors import ModelError
from ..trainer import runtime

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class ModelLoadError(ModelError):
    """A model directory that is missing, incomplete, damaged or not an image-text-to-text
    model (a `ModelError`, so a ValueError too)."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """``"float32" | "bfloat16" | "float16" | "auto"`` (or a torch dtype) -> torch dtype / "auto"."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` picks CUDA when available, else the CPU; a GPU that is not there is a
    `MachineError` (``trainer.runtime.resolve_device``)."""
    return runtime.resolve_device(str(device))


def check_model_dir(path: str | Path) -> Path:
    """The model directory as a Path, or a ModelLoadError that says what is missing."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(
            f"model directory {str(p)!r} does not exist; give a local Hugging Face model directory "
            "(models are never downloaded) or build a tiny one with "
            "`python -m perceptrl.vlm.tiny qwen2_5_vl DIR`"
        )
    if not p.is_dir() or not (p / "config.json").is_file():
        raise ModelLoadError(
            f"{str(p)!r} is not a Hugging Face model directory (no config.json); "
            "expected the output of save_pretrained (config.json, *.safetensors, processor files)"
        )
    if not any(p.glob("*.safetensors")) and not (p / "model.safetensors.index.json").exists():
        raise ModelLoadError(
            f"no safetensors weights in {str(p)!r}; only *.safetensors checkpoints are loaded "
            "(convert .bin weights with save_pretrained(..., safe_serialization=True))"
        )
    return p


@contextlib.contextmanager
def _load_errors(path: Path, what: str):
    """Turn what ``from_pretrained`` raises for a damaged or foreign directory (a truncated or
    corrupt safetensors file, a config.json that is not JSON, weights that do not fit their
    config, missing processor files) into a `ModelLoadError` that names the folder and the fix."""
    try:
        yield
    except ModelLoadError:
        raise
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        first = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:300]
        cause = f"{type(e).__name__}: {first}"
        if "Unrecognized configuration class" in str(e):
            raise ModelLoadError(
                f"{str(path)!r} is not an image-text-to-text model ({cause})"
            ) from e
        fix = (
            "its processor files (processor_config.json or preprocessor_config.json, the "
            "tokenizer) are missing or damaged: save the processor beside the weights "
            "(processor.save_pretrained) or copy them from the base model"
            if what == "the processor"
            else "its weights or config.json are damaged or do not match (a copy cut short?): "
            "copy the folder again, or point model.path at another checkpoint's model folder"
        )
        raise ModelLoadError(f"cannot load {what} from {str(path)!r} ({cause}); {fix}") from e


def set_pixel_bounds(processor, min_pixels: int | None = None, max_pixels: int | None = None):
    """Set the image processor's resize bounds (Qwen-style ``shortest_edge``/``longest_edge``
    pixel counts); a processor without them raises when bounds are asked for."""
    if min_pixels is None and max_pixels is None:
        return processor
    from transformers.image_utils import SizeDict

    ip = processor.image_processor
    size = dict(getattr(ip, "size", None) or {})
    if "longest_edge" not in size:
        raise ValueError(
            f"{type(ip).__name__} has no pixel-count bounds (size={size}); min_pixels/max_pixels "
            "apply to Qwen-VL style processors only"
        )
    if min_pixels is not None:
        size["shortest_edge"] = int(min_pixels)
    if max_pixels is not None:
        size["longest_edge"] = int(max_pixels)
    ip.size = SizeDict(**size) if isinstance(ip.size, SizeDict) else size
    return processor


def set_checkpointing(model, on: bool) -> None:
    """Activation checkpointing on (non-reentrant) or off, under the method name the installed
    transformers has (``activation_checkpointing_*`` from 5.2x, ``gradient_checkpointing_*``
    before)."""
    if on:
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def load_vlm(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    attn_implementation: str | None = None,
):
    """Load a local image-text-to-text model and its processor.

    Args:
        path: local directory written by ``save_pretrained`` (config.json + safetensors).
        dtype: ``float32 | bfloat16 | float16 | auto`` (auto keeps the checkpoint's dtype).
        device: ``cpu | cuda | cuda:N | auto``.
        gradient_checkpointing: recompute activations in backward (non-reentrant).
        trust_remote_code: allow model code shipped inside the directory (off by default).
        min_pixels, max_pixels: image resize bounds for Qwen-VL style processors.
        attn_implementation: e.g. ``sdpa`` or ``eager``; None keeps the library default.

    Returns:
        (model, processor); the model is in eval mode on ``device``.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    p = check_model_dir(path)
    kwargs = dict(
        dtype=resolve_dtype(dtype),
        trust_remote_code=trust_remote_code,
        local_files_only=True,
        use_safetensors=True,
    )
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with _load_errors(p, "the model"):
        model = AutoModelForImageTextToText.from_pretrained(p, **kwargs)
    with _load_errors(p, "the processor"):
        processor = AutoProcessor.from_pretrained(p, trust_remote_code=trust_remote_code)
    if not hasattr(processor, "image_processor"):
        raise ModelLoadError(
            f"the processor in {str(p)!r} has no image processor (a text-only tokenizer?); "
            "save the image-text-to-text model's processor there (processor.save_pretrained)"
        )
    set_pixel_bounds(processor, min_pixels, max_pixels)
    model.to(resolve_device(device))
    if gradient_checkpointing:
        set_checkpointing(model, True)
    model.eval()
    return model, processor
