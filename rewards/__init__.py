"""Reward functions (one registry), composition and failure handling.

>>> from perceptrl.rewards import build_reward
>>> reward = build_reward({"format": 0.5, "accuracy": 1.0})
>>> totals, components, stats = reward(completions, samples)

Registered (module): ``format``, ``mcq``, ``numeric``, ``iou``, ``accuracy`` (dispatches on
``sample["reward"]``) (builtin); ``mra``, ``tiou``, ``count`` (measure); ``giou``, ``det`` (boxes);
``math``, ``ocr``, ``rouge_l`` (text); ``overlong``, ``repetition`` (shaping); ``majority``
(group); ``judge`` (judge); ``tool_format``, ``tool_calls``, ``turn_cost`` (episode); ``plan_success``, ``plan_progress``,
``plan_validity``, ``subgoal_cost`` (plan; and the process reward ``plan_turns``). Add one
with ``@register_reward("name")`` or name ``"module:function"``. Weighted sums, gates and the
per-completion context (token lengths, group ids, episode records) are described in
:mod:`~perceptrl.rewards.compose`.
"""

from __future__ import annotations

from . import (  # noqa: F401  (registers them)
    boxes,
    builtin,
    episode,
    group,
    judge,
    measure,
    plan,
    shaping,
    text,
)
from .compose import CompositeReward, RewardTerm, RewardTimeout, build_reward, call_with_timeout
from .parse import (
    extract_answer,
    extract_boxed,
    extract_letter,
    is_boxed_formatted,
    is_formatted,
    parse_box,
    parse_number,
)
from .registry import get_reward, list_rewards, register_reward

__all__ = [
    "CompositeReward",
    "RewardTerm",
    "RewardTimeout",
    "build_reward",
    "call_with_timeout",
    "extract_answer",
    "extract_boxed",
    "extract_letter",
    "get_reward",
    "is_boxed_formatted",
    "is_formatted",
    "list_rewards",
    "parse_box",
    "parse_number",
    "register_reward",
]
