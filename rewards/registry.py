"""The reward contract: one signature, the per-call context, what a reward declares, the check.

Every reward has one signature::

    fn(completions: list[str], samples: list[dict], ctx: RewardContext, **params) -> list[float]

with one score per completion; ``samples[i]`` is the dataset sample that ``completions[i]``
answers (keys ``answer``, ``reward``, ``meta`` ...), ``ctx`` what the rollout knows of the
call (token lengths, prompt groups, episode records, the time limit) and ``params`` the
keyword parameters the recipe gives the term. A step reward has the same inputs and returns
each completion's scored steps (``rewards/process.py``). Rewards know nothing of models.

A reward registers in `perceptrl.registry.REWARDS` (a step reward in ``STEP_REWARDS``) and
declares there what it needs beyond the call (`RewardNeeds`)::

    @REWARDS.register("judge", prepare=start_worker, counters=restarts, self_timed=True)
    def judge(completions, samples, ctx, model=""): ...

A recipe names a registered reward, or any function as ``"package.module:function"`` (which
declares nothing unless it is also registered): ``REWARDS.resolve(spec)`` finds either, and
`check_call` checks its signature and the recipe's parameters once, when the reward is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from ..registry import Entry

RewardFn = Callable[..., list[float]]
"""``fn(completions, samples, ctx, **params) -> list[float]``"""


@dataclass(frozen=True)
class RewardContext:
    """What a reward may read of one call besides the completions and samples (each list [B],
    one entry per completion; None: the caller does not know it)."""

    lengths: Sequence[int] | None = None
    """completion lengths in tokens as the rollout counts them (stop token included)"""
    group_ids: Sequence[Hashable] | None = None
    """prompt group of each completion (equal for the completions of one prompt)"""
    episodes: Sequence[dict | None] | None = None
    """multi-turn episode records (turns, tool calls, errors, stop reason, ``info``; see
    ``rewards/episode.py``), None for a single-turn row"""
    timeout_s: float | None = None
    """the call's time limit in seconds (None: none); a reward that declares ``self_timed``
    enforces it itself, the others are timed by the composite"""

    def checked(self, n: int) -> RewardContext:
        """This context with its lists as lists, each checked to hold ``n`` entries."""
        out = {}
        for k in _PER_ROW:
            v = getattr(self, k)
            if v is not None:
                out[k] = list(v)
                if len(out[k]) != n:
                    raise ValueError(f"got {len(out[k])} {k} for {n} completions")
        return replace(self, **out)

    def select(self, rows: Sequence[int]) -> RewardContext:
        """The context of completions ``rows`` (in that order)."""
        out = {}
        for k in _PER_ROW:
            v = getattr(self, k)
            if v is not None:
                out[k] = [v[i] for i in rows]
        return replace(self, **out)


_PER_ROW = ("lengths", "group_ids", "episodes")
CONTEXT_KEYS = tuple(f.name for f in fields(RewardContext))
"""Names a recipe may not give a term as parameters: the rollout fills them at each call."""


@dataclass(frozen=True)
class RewardNeeds:
    """What a reward declares when it registers (all optional)."""

    prepare: Callable[..., Any] | None = None
    """``prepare(**params)``, called once with the term's parameters when the reward is built,
    outside any time limit (the judge starts its worker and loads its model there)"""
    counters: Callable[..., Mapping[str, float]] | None = None
    """``counters(**params) -> {counter: running total}``; the composite logs each total's
    change during a call as ``reward/<counter>/<name>``"""
    self_timed: bool = False
    """the reward enforces ``ctx.timeout_s`` itself (raising `RewardTimeout`) instead of being
    timed by the composite (the judge kills its worker, which no timer here could stop)"""
    check_answer: Callable[[dict], str | None] | None = None
    """``check_answer(sample) -> why`` (None: scoreable): asked of every sample that names
    this reward when the data loads, so an answer no completion can ever score (an ``mcq``
    answer that is not an option, an inverted box) is a data error, not a run at 0"""

    @classmethod
    def of(cls, entry: Entry) -> RewardNeeds:
        try:
            return cls(**entry.meta)
        except TypeError as e:
            valid = ", ".join(f.name for f in fields(cls))
            raise ValueError(
                f"{entry.name!r} declares {sorted(entry.meta)}; a reward declares only {valid}"
            ) from e


def check_call(entry: Entry, params: Mapping[str, Any], kind: str = "reward") -> None:
    """Check once, when a reward is built, that ``entry``'s function takes ``(completions,
    samples, ctx)`` and the recipe's ``params`` (validation only: what the function receives
    never depends on its signature).

    Raises:
        ValueError: a parameter the rollout fills, or a call the function cannot take; the
            message names the expected signature or the function's parameters.
    """
    if "timeout_s" in params:
        raise ValueError(
            f"{kind} {entry.name!r}: its time limit per call is the composite's, "
            "rollout.reward_timeout_s; remove timeout_s from its recipe entry"
        )
    bad = sorted(set(params) & set(CONTEXT_KEYS))
    if bad:
        raise ValueError(
            f"{kind} {entry.name!r}: {bad} come from the rollout at each call (ctx), not from "
            "the recipe"
        )
    try:
        sig = inspect.signature(entry.obj)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing to check
    try:
        sig.bind([], [], RewardContext())
    except TypeError as e:
        raise ValueError(
            f"{kind} {entry.name!r} must take (completions, samples, ctx) ({e}); see "
            "perceptrl.rewards.registry"
        ) from e
    try:
        sig.bind([], [], RewardContext(), **params)
    except TypeError as e:
        names = list(sig.parameters)[3:]
        raise ValueError(
            f"{kind} {entry.name!r} does not take parameters {sorted(params)} ({e}); "
            f"its parameters: {', '.join(names) or 'none'}"
        ) from e
