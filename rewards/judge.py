"""``judge``: a generative reward — a local VLM grades each completion against a rubric.

The judge is any Hugging Face image-text-to-text model in a local directory (``model=``). It is
loaded once per (path, device, dtype) and kept for the process. For every completion it reads a
rubric prompt holding the question, the reference answer and the completion (plus the sample's
images), decodes greedily with our HF rollout engine, and its verdict ``<score>N</score>`` on the
stated 0..``scale`` scale becomes ``N / scale`` in [0, 1]. A verdict that is missing, unreadable
or off the scale scores 0; an empty or non-text completion scores 0 without asking the judge.

This is the one reward that runs a model. It imports ``perceptrl.vlm`` only when first used, so
importing the reward registry still loads nothing of the model side. ``build_reward`` loads the
judge once, when the composite is built (a wrong path fails there); the composite's
``reward_timeout_s`` then bounds each judging call: raise it for a large judge.

Recipe::

    rollout.reward: {accuracy: 1.0, judge: {weight: 0.5, model: path/to/judge, scale: 10}}
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from .builtin import _check
from .registry import register_reward

JUDGE_SYSTEM_PROMPT = (
    "You are a careful, strict grader. You compare a response with a reference answer and "
    "reply only with a score in <score></score> tags."
)

DEFAULT_RUBRIC = (
    "Grade the response to the question below against the reference answer.\n"
    "Question: {question}\n"
    "Reference answer: {reference}\n"
    "Response: {response}\n"
    "Scale: 0 to {scale}. Give {scale} if the response's final answer matches the reference "
    "in meaning, 0 if it is wrong, missing or off-topic, and a score in between if it is "
    "partly correct. Reply with the score only, as <score>N</score>."
)
"""Rubric template; ``{question}``, ``{reference}``, ``{response}`` and ``{scale}`` are filled in
(a custom rubric must keep ``<score>N</score>`` as the verdict format)."""

_SCORE = re.compile(r"<score>\s*([-+]?\d+(?:\.\d+)?)\s*(?:/\s*(\d+(?:\.\d+)?)\s*)?</score>", re.I)


def parse_score(text: str, scale: float = 10) -> float:
    """The last ``<score>N</score>`` (or ``<score>N/scale</score>``) of a verdict as
    ``N / scale`` in [0, 1]; 0 when there is none, it is off the scale or names another scale."""
    if not isinstance(text, str):
        return 0.0
    found = _SCORE.findall(text)
    if not found:
        return 0.0
    value, denom = found[-1]
    v = float(value)
    if denom and float(denom) != float(scale):
        return 0.0
    return v / scale if 0 <= v <= scale else 0.0


def build_judge_sample(
    completion: str,
    sample: dict,
    rubric: str = DEFAULT_RUBRIC,
    scale: float = 10,
    max_response_chars: int = 4000,
    with_images: bool = True,
) -> dict:
    """The judge's prompt as a sample (``question`` = the filled rubric, the sample's images)."""
    question = str(sample.get("question", "")) if isinstance(sample, dict) else ""
    reference = str(sample.get("answer", "")) if isinstance(sample, dict) else ""
    response = completion[:max_response_chars]
    images = list(sample.get("images") or []) if with_images and isinstance(sample, dict) else []
    text = rubric.format(question=question, reference=reference, response=response, scale=scale)
    if images:  # keep images before the rubric: a "<image>" in the text is not a placeholder
        text = text.replace("<image>", "[image]")
    sid = sample.get("id") if isinstance(sample, dict) else None
    return {"id": f"judge:{sid}", "images": images, "question": text, "answer": "", "meta": {}}


@functools.lru_cache(maxsize=2)
def load_judge(path: str, device: str = "cpu", dtype: str = "float32"):
    """(model, processor) of the judge at ``path``, loaded once per (path, device, dtype)."""
    from ..vlm.model import load_vlm

    return load_vlm(path, dtype=dtype, device=device)


def _judge_model(model: str, device: str, dtype: str):
    if not model:
        raise ValueError("judge needs model=<local model directory> in its recipe entry")
    return load_judge(str(Path(model).expanduser().resolve()), str(device), str(dtype))


@register_reward("judge")
def judge(
    completions: list[str],
    samples: list[dict],
    model: str = "",
    rubric: str = DEFAULT_RUBRIC,
    scale: float = 10,
    max_new_tokens: int = 32,
    batch_size: int = 8,
    device: str = "cpu",
    dtype: str = "float32",
    with_images: bool = True,
    max_prompt_length: int = 4096,
    max_response_chars: int = 4000,
) -> list[float]:
    """Scores in [0, 1] from a local judge VLM (see the module docstring).

    Args:
        model: local directory of the judge (``save_pretrained`` output).
        rubric: template with ``{question}``, ``{reference}``, ``{response}``, ``{scale}``.
        scale: top of the score scale the rubric states.
        max_new_tokens: longest verdict.
        batch_size: judge prompts per generate call.
        device, dtype: where and how the judge runs (loaded once per combination).
        with_images: show the judge the sample's images.
        max_prompt_length, max_response_chars: prompt bound and completion clip.
    Raises:
        ValueError: no ``model`` or a bad scale; errors loading the judge or its prompts propagate
            (the composite counts them).
    """
    from ..vlm import rollout
    from ..vlm.prompts import PromptConfig, encode_prompts

    _check(completions, samples)
    if not scale > 0:
        raise ValueError(f"judge: scale must be > 0, got {scale}")
    jm, proc = _judge_model(model, device, dtype)
    cfg = PromptConfig(system_prompt=JUDGE_SYSTEM_PROMPT, max_prompt_length=max_prompt_length)
    out = [0.0] * len(completions)
    todo = [i for i, c in enumerate(completions) if isinstance(c, str) and c.strip()]
    for start in range(0, len(todo), batch_size):
        idx = todo[start : start + batch_size]
        js = [
            build_judge_sample(
                completions[i], samples[i], rubric, scale, max_response_chars, with_images
            )
            for i in idx
        ]
        enc, _ = encode_prompts(proc, js, cfg, strict=True)
        verdicts = rollout.greedy(jm, proc, enc, max_new_tokens).meta
        for i, m in zip(idx, verdicts):
            out[i] = parse_score(m["completion"], scale)
    return out


def _prepare(model: str = "", device: str = "cpu", dtype: str = "float32", **_) -> None:
    """Load the judge when the composite is built, outside the per-call time limit."""
    _judge_model(model, device, dtype)


judge.prepare = _prepare  # called once by build_reward (see rewards/compose.py)
