"""Built-in rewards for visual reasoning: ``format``, ``mcq``, ``yesno``, ``numeric``, ``iou``,
``accuracy``.

All take ``(completions, samples, ctx, **params)`` and return one float per completion. A malformed
completion (missing tags, no letter, unparsable number, empty or degenerate box) scores 0 and never
raises; a sample whose ground truth cannot be read raises ``ValueError`` naming its id, which the
composite counts as a reward error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..registry import REWARDS
from .parse import (
    answer_or_text,
    box_iou,
    extract_letter,
    is_boxed_formatted,
    is_formatted,
    parse_box,
    parse_number,
    yes_or_no,
)
from .registry import RewardContext


def _check(completions: Sequence[str], samples: Sequence[dict]) -> None:
    if len(completions) != len(samples):
        raise ValueError(
            f"got {len(completions)} completions for {len(samples)} samples; "
            "pass one sample per completion (repeat a prompt's sample G times)"
        )


def _sid(sample: dict) -> str:
    return repr(sample.get("id", "?")) if isinstance(sample, dict) else "?"


@REWARDS.register("format")
def format_reward(
    completions: list[str], samples: list[dict], ctx: RewardContext, style: str = "tags"
) -> list[float]:
    """1 if the completion has the required layout, else 0.

    Args:
        style: ``"tags"``: exactly ``<think>…</think>\\s*<answer>…</answer>`` (one tag of each
            kind, no nesting, see :func:`~perceptrl.rewards.parse.is_formatted`); ``"boxed"``:
            ``<think>…</think>`` then a final part holding a closed, non-empty ``\\boxed{…}``
            (see :func:`~perceptrl.rewards.parse.is_boxed_formatted`).
    """
    _check(completions, samples)
    checks = {"tags": is_formatted, "boxed": is_boxed_formatted}
    if style not in checks:
        raise ValueError(f"format: unknown style {style!r}; valid: {', '.join(checks)}")
    return [1.0 if checks[style](c) else 0.0 for c in completions]


def _mcq_answer(sample: dict) -> str | None:
    """Why ``sample``'s answer can never score under ``mcq`` (None: it can)."""
    options = (sample.get("meta") or {}).get("options")
    if extract_letter(str(sample["answer"]), options) is None:
        return "it is not an option letter (A, B, ...) of the sample's options"
    return None


def _number_answer(sample: dict) -> str | None:
    """Why ``sample``'s answer can never score under ``numeric`` (None: it can)."""
    return None if parse_number(str(sample["answer"])) is not None else "it holds no one number"


def _box_answer(sample: dict) -> str | None:
    """Why ``sample``'s answer can never score under ``iou``/``giou`` (None: it can)."""
    gt = parse_box(str(sample["answer"]))
    if gt is None or gt[2] <= gt[0] or gt[3] <= gt[1]:
        return "it is no box [x1, y1, x2, y2] with x1 < x2 and y1 < y2"
    return None


def _matches(completions: list[str], samples: list[dict], read: Callable, what: str) -> list[float]:
    """1 where the completion's answer (`answer_or_text`) reads as the sample's answer, else 0;
    ``read(text, sample)`` gives what a text says (None: nothing). A sample whose own answer
    says nothing raises, naming ``what`` it is instead."""
    _check(completions, samples)
    out = []
    for c, s in zip(completions, samples):
        gt = read(str(s["answer"]), s)
        if gt is None:
            raise ValueError(f"sample {_sid(s)}: answer {s['answer']!r} is {what}")
        out.append(1.0 if read(answer_or_text(c), s) == gt else 0.0)
    return out


@REWARDS.register("mcq", check_answer=_mcq_answer)
def mcq(completions: list[str], samples: list[dict], ctx: RewardContext) -> list[float]:
    """1 if the option letter in the answer tag (or the text) equals the sample's letter, else 0.

    ``meta["options"]`` (option texts, A first), when present, restricts the valid letters and lets
    an answer equal to an option text count as its letter.
    """

    def letter(text: str, sample: dict) -> str | None:
        return extract_letter(text, (sample.get("meta") or {}).get("options"))

    return _matches(completions, samples, letter, "not an option letter")


def _yes_no_answer(sample: dict) -> str | None:
    """Why ``sample``'s answer can never score under ``yesno`` (None: it can)."""
    return None if yes_or_no(str(sample["answer"])) else "it is neither Yes nor No"


