"""``judge``: a generative reward — a local VLM grades each completion against a rubric.

The judge is any Hugging Face image-text-to-text model in a local directory (``model=``). For
every completion it reads a rubric prompt holding the question, the reference answer and the
completion (plus the sample's images), decodes greedily, and its verdict ``<score>N</score>`` on
the stated 0..``scale`` scale becomes ``N / scale`` in [0, 1]. A verdict that is missing,
unreadable or off the scale scores 0; an empty or non-text completion scores 0 without asking
the judge.

The model runs in a supervised worker process (:mod:`perceptrl.rewards.judge_worker`), one per
(model, device, dtype, limits) for the life of the trainer, so a judge that hangs in native code,
crashes or runs out of memory cannot stall or kill training:

- ``build_reward`` starts the worker and waits for the model to load (``start_timeout_s``), so a
  wrong path or a judge that cannot load fails at start-up, never inside a call's limit;
- each call is bounded by the composite's ``rollout.reward_timeout_s`` (measured from sending the
  prompts to the verdicts; raise it for a large judge). Past it the worker is killed and
  restarted, and the call's samples score 0, counted in ``reward/timeouts/judge``;
- a worker that dies (segfault, the OOM killer) is restarted; the samples of the call are
  retried one by one on the new worker, and only those that fail again score 0
  (``reward/errors/judge``);
- ``memory_limit_gb`` caps the worker's address space (default: half the machine's memory, at
  least 8 GiB; address space exceeds resident memory, see judge_worker). It is applied on the
  CPU only: the CUDA driver reserves far more address space than it uses, so on a GPU the limit
  is not set;
- restarts are logged per step as ``reward/restarts/judge``; after ``max_failures`` failures in a
  row the judge stops restarting and its calls fail (scoring 0, counted as errors) with a
  message naming the setting to change.

Rewards know no model code: the model is loaded and run by a judge backend that the model side
registers in ``perceptrl.registry.JUDGES`` (``backend=``; built in: ``hf``, the VLM side's
Hugging Face loader and greedy decoding, ``vlm/judge.py``). The worker looks the backend up and
builds it, so the parent process imports nothing of the model side (``perceptrl.vlm`` and torch
load in the worker only).

Recipe::

    rollout.reward: {accuracy: 1.0, judge: {weight: 0.5, model: path/to/judge, scale: 10}}
"""

from __future__ import annotations

import re
from pathlib import Path

from ..registry import JUDGES, REWARDS, STEP_REWARDS
from .builtin import _check
from .judge_worker import SupervisedWorker
from .process import Step
from .registry import RewardContext

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

STEP_RUBRIC = (
    "Grade the last step of the reasoning below, written to answer the question.\n"
    "Question: {question}\n"
    "Reference answer: {reference}\n"
    "Reasoning (the last line is the step to grade): {response}\n"
    "Scale: 0 to {scale}. Give {scale} if the step is correct and leads toward the reference "
    "answer, 0 if it is wrong, and a score in between if it is partly right. Reply with the "
    "score only, as <score>N</score>."
)
"""Rubric of ``judge_steps``: ``{response}`` holds the steps so far, the graded one last."""

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


def load_judge(backend: str, path: str, device: str, dtype: str):
    """Inside the judge's worker process: the handler of the registered judge ``backend``
    (``JUDGES``), which loads the model at ``path`` and maps a request (see `_request`) to one
    verdict text per judge prompt."""
    return JUDGES.get(backend)(path, device, dtype)


_WORKERS: dict[tuple, SupervisedWorker] = {}


def _model_dir(model: str) -> str:
    """The judge's directory, resolved; a missing one fails here, before a worker starts."""
    if not model:
        raise ValueError("judge needs model=<local model directory> in its recipe entry")
    p = Path(model).expanduser().resolve()
    if not (p / "config.json").is_file():
        what = "holds no config.json" if p.is_dir() else "does not exist"
        raise ValueError(
            f"judge: model directory {str(p)!r} {what}; give a local Hugging Face model "
            "directory (the output of save_pretrained; models are never downloaded)"
        )
    return str(p)


