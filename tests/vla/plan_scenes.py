"""What the planner's tests share: an episode sample naming an indexed scene, the oracle plan of
an episode, and a planner run small enough to build (imported by test_plan.py and
test_plan_executors.py)."""

from __future__ import annotations

from perceptrl.vla.plan_env import PlanEnv

TINY = [
    "data.n_train=8", "data.n_val=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
    "rollout.max_new_tokens=8", "rollout.episode.max_turns=2", "train.micro_batch_size=4",
    "train.eval_samples=2", "train.eval_every=1", "train.steps=1", "log.progress=false",
    "log.tensorboard=false", "data.image_size=64", "plan.image_size=64",
    "rollout.episode.max_pixels=4096", "model.max_pixels=4096", "checkpoint.every=0",
]  # fmt: skip
"""overrides that make the plan recipe a planner run small enough to build"""


def scene_sample(task="put_then_stack", tid=3, trial=0) -> dict:
    """An episode sample of ``task``'s indexed initial state (``tid``, ``trial``)."""
    return {
        "id": f"{task}-{tid}",
        "meta": {"scene": {"task": task, "task_id": tid, "trial_id": trial}},
    }


def oracle_plan_texts(env: PlanEnv, row: int) -> list[str]:
    """The oracle plan of episode ``row``'s task, as subgoal texts."""
    e = env.scene(row).unwrapped
    return [s.text(e.layout.colours) for s in e.task.subgoals]
