"""Episode terms: computed from the per-completion episode records, composed with the outcome
rewards through the same weights and gates; single-turn completions count as one turn."""

from __future__ import annotations

import pytest

from perceptrl.registry import REWARDS
from perceptrl.rewards import RewardContext, build_reward

EPISODES = [
    {"turns": 2, "calls": 1, "valid_calls": 1},
    {"turns": 3, "calls": 2, "valid_calls": 1},
    {"turns": 1, "calls": 0, "valid_calls": 0},
    None,  # a single-turn row
]
SAMPLES = [{"id": str(i), "answer": "B", "reward": "mcq"} for i in range(4)]
COMPLETIONS = ["<answer>B</answer>", "<answer>A</answer>", "<answer>B</answer>", "B"]


CTX = RewardContext(episodes=EPISODES)


def test_terms():
    assert REWARDS.get("tool_format")(COMPLETIONS, SAMPLES, CTX) == [1, 0.5, 1, 1]
    assert REWARDS.get("tool_calls")(COMPLETIONS, SAMPLES, CTX) == [1, 1, 0, 0]
    assert REWARDS.get("tool_calls")(COMPLETIONS, SAMPLES, CTX, cap=2) == [0.5, 0.5, 0, 0]
    assert REWARDS.get("turn_cost")(COMPLETIONS, SAMPLES, CTX) == [-1, -2, 0, 0]
    no_episodes = RewardContext()
    assert REWARDS.get("turn_cost")(COMPLETIONS, SAMPLES, no_episodes) == [0, 0, 0, 0]


def test_composed_with_weights_and_gates():
    reward = build_reward(
        {"accuracy": 1.0, "tool_calls": {"weight": 0.5, "gate": "accuracy"}, "turn_cost": 0.1}
    )
    totals, comps, stats = reward(COMPLETIONS, SAMPLES, CTX)
    assert comps["tool_calls"] == [1.0, 0.0, 0.0, 0.0]  # row 1 called a tool but answered wrong
    assert totals == pytest.approx([1.4, -0.2, 1.0, 1.0])
    assert stats["reward/tool_calls/gate_open"] == 0.75 and stats["reward/errors"] == 0
    _, comps, _ = reward(COMPLETIONS, SAMPLES)  # without episode records: one turn each
    assert comps["turn_cost"] == [0.0] * 4


def test_episode_records_must_match_the_completions():
    reward = build_reward({"turn_cost": 1.0})
    with pytest.raises(ValueError, match="episodes"):
        reward(COMPLETIONS, SAMPLES, RewardContext(episodes=EPISODES[:2]))