def judge_worker(
    model: str = "",
    device: str = "cpu",
    dtype: str = "float32",
    memory_limit_gb: float | None = None,
    start_timeout_s: float = 300.0,
    max_failures: int = 3,
    backend: str = "hf",
    **_,
) -> SupervisedWorker:
    """The worker of a judge configuration (the judge's keyword parameters), created (not
    started) on first use and kept for the process."""
    path = _model_dir(model)
    if not str(device).startswith("cpu"):
        memory_limit_gb = 0  # CUDA reserves more address space than any useful cap
    key = (path, str(device), str(dtype), memory_limit_gb, float(start_timeout_s), max_failures,
           str(backend))  # fmt: skip
    if key not in _WORKERS:
        _WORKERS[key] = SupervisedWorker(
            load_judge, (str(backend), path, str(device), str(dtype)), name="judge",
            memory_limit_gb=memory_limit_gb, start_timeout_s=start_timeout_s,
            max_failures=max_failures,
        )  # fmt: skip
    return _WORKERS[key]


def close_judges() -> None:
    """Stop every judge worker of this process (they also stop at exit)."""
    while _WORKERS:
        _WORKERS.popitem()[1].close()


def _prepare(**params) -> None:
    """Start the judge's worker and load its model when the composite is built, outside the
    per-call time limit (a wrong path or a model that cannot load fails here)."""
    judge_worker(**params).start()


def _counters(**params) -> dict[str, float]:
    """Running totals of the judge's worker (``restarts``), for the composite's stats."""
    return judge_worker(**params).counters()


@REWARDS.register("judge", prepare=_prepare, counters=_counters, self_timed=True)
def judge(
    completions: list[str],
    samples: list[dict],
    ctx: RewardContext,
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
    memory_limit_gb: float | None = None,
    start_timeout_s: float = 300.0,
    max_failures: int = 3,
    backend: str = "hf",
) -> list[float]:
    """Scores in [0, 1] from a local judge VLM in a worker process (see the module docstring).

    Args:
        completions: [B] generated texts.
        samples: [B] samples (``question``, ``answer``, ``images``).
        ctx: ``ctx.timeout_s``: the limit per call (``rollout.reward_timeout_s``; None: none).
        model: local directory of the judge (``save_pretrained`` output).
        rubric: template with ``{question}``, ``{reference}``, ``{response}``, ``{scale}``.
        scale: top of the score scale the rubric states.
        max_new_tokens: longest verdict.
        batch_size: judge prompts per generate call.
        device, dtype: where and how the judge runs.
        with_images: show the judge the sample's images.
        max_prompt_length, max_response_chars: prompt bound and completion clip.
        memory_limit_gb: cap on the worker's address space (CPU only); None: half the
            machine's memory, at least 8 GiB; 0: none.
        start_timeout_s: longest wait for the worker to load the model.
        max_failures: hangs, deaths or failed starts in a row after which the judge gives up.
        backend: the judge backend (``perceptrl.registry.JUDGES``) that runs ``model``.
    Returns:
        [B] scores.
    Raises:
        ValueError: no ``model``, a missing directory or a bad scale.
        RewardTimeout: no verdicts in ``ctx.timeout_s`` (the worker is killed, restarted).
        WorkerError: the worker died (restarted), failed the call (e.g. an unreadable image),
            or gave up; the composite counts these.
    """
    _check(completions, samples)
    if not scale > 0:
        raise ValueError(f"judge: scale must be > 0, got {scale}")
    limits = (memory_limit_gb, start_timeout_s, max_failures)
    worker = judge_worker(model, device, dtype, *limits, backend)
    out = [0.0] * len(completions)
    todo, prompts = _to_judge(completions, samples, rubric, scale, max_response_chars, with_images)
    if not todo:
        return out
    request = _request(prompts, batch_size, max_new_tokens, max_prompt_length)
    verdicts = worker.call(request, ctx.timeout_s)
    for i, v in zip(todo, verdicts):
        out[i] = parse_score(v, scale)
    return out


