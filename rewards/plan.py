"""Planner terms: rewards of a reason-then-act episode from the simulator's privileged state.

They read the record a planner episode carries (``episodes[i]["info"]``, written by the
episode environment of ``vla/plan.py``): ``planner/success`` and ``planner/progress`` (the
task's subgoals that hold, in order, at the end), ``planner/subgoals`` (turns that proposed
one), ``planner/valid``. A completion without that record (not a planner episode) scores 0 on
each. Compose them like any terms, e.g.::

    {plan_success: 1.0, plan_progress: 0.5, plan_validity: 0.2, subgoal_cost: 0.02}
"""

from __future__ import annotations

from collections.abc import Sequence

from .registry import register_reward


def _info(completions: Sequence[str], episodes: Sequence[dict | None] | None) -> list[dict]:
    if episodes is None:
        return [{}] * len(completions)
    if len(episodes) != len(completions):
        raise ValueError(f"got {len(episodes)} episode records for {len(completions)} completions")
    return [(e or {}).get("info", {}) for e in episodes]


@register_reward("plan_success")
def plan_success(
    completions: list[str], samples: list[dict], episodes: list[dict] | None = None
) -> list[float]:
    """1 when every subgoal of the long-horizon task holds at the end of the episode."""
    return [float(i.get("planner/success", 0.0)) for i in _info(completions, episodes)]


@register_reward("plan_progress")
def plan_progress(
    completions: list[str], samples: list[dict], episodes: list[dict] | None = None
) -> list[float]:
    """Share of the task's subgoals that hold in order at the end (a prefix: a later subgoal
    done before an earlier one does not count yet)."""
    return [float(i.get("planner/progress", 0.0)) for i in _info(completions, episodes)]


@register_reward("plan_validity")
def plan_validity(
    completions: list[str], samples: list[dict], episodes: list[dict] | None = None
) -> list[float]:
    """Share of proposed subgoals that parsed, named entities of the scene and could be done
    at the time (0 for an episode that proposed none)."""
    out = []
    for i in _info(completions, episodes):
        n = i.get("planner/subgoals", 0.0)
        out.append(float(i.get("planner/valid", 0.0)) / n if n else 0.0)
    return out


@register_reward("subgoal_cost")
def subgoal_cost(
    completions: list[str], samples: list[dict], episodes: list[dict] | None = None
) -> list[float]:
    """Minus the subgoals proposed: its weight is the cost of one."""
    return [-float(i.get("planner/subgoals", 0.0)) for i in _info(completions, episodes)]
