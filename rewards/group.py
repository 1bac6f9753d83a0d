"""``majority``: an unsupervised reward from the group's own answers (test-time RL, TTRL).

The completions of one prompt vote with their extracted answers; the most frequent answer is the
pseudo-label and a completion scores 1 when its answer equals it, 0 otherwise. No ground truth is
read, so the reward works on unlabelled prompts.

Group membership: the composite passes ``ctx.group_ids`` (the rollout's prompt index of each
completion, unique per prompt in a batch). Without them, completions sharing a sample ``id`` (or,
lacking ids, the same sample object) form a group — the rollout repeats one sample object for its
G completions, so this is exact unless one prompt appears twice in a batch, whose groups then
vote together (same question, so the pseudo-label is the same in expectation).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence

from ..registry import REWARDS
from .builtin import _check
from .parse import answer_or_text, extract_answer, extract_boxed, extract_letter, parse_number
from .registry import RewardContext

_NUMERIC = {"numeric", "count", "mra"}


def _text_key(text: str) -> str | None:
    key = re.sub(r"\s+", " ", text).strip().strip(".").strip().lower()
    return key or None


def answer_key(completion: str, sample: dict, key: str = "auto") -> Hashable | None:
    """The vote of one completion: its answer normalised for comparison, None if it has none.

    Args:
        key: ``"number"`` (the one number), ``"letter"`` (the option letter, using
            ``meta["options"]``), ``"text"`` (the answer lower-cased, whitespace collapsed) or
            ``"auto"``: by ``sample["reward"]`` — number for numeric/count/mra, letter for mcq,
            text otherwise. Only an answer in tags or ``\\\\boxed{}`` votes in text mode.
    """
    if not isinstance(completion, str):
        return None
    if key == "auto":
        name = sample.get("reward") if isinstance(sample, dict) else None
        key = "number" if name in _NUMERIC else "letter" if name == "mcq" else "text"
    ans = answer_or_text(completion)
    if key == "number":
        return parse_number(ans)
    if key == "letter":
        options = (sample.get("meta") or {}).get("options") if isinstance(sample, dict) else None
        return extract_letter(ans, options)
    if key == "text":
        tagged = extract_answer(completion)
        tagged = tagged if tagged is not None else extract_boxed(completion)
        return _text_key(tagged) if tagged is not None else None
    raise ValueError(f"majority: unknown key {key!r}; valid: auto, number, letter, text")


def _groups(samples: Sequence[dict], group_ids: Sequence | None) -> dict[Hashable, list[int]]:
    out: dict[Hashable, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        if group_ids is not None:
            g: Hashable = ("group", group_ids[i])
        elif isinstance(s, dict) and s.get("id") is not None:
            g = ("id", str(s["id"]))
        else:
            g = ("object", id(s))
        out[g].append(i)
    return out


@REWARDS.register("majority")
def majority(
    completions: list[str],
    samples: list[dict],
    ctx: RewardContext,
    key: str = "auto",
    min_share: float = 0.0,
) -> list[float]:
    """1 for completions whose answer is their group's majority answer, else 0 (TTRL).

    Completions without an answer do not vote and score 0. Among tied answers the one given
    first wins (Counter order). See the module docstring for how groups are found.

    Args:
        key: how answers are compared (see :func:`answer_key`).
        min_share: the majority must hold at least this share of the group's completions
            (voting or not) to serve as a label; below it the whole group scores 0.
    Reads ``ctx.group_ids`` ([B] group of each completion) when the rollout gives them.
    """
    _check(completions, samples)
    group_ids = ctx.group_ids
    if group_ids is not None and len(group_ids) != len(completions):
        raise ValueError(f"majority: {len(group_ids)} group ids for {len(completions)} completions")
    keys = [answer_key(c, s, key) for c, s in zip(completions, samples)]
    out = [0.0] * len(completions)
    for idx in _groups(samples, group_ids).values():
        votes = Counter(keys[i] for i in idx if keys[i] is not None)
        if not votes:
            continue
        label, n = votes.most_common(1)[0]
        if n / len(idx) < min_share:
            continue
        for i in idx:
            out[i] = 1.0 if keys[i] is not None and keys[i] == label else 0.0
    return out
