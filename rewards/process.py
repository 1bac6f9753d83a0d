"""Process rewards: scores of a completion's intermediate steps, each at the place the step ends.

A step reward has the inputs of a reward (``rewards/registry.py``) and returns steps::

    fn(completions, samples, ctx: RewardContext, **params) -> list[list[Step]]

for each completion, its scored steps in order, each ``Step(end, score)`` with ``end`` the
character offset just past the step in the completion text. The rollout source places each
score on the token that holds that character (``RolloutBatch.step_rewards`` [B, T]) and the
estimators weigh it against the outcome reward (``algo.process_coef``; ``prime`` keeps the two
apart). ``ctx.episodes`` holds the episode records when every completion is a multi-turn
episode (its policy turns joined), and ``ctx.timeout_s`` the per-call limit
(``rollout.reward_timeout_s``) for a step reward that can be slow (the judge's worker). Rewards
know nothing of models; the learned process reward (PRIME's implicit PRM) is a model of the VLM
side (``vlm/process.py``).

Register in ``perceptrl.registry.STEP_REWARDS`` (``@STEP_REWARDS.register("name")``, declaring
``prepare`` as a reward does); ``rollout.process_reward`` names one (or ``implicit_prm``, or
``module:function``).

Registered: ``step_values`` (rule-based: the sub-results a synthetic generator knows, e.g. the
per-colour counts of ``count_sum``), ``judge_steps`` (``rewards/judge.py``: a judge model grades
each reasoning step, batched, in the judge's supervised worker), ``plan_turns``
(``rewards/plan_rewards.py``: each planner turn scored from the simulator's record).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from ..registry import STEP_REWARDS
from .registry import RewardContext


class Step(NamedTuple):
    end: int
    """character offset just past the step in the completion"""
    score: float


_ANSWER = re.compile(r"<answer>", re.IGNORECASE)


@STEP_REWARDS.register("step_values")
def step_values(
    completions: list[str],
    samples: list[dict],
    ctx: RewardContext,
    right: float = 1.0,
    wrong: float = 0.0,
) -> list[list[Step]]:
    """Rule-based step checks against ``sample["meta"]["steps"]`` (label -> value the generator
    knows, e.g. ``{"red": 2, "blue": 1}``).

    A step is a claim ``<label>: <number>`` (``<label> objects: N`` and ``=`` also read) before
    the ``<answer>`` tag. Only a label's first claim counts, and labels the sample does not list
    are ignored, so repeating a right claim or inventing new ones earns nothing. A right claim
    scores ``right / k`` and a wrong one ``wrong / k`` (``k`` labels), so a completion's process
    reward is at most ``right``. Samples without ``steps`` get no step rewards.
    """
    out = []
    for text, sample in zip(completions, samples):
        expected = (sample.get("meta") or {}).get("steps") or {}
        head = _ANSWER.split(text, maxsplit=1)[0]
        steps = []
        for label, value in expected.items():
            pat = rf"\b{re.escape(str(label))}\b(?:\s+objects?)?\s*[:=]\s*(-?\d+)"
            m = re.search(pat, head, re.IGNORECASE)
            if m is None:
                continue
            ok = int(m.group(1)) == int(value)
            steps.append(Step(m.end(1), (right if ok else wrong) / len(expected)))
        out.append(sorted(steps))
    return out
