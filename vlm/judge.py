"""The judge model of the ``judge`` reward on the VLM side: any Hugging Face image-text-to-text
model from a local directory, decoding greedily.

Rewards know no model code: ``rewards/judge.py`` builds the judge prompts, runs a supervised
worker process and parses the verdicts; inside that worker it builds the handler of a judge
backend registered here (``perceptrl.registry.JUDGES``, ``hf``), which loads the model once and
turns each request's judge prompts into verdict texts.
"""

from __future__ import annotations

from ..registry import JUDGES
from . import rollout
from .model import load_vlm
from .prompts import PromptConfig, encode_prompts


@JUDGES.register("hf")
class HFJudge:
    """A local Hugging Face VLM as the judge (built in the judge's worker process).

    Args:
        path: local model directory (``save_pretrained`` output).
        device, dtype: where and how the judge runs.
    """

    def __init__(self, path: str, device: str, dtype: str):
        self.model, self.processor = load_vlm(path, dtype=dtype, device=device)

    def __call__(self, request: dict) -> list[str]:
        """``request``: ``samples`` (judge prompts as samples), ``system_prompt``,
        ``batch_size``, ``max_new_tokens``, ``max_prompt_length`` -> one greedy verdict text
        per prompt."""
        cfg = PromptConfig(
            system_prompt=request["system_prompt"], max_prompt_length=request["max_prompt_length"]
        )
        js, bs, out = request["samples"], request["batch_size"], []
        for start in range(0, len(js), bs):
            enc, _ = encode_prompts(self.processor, js[start : start + bs], cfg, strict=True)
            batch = rollout.greedy(self.model, self.processor, enc, request["max_new_tokens"])
            out += [m["completion"] for m in batch.meta]
        return out
