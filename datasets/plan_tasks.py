"""Planner samples: indexed initial states of the long-horizon MuJoCo tasks, shown as an image.

Sample ``i`` of a split is the initial state ``(task_id, trial_id) = (SPLIT_BASE[split] + i,
seed)`` of task ``families[i % len(families)]`` (the composites of ``sim/composite.py``), so the
splits never share a scene (colours follow ``task_id``, positions ``(task_id, trial_id)``). Its
image is the agent view of that state (PNG), its question the task's long instruction, and
``meta`` holds the ``scene`` the planner's episode environment restores (``vla/plan_env.py``) and the
oracle ``plan`` (one primitive instruction per subgoal, in order, in the words the instruction
uses for it). `reasoning_trace` turns the
oracle plan into planner turns for the SFT warm start: one ``<subgoal>`` per turn, then
``<done/>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..sim.tasks import get_task
from .synthetic import write_split

FAMILIES: tuple[str, ...] = ("put_two", "put_then_stack", "push_then_put", "put_three")
"""the registered composite tasks (``sim.composite.COMPOSITES``)"""
SPLIT_BASE = {"train": 0, "val": 100_000, "test": 200_000}
"""first ``task_id`` of each split"""


def generate(
    out_dir: str | Path,
    splits: dict[str, int] | None = None,
    families: Sequence[str] = FAMILIES,
    seed: int = 0,
    image_size: int = 128,
) -> dict[str, Path]:
    """Write ``<out_dir>/<split>.jsonl`` and ``<out_dir>/images/<split>/<id>.png``. Returns
    split -> JSONL path."""
    import gymnasium as gym

    from ..sim import env_id  # importing the package registers the tasks

    splits = {"train": 200, "val": 50, "test": 50} if splits is None else splits
    envs = {
        f: gym.make(env_id(f), render_mode="rgb_array", obs_mode="state", width=image_size,
                    height=image_size).unwrapped
        for f in families
    }  # fmt: skip

    def samples(split: str, n: int):
        for i in range(n):
            family = families[i % len(families)]
            env, tid = envs[family], SPLIT_BASE[split] + i
            env.reset(options={"task_id": tid, "trial_id": seed})
            plan = [phrase(sub, env.layout) for sub in env.task.subgoals]
            sample = {
                "id": f"{split}-{i:05d}", "family": family, "question": env.layout.instruction,
                "answer": " then ".join(plan), "reward": "plan_success",
                "meta": {"scene": {"task": family, "task_id": tid, "trial_id": seed},
                         "plan": plan},
            }  # fmt: skip
            yield sample, env.render()

    try:
        return {
            split: write_split(Path(out_dir), split, samples(split, n))
            for split, n in splits.items()
        }
    finally:
        for env in envs.values():
            env.close()


def phrase(sub, lay) -> str:
    """Subgoal ``sub`` in the words the layout's instruction uses for it (the paraphrase it
    drew), else the first template: a planner that copies the instruction's clause names a
    subgoal the executor accepts."""
    for k in range(len(get_task(sub.family).templates)):
        said = sub.text(lay.colours, k)
        if said in lay.instruction:
            return said
    return sub.text(lay.colours)


def reasoning_trace(sample: dict, tools: Sequence[str] = ()) -> list[str]:
    """The oracle plan as planner turns: ``<subgoal> ...</subgoal>`` per subgoal, then
    ``<done/>``. The blank after the tag makes the clause's tokens those of the instruction (a
    BPE tokenizer encodes a word after ``>`` differently from the same word after a blank), so
    the target is a copy token for token; the parser ignores the blank."""
    return [f"<subgoal> {step}</subgoal>" for step in sample["meta"]["plan"]] + ["<done/>"]
