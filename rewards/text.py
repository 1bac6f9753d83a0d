"""Text rewards: ``math`` (math-verify), ``ocr`` (1 - WER with jiwer), ``rouge_l`` (rouge-score).

Same contract as :mod:`~perceptrl.rewards.builtin`. The libraries are imported on first use, so
importing the registry stays fast.

math-verify guards its own parsing and comparison with ``signal.alarm``, which shares the
interval timer that :class:`~perceptrl.rewards.CompositeReward` uses for ``reward_timeout_s`` and
fails off the main thread; it is therefore called with its own time limits off, and the
composite's limit bounds the whole call instead.
"""

from __future__ import annotations

import functools
import logging
import re

from ..registry import REWARDS
from .builtin import _check, _sid
from .parse import answer_or_text, extract_answer
from .registry import RewardContext

_PUNCT = re.compile(r"[^\w\s]", re.UNICODE)


@functools.cache
def _math_verify():
    import math_verify

    # its "timeout is disabled" warning is expected here (see the module docstring)
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    for mod in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(mod).setLevel(logging.ERROR)
    return math_verify.parse, math_verify.verify


def _math_parse(text: str, wrap_first: bool) -> list:
    """math-verify ``parse`` of ``text``; bare expressions ("x+1", "(1, 2)") are read as LaTeX
    math (``$…$``) when ``wrap_first`` or when the plain parse finds nothing."""
    parse, _ = _math_verify()
    tries = [f"${text}$", text] if wrap_first and "$" not in text else [text, f"${text}$"]
    for t in tries:
        if t.strip("$").strip():
            got = parse(t, parsing_timeout=None)
            if got:
                return got
    return []


@REWARDS.register("math")
def math_reward(completions: list[str], samples: list[dict], ctx: RewardContext) -> list[float]:
    """1 if the answer is mathematically equivalent to the sample's (math-verify), else 0.

    The answer tag's content is read as one expression (``"1/2"``, ``"\\\\frac{1}{2}"``, ``"0.5"``,
    ``"x+1"`` and ``"1+x"`` are all equivalent pairs); without a tag, math-verify searches the
    whole completion (``\\\\boxed{}``, "the final answer is …"). Ground truth: ``answer`` as
    LaTeX or a plain expression.
    """
    _check(completions, samples)
    _, verify = _math_verify()
    out = []
    for c, s in zip(completions, samples):
        gold = _math_parse(str(s["answer"]), wrap_first=True)
        if not gold:
            raise ValueError(
                f"sample {_sid(s)}: math-verify cannot parse answer {s['answer']!r}; write it "
                "as LaTeX (e.g. '\\\\frac{1}{2}') or a plain expression"
            )
        if not isinstance(c, str) or not c.strip():
            out.append(0.0)
            continue
        tagged = extract_answer(c)
        pred = _math_parse(tagged, wrap_first=True) if tagged else _math_parse(c, False)
        ok = bool(pred) and verify(gold, pred, timeout_seconds=None)
        out.append(1.0 if ok else 0.0)
    return out


def _words(text: str, ignore_case: bool, ignore_punct: bool) -> str:
    if ignore_case:
        text = text.lower()
    if ignore_punct:
        text = _PUNCT.sub(" ", text)
    return " ".join(text.split())


@REWARDS.register("ocr")
def ocr(
    completions: list[str],
    samples: list[dict],
    ctx: RewardContext,
    ignore_case: bool = False,
    ignore_punct: bool = False,
) -> list[float]:
    """``max(0, 1 - WER)`` of the answer against the sample's text (word error rate, jiwer).

    WER = (substitutions + deletions + insertions) / reference words, so an answer with more
    errors than the reference has words scores 0. An empty reference scores 1 for an empty
    answer, else 0.

    Args:
        ignore_case: compare lower-cased text.
        ignore_punct: drop punctuation before splitting into words.
    """
    import jiwer

    _check(completions, samples)
    out = []
    for c, s in zip(completions, samples):
        ref = _words(str(s["answer"]), ignore_case, ignore_punct)
        hyp = _words(answer_or_text(c), ignore_case, ignore_punct)
        if not ref:
            out.append(1.0 if not hyp else 0.0)
        elif not hyp:
            out.append(0.0)
        else:
            out.append(min(max(1.0 - float(jiwer.wer(ref, hyp)), 0.0), 1.0))
    return out


@functools.cache
def _rouge_scorer(use_stemmer: bool):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=use_stemmer)


@REWARDS.register("rouge_l")
def rouge_l(
    completions: list[str],
    samples: list[dict],
    ctx: RewardContext,
    measure: str = "fmeasure",
    use_stemmer: bool = True,
) -> list[float]:
    """ROUGE-L (longest common subsequence of words) of the answer against the sample's text.

    Uses rouge-score's tokenizer (lower-cased, alphanumeric words; Porter stemming if
    ``use_stemmer``).

    Args:
        measure: ``fmeasure`` (default), ``precision`` or ``recall``.
    """
    if measure not in ("fmeasure", "precision", "recall"):
        raise ValueError(
            f"rouge_l: unknown measure {measure!r}; valid: fmeasure, precision, recall"
        )
    _check(completions, samples)
    scorer = _rouge_scorer(bool(use_stemmer))
    out = []
    for c, s in zip(completions, samples):
        hyp = answer_or_text(c)
        score = scorer.score(str(s["answer"]), hyp)["rougeL"] if hyp else None
        out.append(float(getattr(score, measure)) if score is not None else 0.0)
    return out
