"""Reward functions (one registry), composition and failure handling.

>>> from perceptrl.rewards import build_reward
>>> reward = build_reward({"format": 0.5, "accuracy": 1.0})
>>> totals, components, stats = reward(completions, samples)

Registered: ``format``, ``mcq``, ``numeric``, ``iou``, ``accuracy`` (dispatches on
``sample["reward"]``). Add one with ``@register_reward("name")`` or name ``"module:function"``.
"""

from __future__ import annotations

from . import boxes, builtin, group, judge, measure, shaping, text  # noqa: F401  (registers them)
from .compose import CompositeReward, RewardTerm, RewardTimeout, build_reward, call_with_timeout
from .parse import extract_answer, extract_letter, is_formatted, parse_box, parse_number
from .registry import get_reward, list_rewards, register_reward

__all__ = [
    "CompositeReward",
    "RewardTerm",
    "RewardTimeout",
    "build_reward",
    "call_with_timeout",
    "extract_answer",
    "extract_letter",
    "get_reward",
    "is_formatted",
    "list_rewards",
    "parse_box",
    "parse_number",
    "register_reward",
]