def _to_judge(
    completions: list[str],
    samples: list[dict],
    rubric: str,
    scale: float,
    max_response_chars: int,
    with_images: bool,
) -> tuple[list[int], list[dict]]:
    """completions [B], samples [B] -> (indices [N] of the completions the judge reads, N judge
    prompts from ``build_judge_sample`` in the same order). Only non-empty texts are read; the
    others score 0 unasked."""
    todo = [i for i, c in enumerate(completions) if isinstance(c, str) and c.strip()]
    prompts = [
        build_judge_sample(
            completions[i], samples[i], rubric, scale, max_response_chars, with_images
        )
        for i in todo
    ]
    return todo, prompts


def _request(
    prompts: list[dict], batch_size: int, max_new_tokens: int, max_prompt_length: int
) -> dict:
    """The worker's request for these judge prompts (what a judge backend's handler reads)."""
    return {
        "samples": prompts,
        "system_prompt": JUDGE_SYSTEM_PROMPT,
        "batch_size": max(1, int(batch_size)),
        "max_new_tokens": max_new_tokens,
        "max_prompt_length": max_prompt_length,
    }


_STEP_END = re.compile(r"[.!?](?=\s|$)|\n")


def split_steps(text: str, max_steps: int = 8) -> list[tuple[int, int]]:
    """The reasoning steps of a completion as character spans ``(start, end)``: the sentences
    (or lines) before ``<answer>``, inside ``<think>`` when there is one; at most ``max_steps``."""
    head = re.split(r"<answer>", text, maxsplit=1, flags=re.I)[0]
    start = head.find("<think>")
    start = 0 if start < 0 else start + len("<think>")
    stop = head.find("</think>")
    stop = len(head) if stop < 0 else stop
    spans, pos = [], start
    for m in _STEP_END.finditer(head, start, stop):
        if head[pos : m.end()].strip():
            spans.append((pos, m.end()))
        pos = m.end()
    if head[pos:stop].strip():
        spans.append((pos, stop))
    return spans[:max_steps]


@STEP_REWARDS.register("judge_steps", prepare=_prepare)
def judge_steps(
    completions: list[str],
    samples: list[dict],
    ctx: RewardContext,
    model: str = "",
    rubric: str = STEP_RUBRIC,
    scale: float = 10,
    max_steps: int = 8,
    max_new_tokens: int = 32,
    batch_size: int = 8,
    device: str = "cpu",
    dtype: str = "float32",
    with_images: bool = True,
    max_prompt_length: int = 4096,
    memory_limit_gb: float | None = None,
    start_timeout_s: float = 300.0,
    max_failures: int = 3,
    backend: str = "hf",
) -> list[list[Step]]:
    """Process rewards from a judge model: every reasoning step (`split_steps`) of every
    completion is graded in one batched request to the judge's supervised worker (the same
    worker, limits and failure handling as ``judge``), seeing the question, the reference
    answer and the steps up to it; a step scores ``verdict / scale / k`` (``k`` steps), so a
    completion's process reward is at most 1. Each call is bounded by ``ctx.timeout_s``
    (``rollout.reward_timeout_s``).

    Raises:
        RewardTimeout, WorkerError: as ``judge`` (the rollout source counts them and scores the
            batch's steps 0).
    """
    _check(completions, samples)
    worker = judge_worker(
        model, device, dtype, memory_limit_gb, start_timeout_s, max_failures, backend
    )
    spans = [split_steps(c, max_steps) if isinstance(c, str) else [] for c in completions]
    prompts, where = [], []
    for i, (text, sample) in enumerate(zip(completions, samples)):
        for k, (_, b) in enumerate(spans[i]):
            so_far = "\n".join(text[x:y].strip() for x, y in spans[i][: k + 1])
            prompts.append(build_judge_sample(so_far, sample, rubric, scale, 4000, with_images))
            where.append((i, b, len(spans[i])))
    out: list[list[Step]] = [[] for _ in completions]
    if not prompts:
        return out
    verdicts = worker.call(
        _request(prompts, batch_size, max_new_tokens, max_prompt_length), ctx.timeout_s
    )
    for (i, end, k), v in zip(where, verdicts):
        out[i].append(Step(end, parse_score(v, scale) / k))
    return out
