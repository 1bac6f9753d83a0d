"""Rewards on measured quantities: ``mra`` (VSI-Bench), ``tiou`` (temporal IoU), ``count``.

Same contract as :mod:`~perceptrl.rewards.builtin`: one float per completion, a malformed
completion scores 0 and never raises, an unreadable ground truth raises ``ValueError`` naming the
sample (the composite counts it as a reward error).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from ..registry import REWARDS
from .builtin import _check, _sid
from .parse import _NUM, _to_float, answer_or_text, parse_number
from .registry import RewardContext

MRA_THRESHOLDS = tuple((50 + 5 * k) / 100 for k in range(10))
"""VSI-Bench confidence thresholds θ = 0.50, 0.55, …, 0.95."""

_EPS = 1e-9  # absorbs float error at a threshold: |15 - 10| / 10 <= 1 - 0.5 must hold


def mra_score(pred: float, gt: float, thresholds: Sequence[float] = MRA_THRESHOLDS) -> float:
    """Mean relative accuracy: mean over θ of ``[|pred - gt| / |gt| <= 1 - θ]``.

    With the default thresholds a prediction within 5% of ``gt`` scores 1, one off by 50% scores
    0.1 and one off by more than 50% scores 0. ``gt`` must be non-zero.
    """
    rel = abs(pred - gt) / abs(gt)
    return sum(rel <= 1.0 - t + _EPS for t in thresholds) / len(thresholds)


def _mra_answer(sample: dict) -> str | None:
    """Why ``sample``'s answer can never score under ``mra`` (None: it can)."""
    gt = parse_number(str(sample["answer"]))
    return None if gt is not None and gt != 0 else "it holds no one non-zero number"


def _span_answer(sample: dict) -> str | None:
    """Why ``sample``'s answer can never score under ``tiou`` (None: it can)."""
    ans = sample["answer"]
    if parse_span(ans if isinstance(ans, (list, tuple)) else str(ans)) is None:
        return "it is no time span [start, end] in seconds with start <= end"
    return None


def _count_answer(sample: dict) -> str | None:
    """Why ``sample``'s answer can never score under ``count`` (None: it can)."""
    gt = parse_number(str(sample["answer"]))
    return None if gt is not None and gt >= 0 and gt == int(gt) else "it is no count (0, 1, 2, ...)"


@REWARDS.register("mra", check_answer=_mra_answer)
def mra(completions: list[str], samples: list[dict], ctx: RewardContext) -> list[float]:
    """VSI-Bench mean relative accuracy of the one number in the answer, in {0, 0.1, …, 1}.

    Ground truth: the sample's ``answer`` (a non-zero number: a distance, a size, a count).
    An answer without exactly one number scores 0.
    """
    _check(completions, samples)
    out = []
    for c, s in zip(completions, samples):
        gt = parse_number(str(s["answer"]))
        if gt is None or gt == 0:
            raise ValueError(
                f"sample {_sid(s)}: mra needs a non-zero number as answer, got {s['answer']!r}"
            )
        pred = parse_number(answer_or_text(c))
        out.append(0.0 if pred is None else mra_score(pred, gt))
    return out


_CLOCK = r"\d+(?::\d{1,2}){1,2}(?:\.\d+)?"  # mm:ss or hh:mm:ss, optional fraction
_TIME = re.compile(rf"(?<![\w.:])(?:{_CLOCK}|{_NUM})")


def _seconds(tok: str) -> float | None:
    if ":" not in tok:
        return _to_float(tok)
    parts = tok.split(":")
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        return None
    if any(v < 0 for v in vals) or any(v >= 60 for v in vals[1:]):
        return None
    secs = 0.0
    for v in vals:
        secs = secs * 60 + v
    return secs


def parse_span(text) -> tuple[float, float] | None:
    """A time span ``(start, end)`` in seconds from its two numbers, else None.

    Reads ``"[12.5, 20]"``, ``"12.5 - 20.0 seconds"``, ``"from 3 to 7.5 s"``, ``"00:12-01:05"``
    (mm:ss, hh:mm:ss) and two-element lists. Anything that does not hold exactly two times, a
    negative time, or end < start gives None.
    """
    if isinstance(text, (list, tuple)):
        vals = [float(v) if isinstance(v, (int, float)) else None for v in text]
    elif isinstance(text, str):
        vals = [_seconds(t) for t in _TIME.findall(text)]
    else:
        return None
    if len(vals) != 2 or any(v is None or not math.isfinite(v) or v < 0 for v in vals):
        return None
    start, end = vals
    return (start, end) if end >= start else None


def span_iou(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Temporal IoU of two spans: overlap / (max end - min start); 0 when the union is empty."""
    inter = max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
    union = max(a[1], b[1]) - min(a[0], b[0])
    return inter / union if union > 0 else (1.0 if a == b else 0.0)


@REWARDS.register("tiou", check_answer=_span_answer)
def tiou(completions: list[str], samples: list[dict], ctx: RewardContext) -> list[float]:
    """Temporal IoU in [0, 1] of the answered span with the sample's span, both in seconds.

    Ground truth: ``answer`` as ``"[start, end]"`` (or a 2-list) in seconds. The answer may write
    seconds or clock times (see :func:`parse_span`); no span, a reversed span or more than two
    times score 0.
    """
    _check(completions, samples)
    out = []
    for c, s in zip(completions, samples):
        ans = s["answer"]
        gt = parse_span(ans if isinstance(ans, (list, tuple)) else str(ans))
        if gt is None:
            raise ValueError(
                f"sample {_sid(s)}: tiou needs answer '[start, end]' in seconds, got {ans!r}"
            )
        pred = parse_span(answer_or_text(c))
        out.append(0.0 if pred is None else span_iou(pred, gt))
    return out


@REWARDS.register("count", check_answer=_count_answer)
def count(completions: list[str], samples: list[dict], ctx: RewardContext) -> list[float]:
    """1 if the answer's one number is a non-negative integer equal to the count, else 0.

    Unlike ``numeric`` with a tolerance, "3.5" or "-3" is never a count and scores 0.
    """
    _check(completions, samples)
    out = []
    for c, s in zip(completions, samples):
        gt = parse_number(str(s["answer"]))
        if gt is None or gt < 0 or gt != int(gt):
            raise ValueError(f"sample {_sid(s)}: answer {s['answer']!r} is not a count")
        pred = parse_number(answer_or_text(c))
        out.append(1.0 if pred is not None and pred == gt else 0.0)
    return out
