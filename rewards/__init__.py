"""Reward functions (one registry), composition and failure handling.

>>> from perceptrl.rewards import RewardContext, build_reward
>>> reward = build_reward({"format": 0.5, "accuracy": 1.0})
>>> ctx = RewardContext(lengths=lengths, group_ids=group_ids)  # what the rollout knows
>>> totals, components, stats = reward(completions, samples, ctx)

Every reward is ``fn(completions, samples, ctx, **params) -> list[float]``
(:mod:`~perceptrl.rewards.registry`), registered in ``perceptrl.registry.REWARDS`` with what it
needs declared beside it, or named ``"module:function"``. Registered (module): ``format``,
``mcq``, ``numeric``, ``iou``, ``accuracy`` (dispatches on ``sample["reward"]``) (builtin);
``mra``, ``tiou``, ``count`` (measure); ``giou``, ``det`` (boxes); ``math``, ``ocr``,
``rouge_l`` (text); ``overlong``, ``repetition`` (shaping); ``majority`` (group); ``judge``
(judge); ``tool_format``, ``tool_calls``, ``turn_cost`` (episode); ``plan_success``,
``plan_progress``, ``plan_validity``, ``subgoal_cost`` (plan). Step rewards
(``perceptrl.registry.STEP_REWARDS``, :mod:`~perceptrl.rewards.process`): ``step_values``,
``judge_steps``, ``plan_turns``. Weighted sums, gates, the per-call context (token lengths,
group ids, episode records, the time limit) and the declarations are described in
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
    plan_rewards,
    shaping,
    text,
)
from .compose import (
    CompositeReward,
    RewardTerm,
    RewardTimeout,
    build_reward,
    call_with_timeout,
    check_reward,
)
from .parse import (
    extract_answer,
    extract_boxed,
    extract_letter,
    is_boxed_formatted,
    is_formatted,
    parse_box,
    parse_number,
)
from .registry import RewardContext, RewardNeeds

__all__ = [
    "CompositeReward",
    "RewardContext",
    "RewardNeeds",
    "RewardTerm",
    "RewardTimeout",
    "build_reward",
    "call_with_timeout",
    "check_reward",
    "extract_answer",
    "extract_boxed",
    "extract_letter",
    "is_boxed_formatted",
    "is_formatted",
    "parse_box",
    "parse_number",
]
