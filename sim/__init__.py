"""MuJoCo tabletop manipulation with language instructions, as gymnasium envs.

Importing ``perceptrl.sim`` registers one gymnasium id per task, ``perceptrl/<Task>-v0`` (e.g.
``perceptrl/Pick-v0``, ``perceptrl/PickClutter-v0``), with the task's time limit; every ``ManipEnv`` option (``obs_mode``,
``width``, ``control``, ...) is a keyword of ``gymnasium.make``.
"""

from __future__ import annotations

import gymnasium as gym

from ..registry import TASKS
from . import composite  # noqa: F401  (registers the long-horizon tasks)
from .env import ManipEnv, ManipEnvConfig
from .tasks import Task, get_task

ENV_IDS: dict[str, str] = {}
"""task name -> registered gymnasium id"""


def env_id(task: str) -> str:
    """The gymnasium id of a task name (``"pick_clutter"`` -> ``"perceptrl/PickClutter-v0"``)."""
    return "perceptrl/" + "".join(p.capitalize() for p in task.split("_")) + "-v0"


def task_of(gid: str) -> Task:
    """The registered task behind gymnasium id ``gid`` (the inverse of `env_id`)."""
    return get_task(next(name for name, g in ENV_IDS.items() if g == gid))


def register_envs() -> None:
    """Register a gymnasium id for every task in ``TASKS`` (idempotent)."""
    for name in TASKS:
        task, gid = TASKS.get(name), env_id(name)
        if gid not in gym.registry:
            gym.register(
                gid,
                entry_point="perceptrl.sim.env:ManipEnv",
                max_episode_steps=task.max_episode_steps,
                kwargs={"task": name},
            )
        ENV_IDS[name] = gid


register_envs()

__all__ = [
    "ENV_IDS",
    "task_of",
    "ManipEnvConfig",
    "ManipEnv",
    "Task",
    "TASKS",
    "env_id",
    "get_task",
    "register_envs",
]
