"""LoRA fine-tuning of a VLM policy with peft adapters, and the reference policy it gets for free.

Adapters go on the language model's attention and MLP projections (optionally on the vision
tower's too); every other weight is frozen. peft injects the adapter layers into the model in
place, so the policy keeps calling the same Hugging Face module (rollouts, ``evaluate``,
ZeRO partitioning all see one model). The KL reference is that same module with its adapters
switched off (``disable_adapter()``): the frozen base *is* the reference, and no second copy of
the weights exists.

A checkpoint's ``model/`` holds the merged weights (``W + scale * B @ A``) as a plain HF
directory, loadable by ``from_pretrained``/``perceptrl eval`` without peft, and
``model/adapter/`` the adapter alone (``adapter_model.safetensors`` + ``adapter_config.json``),
which is what a resume restores.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from ..trainer.batch import RolloutBatch
from ..trainer.policy import Evaluation
from .policy import VLMPolicy

LANGUAGE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VISION_TARGETS = ("qkv", "proj", "gate_proj", "up_proj", "down_proj")
"""Qwen-VL vision blocks: attention ``attn.qkv``/``attn.proj``, MLP gate/up/down projections"""
ADAPTER_DIR = "adapter"
ADAPTER_NAME = "default"


def target_pattern(model: nn.Module, targets: Sequence[str], vision: bool) -> str:
    """A peft ``target_modules`` regex (matched against full module names) that selects the
    linear layers named ``targets`` inside the language model, plus the vision blocks' linear
    layers when ``vision``. Raises when it selects nothing, listing the linear layers there are."""
    if not targets:
        raise ValueError("model.lora_target_modules is empty; name at least one linear layer")
    names = "|".join(re.escape(t) for t in targets)
    pattern = rf".*language_model\..*\.(?:{names})"
    if vision:
        vnames = "|".join(re.escape(t) for t in VISION_TARGETS)
        pattern += rf"|.*visual\.blocks\..*\.(?:{vnames})"
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not any(re.fullmatch(pattern, n) for n in linear if "language_model." in n):
        sample = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in linear})) or "none"
        raise ValueError(
            f"model.lora_target_modules={list(targets)} matches no linear layer of the language "
            f"model (a module under '*language_model.*'); linear layer names in this model: {sample}"
        )
    return pattern


def apply_lora(
    policy: VLMPolicy,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets: Sequence[str] = LANGUAGE_TARGETS,
    vision: bool = False,
) -> LoraVLMPolicy:
    """Wrap ``policy``'s model with fresh LoRA adapters (B = 0, so the policy starts as the base).

    Args:
        policy: a ``VLMPolicy``; its model is modified in place (adapter layers injected, base
            weights frozen).
        rank, alpha, dropout: LoRA rank r, scaling numerator (update scaled by alpha / r), and
            dropout on the adapter input (the policy zeroes it: RL needs deterministic forwards).
        targets: linear layer names inside the language model.
        vision: also adapt the vision tower's attention and MLP projections.

    Returns:
        a ``LoraVLMPolicy`` over the same model and processor.
    """
    from peft import LoraConfig, get_peft_model

    if rank <= 0:
        raise ValueError(f"model.lora_rank={rank}: LoRA needs a rank >= 1 (0 turns LoRA off)")
    pattern = target_pattern(policy.model, targets, vision)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=pattern, bias="none"
    )
    peft_model = get_peft_model(policy.model, config, adapter_name=ADAPTER_NAME)
    out = LoraVLMPolicy(
        peft_model, policy.processor, policy.prompt, policy.sampling,
        share_prefix=policy.share_prefix, episode=policy.episode,
    )  # fmt: skip
    return out


class LoraVLMPolicy(VLMPolicy):
    """A ``VLMPolicy`` whose trainable weights are LoRA adapters.

    ``self.model`` is the base Hugging Face model with the adapter layers injected (what
    rollouts and ``evaluate`` call); ``self.peft_model`` is peft's wrapper, used to switch the
    adapters off, save them and merge them.
    """

    def __init__(self, peft_model: nn.Module, processor, prompt=None, sampling=None, **kwargs):
        super().__init__(peft_model.get_base_model(), processor, prompt, sampling, **kwargs)
        self.peft_model = peft_model

    def trainable_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.model.named_parameters() if p.requires_grad)

    def reference(self) -> AdapterDisabledReference:
        """The base model as the KL reference: this policy's own module, adapters disabled."""
        return AdapterDisabledReference(self)

    def adapter_state_dict(self) -> dict[str, Tensor]:
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.peft_model, adapter_name=ADAPTER_NAME)

    @torch.no_grad()
    def merged_state_dict(self) -> dict[str, Tensor]:
        """The base model's state dict with each adapted weight replaced by ``W + scale * B @ A``
        and peft's names undone (``x.base_layer.weight`` -> ``x.weight``, no ``lora_*`` keys).
        The live model is left unmerged."""
        from peft.tuners.lora import LoraLayer

        layers = {n: m for n, m in self.model.named_modules() if isinstance(m, LoraLayer)}
        out: dict[str, Tensor] = {}
        for key, value in self.model.state_dict().items():
            if ".lora_" in key:
                continue
            if ".base_layer." in key:
                module, pname = key.split(".base_layer.")
                if pname == "weight":
                    delta = layers[module].get_delta_weight(ADAPTER_NAME)
                    value = value + delta.to(value.dtype)
                key = f"{module}.{pname}"
            out[key] = value
        return out

    def save(self, path: str | Path) -> None:
        """``path``: merged HF directory (weights, config, processor); ``path/adapter``: the
        adapter alone (safetensors + adapter_config.json)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, state_dict=self.merged_state_dict())
        self.processor.save_pretrained(path)
        self.peft_model.save_pretrained(path / ADAPTER_DIR, safe_serialization=True)

    def load(self, path: str | Path) -> None:
        """Restore in place the adapter weights ``save(path)`` wrote (the base stays as is)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        file = Path(path) / ADAPTER_DIR / "adapter_model.safetensors"
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} is missing: {path} was not written by a LoRA policy (model.lora_rank>0)"
            )
        result = set_peft_model_state_dict(
            self.peft_model, load_file(str(file)), adapter_name=ADAPTER_NAME
        )
        missing = [k for k in result.missing_keys if ".lora_" in k]
        if missing:
            raise ValueError(
                f"adapter in {file} lacks {len(missing)} LoRA weights of this model (e.g. "
                f"{missing[0]}); was it trained with other lora_target_modules / lora_rank?"
            )


class AdapterDisabledReference:
    """The KL reference of a LoRA policy: the same module with its adapters switched off, so
    ``logp_ref`` is the base model's log-probability and no weights are copied."""

    has_critic = False

    def __init__(self, policy: LoraVLMPolicy):
        self.policy = policy

    @torch.no_grad()
    def evaluate(self, batch: RolloutBatch) -> Evaluation:
        with self.policy.peft_model.disable_adapter():
            return self.policy.evaluate(batch)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The policy's own (shared) parameters: the reference owns none."""
        return self.policy.parameters()

    def state_dict(self) -> dict:
        return {}

    def save(self, path: str | Path) -> None:
        raise NotImplementedError(
            "the LoRA reference is the base model inside the policy; save the policy instead"
        )

    def load(self, path: str | Path) -> None:
        raise NotImplementedError("the LoRA reference has no weights of its own")
