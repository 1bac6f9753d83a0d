"""Episode terms: rewards on how a multi-turn episode went, not only on its final answer.

They read the per-call context's ``ctx.episodes`` (see :mod:`~perceptrl.rewards.compose`): one
record per completion with ``turns``, ``calls`` (turns answered with an observation),
``valid_calls``, ``errors`` (counter -> failed calls), ``tools`` (tool -> calls that ran) and
``stop`` (why the episode ended). A single-turn completion (no records, or a None record) counts
as one turn without calls. They compose with the outcome rewards through the same weights and
gates, e.g. a bonus for calling a tool paid only on correct answers::

    {accuracy: 1.0, format: 0.2, tool_format: 0.2,
     tool_calls: {weight: 0.2, gate: accuracy}, turn_cost: 0.05}
"""

from __future__ import annotations

from collections.abc import Sequence

from ..registry import REWARDS
from .registry import RewardContext

_ONE_TURN = {"turns": 1, "calls": 0, "valid_calls": 0}


def _records(completions: Sequence[str], episodes: Sequence[dict | None] | None) -> list[dict]:
    if episodes is None:
        return [_ONE_TURN] * len(completions)
    if len(episodes) != len(completions):
        raise ValueError(f"got {len(episodes)} episode records for {len(completions)} completions")
    return [e or _ONE_TURN for e in episodes]


@REWARDS.register("tool_format")
def tool_format(completions: list[str], samples: list[dict], ctx: RewardContext) -> list[float]:
    """Share of the episode's tool calls that were well formed and ran (1 without calls): a
    malformed call, an unknown tool, bad arguments or a failing tool lower it."""
    return [
        e["valid_calls"] / e["calls"] if e["calls"] else 1.0
        for e in _records(completions, ctx.episodes)
    ]


@REWARDS.register("tool_calls")
def tool_calls(
    completions: list[str],
    samples: list[dict],
    ctx: RewardContext,
    cap: int = 1,
    valid_only: bool = True,
) -> list[float]:
    """Number of tool calls, capped at ``cap`` and divided by it (so in [0, 1]); only calls that
    ran count unless ``valid_only`` is False."""
    if cap < 1:
        raise ValueError(f"tool_calls: cap must be >= 1, got {cap}")
    key = "valid_calls" if valid_only else "calls"
    return [min(e[key], cap) / cap for e in _records(completions, ctx.episodes)]


@REWARDS.register("turn_cost")
def turn_cost(completions: list[str], samples: list[dict], ctx: RewardContext) -> list[float]:
    """Minus the turns after the first (0 for a one-turn answer): its weight is the cost of a
    turn."""
    return [-float(e["turns"] - 1) for e in _records(completions, ctx.episodes)]
