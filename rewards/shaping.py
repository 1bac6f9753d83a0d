"""Shaping rewards on the completion itself: ``overlong`` (DAPO) and ``repetition`` (n-grams).

Both return penalties, scores <= 0, meant to be added to a correctness reward with weight 1.
"""

from __future__ import annotations

from ..registry import REWARDS
from .builtin import _check
from .registry import RewardContext


def overlong_penalty(length: int, max_len: int, cache_len: int, penalty: float = 1.0) -> float:
    """DAPO soft overlong punishment of a completion of ``length`` tokens.

    0 up to ``max_len - cache_len`` tokens, then falling linearly to ``-penalty`` at ``max_len``,
    and ``-penalty`` beyond it.
    """
    budget = max_len - cache_len
    if length <= budget:
        return 0.0
    if length <= max_len:
        return penalty * (budget - length) / cache_len
    return -penalty


@REWARDS.register("overlong")
def overlong(
    completions: list[str],
    samples: list[dict],
    ctx: RewardContext,
    max_len: int = 512,
    cache_len: int = 128,
    penalty: float = 1.0,
) -> list[float]:
    """DAPO soft overlong punishment, in [-penalty, 0] (see :func:`overlong_penalty`).

    Args:
        max_len: L_max, the longest completion (set it to ``rollout.max_new_tokens``).
        cache_len: L_cache, the length of the soft zone before ``max_len``.
        penalty: the punishment at ``max_len`` and beyond.
    Reads ``ctx.lengths``: [B] completion lengths in tokens as the rollout counts them (stop
    token included).

    Raises:
        ValueError: without ``ctx.lengths`` or with bad lengths (the composite counts the error).
    """
    _check(completions, samples)
    if not (0 < cache_len <= max_len):
        raise ValueError(f"overlong: need 0 < cache_len <= max_len, got {cache_len}, {max_len}")
    lengths = ctx.lengths
    if lengths is None:
        raise ValueError(
            "overlong needs completion lengths in tokens: call the composite reward with "
            "RewardContext(lengths=[...]) (VLMRolloutSource does)"
        )
    if len(lengths) != len(completions):
        raise ValueError(f"overlong: {len(lengths)} lengths for {len(completions)} completions")
    return [overlong_penalty(int(n), max_len, cache_len, penalty) for n in lengths]


def repetition_fraction(text: str, n: int = 3) -> float:
    """Share of repeated word n-grams: ``1 - unique / total`` (0 for text under ``n`` words).

    Words are lower-cased and split on whitespace.
    """
    words = text.lower().split() if isinstance(text, str) else []
    if len(words) < n:
        return 0.0
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams)


@REWARDS.register("repetition")
def repetition(
    completions: list[str],
    samples: list[dict],
    ctx: RewardContext,
    ngram: int = 3,
    penalty: float = 1.0,
) -> list[float]:
    """N-gram repetition penalty ``-penalty * (1 - unique n-grams / n-grams)`` in [-penalty, 0].

    Computed over the whole completion (reasoning included); text without a repeated n-gram,
    shorter than ``ngram`` words, or not a string scores 0.
    """
    _check(completions, samples)
    if ngram < 1:
        raise ValueError(f"repetition: ngram must be >= 1, got {ngram}")
    return [
        -penalty * repetition_fraction(c, ngram) if isinstance(c, str) else 0.0 for c in completions
    ]