@REWARDS.register("yesno", check_answer=_yes_no_answer)
def yesno(completions: list[str], samples: list[dict], ctx: RewardContext) -> list[float]:
    """1 if the answer tag (or the text) says the sample's Yes or No, else 0: it says one when its
    words hold "yes" or "no" and not both (VLMEvalKit's Y/N extraction, as MME, POPE and
    HallusionBench score)."""
    return _matches(completions, samples, lambda text, _: yes_or_no(text), "neither Yes nor No")


@REWARDS.register("numeric", check_answer=_number_answer)
def numeric(
    completions: list[str],
    samples: list[dict],
    ctx: RewardContext,
    rel_tol: float = 1e-9,
    abs_tol: float = 0.0,
) -> list[float]:
    """1 if the one number in the answer (digits or zero..twenty) matches within tolerance, else 0.

    Args:
        rel_tol, abs_tol: as ``math.isclose``; the defaults make integers exact. A sample's
            ``meta["rel_tol"]``/``meta["abs_tol"]`` override them.
    """
    _check(completions, samples)
    out = []
    for c, s in zip(completions, samples):
        gt = parse_number(str(s["answer"]))
        if gt is None:
            raise ValueError(f"sample {_sid(s)}: answer {s['answer']!r} is not a number")
        meta = s.get("meta") or {}
        pred = parse_number(answer_or_text(c))
        ok = pred is not None and math.isclose(
            pred,
            gt,
            rel_tol=float(meta.get("rel_tol", rel_tol)),
            abs_tol=float(meta.get("abs_tol", abs_tol)),
        )
        out.append(1.0 if ok else 0.0)
    return out


def answer_box(sample: dict) -> list[float]:
    """The sample's ground-truth box ``"[x1, y1, x2, y2]"``; a malformed one is a dataset error."""
    gt = parse_box(str(sample["answer"]))
    if gt is None or gt[2] <= gt[0] or gt[3] <= gt[1]:
        raise ValueError(
            f"sample {_sid(sample)}: answer {sample['answer']!r} is not a box [x1, y1, x2, y2]"
        )
    return gt


def to_original(box: list[float], meta: dict) -> list[float]:
    """Map a box from ``meta["model_image_size"]`` to ``meta["image_size"]`` coordinates."""
    msize, size = meta.get("model_image_size"), meta.get("image_size")
    if not msize or not size:
        return box
    sx, sy = size[0] / msize[0], size[1] / msize[1]
    return [box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy]


@REWARDS.register("iou", check_answer=_box_answer)
def iou(completions: list[str], samples: list[dict], ctx: RewardContext) -> list[float]:
    """IoU in [0, 1] of the first box in the answer with the sample's box ``"[x1, y1, x2, y2]"``.

    The predicted box is in the model's coordinates: when ``meta["model_image_size"]`` and
    ``meta["image_size"]`` are both present it is scaled back to original pixels first.
    Missing, malformed or degenerate (x2 <= x1 or y2 <= y1) boxes score 0.
    """
    _check(completions, samples)
    out = []
    for c, s in zip(completions, samples):
        gt = answer_box(s)
        pred = parse_box(answer_or_text(c))
        out.append(0.0 if pred is None else box_iou(to_original(pred, s.get("meta") or {}), gt))
    return out


@REWARDS.register("accuracy")
def accuracy(
    completions: list[str], samples: list[dict], ctx: RewardContext, **params: dict
) -> list[float]:
    """Per sample, the reward named by ``sample["reward"]`` (so one recipe serves mixed families).

    Args:
        **params: reward name -> keyword arguments for it, e.g. ``numeric={"abs_tol": 0.5}``.
    """
    _check(completions, samples)
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        name = s.get("reward") if isinstance(s, dict) else None
        if not isinstance(name, str) or name in ("accuracy", ""):
            raise ValueError(
                f"sample {_sid(s)}: sample['reward'] must name an accuracy reward "
                f"(e.g. numeric, mcq, iou), got {name!r}"
            )
        groups.setdefault(name, []).append(i)
    out = [0.0] * len(samples)
    for name, idx in groups.items():
        fn = REWARDS.resolve(name).obj
        scores = fn(
            [completions[i] for i in idx],
            [samples[i] for i in idx],
            ctx.select(idx),
            **params.get(name, {}),
        )
        for i, v in zip(idx, scores):
            out[i] = float(v)
    return out
