"""Planner terms: rewards of a reason-then-act episode from the simulator's privileged state.

They read the record a planner episode carries (``ctx.episodes[i]["info"]``, written by the
episode environment of ``vla/plan_env.py``): ``planner/success`` and ``planner/progress`` (the
task's subgoals that hold, in order, at the end), ``planner/subgoals`` (turns that proposed
one), ``planner/valid``. A completion without that record (not a planner episode) scores 0 on
each. Compose them like any terms, e.g.::

    {plan_success: 1.0, plan_progress: 0.5, plan_validity: 0.2, subgoal_cost: 0.02}

``plan_turns`` is a process (step) reward (``rollout.process_reward=plan_turns``): each answered
turn scored where it ends, from the record's per-turn entries (``planner/turn_progress``,
``planner/turn_invalid``, ``planner/turn_match``), so a turn is credited with what it did rather
than with the episode.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..registry import REWARDS, STEP_REWARDS
from .process import Step
from .registry import RewardContext


def _info(completions: Sequence[str], episodes: Sequence[dict | None] | None) -> list[dict]:
    if episodes is None:
        return [{}] * len(completions)
    return [(e or {}).get("info", {}) for e in _episodes(completions, episodes)]


@REWARDS.register("plan_success")
def plan_success(completions: list[str], samples: list[dict], ctx: RewardContext) -> list[float]:
    """1 when every subgoal of the long-horizon task holds at the end of the episode."""
    return [float(i.get("planner/success", 0.0)) for i in _info(completions, ctx.episodes)]


@REWARDS.register("plan_progress")
def plan_progress(completions: list[str], samples: list[dict], ctx: RewardContext) -> list[float]:
    """Share of the task's subgoals that hold in order at the end (a prefix: a later subgoal
    done before an earlier one does not count yet)."""
    return [float(i.get("planner/progress", 0.0)) for i in _info(completions, ctx.episodes)]


@REWARDS.register("plan_validity")
def plan_validity(completions: list[str], samples: list[dict], ctx: RewardContext) -> list[float]:
    """Share of proposed subgoals that parsed, named entities of the scene and could be done
    at the time (0 for an episode that proposed none)."""
    out = []
    for i in _info(completions, ctx.episodes):
        n = i.get("planner/subgoals", 0.0)
        out.append(float(i.get("planner/valid", 0.0)) / n if n else 0.0)
    return out


@REWARDS.register("subgoal_cost")
def subgoal_cost(completions: list[str], samples: list[dict], ctx: RewardContext) -> list[float]:
    """Minus the subgoals proposed: its weight is the cost of one."""
    return [-float(i.get("planner/subgoals", 0.0)) for i in _info(completions, ctx.episodes)]


@STEP_REWARDS.register("plan_turns")
def plan_turns(
    completions: list[str], samples: list[dict], ctx: RewardContext,
    progress: float = 1.0, invalid: float = -0.2, early_done: float = 0.0, match: float = 0.0,
) -> list[list[Step]]:  # fmt: skip
    """Each answered planner turn scored at its end: ``progress`` times the progress it made
    (the share of the task's subgoals its subgoal added, in order; negative when it undid one)
    plus ``invalid`` when it named nothing executable plus ``match`` when it named the task's
    next subgoal (the simulator's ground truth: right plan, whether or not the executor then
    managed it); and ``early_done`` on the turn that said ``<done/>`` while the task was not
    complete. ``completions`` are the episodes' policy turns joined (``ctx.episodes[i]["texts"]``),
    so turn k ends at the length of its first k texts. A turn cut by a budget gets no step;
    episodes without the per-turn record get none."""
    episodes = ctx.episodes
    if episodes is None:
        return [[] for _ in completions]
    out = []
    for e, text in zip(_episodes(completions, episodes), completions):
        e = e or {}
        info, texts = e.get("info", {}), e.get("texts", [])
        gains, bad = info.get("planner/turn_progress", ()), info.get("planner/turn_invalid", ())
        hits = info.get("planner/turn_match") or (0.0,) * len(gains)
        ends = [sum(len(t) for t in texts[: k + 1]) for k in range(len(gains))]
        steps = [Step(min(end, len(text)), progress * g + invalid * b + match * h)
                 for end, g, b, h in zip(ends, gains, bad, hits)]  # fmt: skip
        if early_done and e.get("stop") == "answer" and not info.get("planner/success", 0.0):
            steps.append(Step(len(text), early_done))
        out.append(steps)
    return out


def _episodes(completions: Sequence[str], episodes: Sequence[dict | None]) -> Sequence:
    if len(episodes) != len(completions):
        raise ValueError(f"got {len(episodes)} episode records for {len(completions)} completions")
    return episodes
