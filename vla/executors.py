"""Executors of a planner's subgoals (`vla.plan_env.PlanEnv` runs them in the simulator),
registered in `registry.EXECUTORS` (``plan.executor``).

``oracle``: the scripted expert of the focused subgoal (privileged state), the upper bound.
``policy``: frozen VLA policies saved by the VLA recipes, one per primitive family or one that
reads the subgoal's words for all (``plan.policies.all``). An executor has ``can(family)`` and
``start(env) -> act``, ``act(obs) -> actions [K, A]`` for the subgoal the env (a
`sim.focus.SubgoalFocus`) is focused on;
`PolicyExecutor.start_many` acts for several envs with one policy forward per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from ..registry import EXECUTORS
from ..sim.composite import POSE_SIZE, view_objects
from ..sim.expert import EXPERTS, ScriptedExpert
from ..sim.tasks import get_task, task_counts
from ..sim.vector import Batch
from .config import ALL, policies_problem


class OracleExecutor:
    """The scripted expert of the focused subgoal (privileged state): the upper bound."""

    name = "oracle"
    from_home = False
    """its subgoals start where the last one ended (the scripted experts start anywhere)"""

    def can(self, family: str) -> bool:
        return family in EXPERTS

    def start(self, env) -> Callable[[dict], np.ndarray]:
        """The actor of one subgoal: observation -> actions [K, A]."""
        expert = ScriptedExpert(env)
        return lambda obs: expert.act()[None]


class PolicyExecutor:
    """Frozen VLA policies acting deterministically on the focused env's observation: one per
    primitive family, whose state-mode entity poses are cut to the primitive's own scene
    (`sim.composite.view_objects`), or one instruction-reading policy for every family
    (``vla.encoder=entities``, ``plan.policies.all``: it reads the whole scene with each entity's
    kind and colour, and the subgoal's words)."""

    name = "policy"
    from_home = True
    """each subgoal starts with the arm back at the home pose, where every episode the policies
    were cloned from started (after rising clear, the arm returns there)"""

    def __init__(self, policies: dict):
        self.policies = policies
        for p in policies.values():
            p.eval()
        self.entity_features = bool(policies) and all(reads_entities(p) for p in policies.values())
        """the policies find their entities by the instruction (the envs must give each
        entity's kind and colour: ``ManipEnv(entity_features=True)``)"""

    def can(self, family: str) -> bool:
        return family in self.policies or ALL in self.policies

    def start(self, env) -> Callable[[dict], np.ndarray]:
        """The actor of the focused subgoal, or with no focus (the executor alone on the task's
        long instruction) of the instruction-reading policy."""
        act = self.start_many([env])
        return lambda obs: act([0], [obs])[0]

    def start_many(self, envs: list) -> Callable[[list[int], list[dict]], list[np.ndarray]]:
        """The actor of the subgoals ``envs`` are focused on, all at once: ``act(live, obs)``
        takes the observations of the envs ``live`` (indices into ``envs``) and returns their
        actions [K, A], from one policy forward per policy and scene size."""
        plans = [self._plan(env) for env in envs]
        kinds = [(id(policy), str(cut)) for policy, cut, *_ in plans]  # who may share a forward

        def act(live: list[int], obs: list[dict]) -> list[np.ndarray]:
            out: list[np.ndarray | None] = [None] * len(live)
            groups: dict[tuple, list[int]] = {}
            for j, i in enumerate(live):
                objects = obs[j].get("objects")
                size = None if objects is None else np.shape(objects)
                groups.setdefault((*kinds[i], size), []).append(j)
            for members in groups.values():
                policy, cut, to_env, cameras, dim = plans[live[members[0]]]
                rows = [obs[j] for j in members]
                images = {k: np.stack([o[k] for o in rows]) for k in cameras if k in rows[0]}
                objects = None
                if rows[0].get("objects") is not None:
                    objects = np.stack([o["objects"] if cut is None else view_objects(o["objects"], *cut)
                                        for o in rows])  # fmt: skip
                batch = Batch(images, np.stack([o["proprio"] for o in rows]), objects,
                              [o["instruction"] for o in rows])  # fmt: skip
                action, _, _ = policy.act(policy.observe(batch), deterministic=True)
                if to_env is not None:
                    action = to_env(action)
                action = action.float().cpu().numpy().reshape(len(rows), -1, dim)
                for k, j in enumerate(members):
                    out[j] = action[k]
            return out

        return act

    def _plan(self, env) -> tuple:
        """(policy, entity cut or None, its action mapping or None, cameras, action size) of the
        subgoal ``env`` is focused on."""
        if env.focused is None:
            if ALL not in self.policies:
                raise ValueError(
                    "the executor alone on a long instruction needs one policy that reads it "
                    "(plan.policies.all=<dir> of a vla.encoder=entities policy)"
                )
            policy = self.policies[ALL]
        else:
            policy = self.policies.get(env.focused.family) or self.policies[ALL]
        cut = None
        if not reads_entities(policy):
            cut = task_counts(env.unwrapped.task), task_counts(get_task(env.focused.family))
        to_env = getattr(policy, "env_action", None)
        cameras = tuple(env.unwrapped.cfg.cameras)
        return policy, cut, to_env, cameras, env.action_space.shape[0]


def reads_entities(policy) -> bool:
    """The policy finds its entities by the instruction (``vla.encoder=entities``)."""
    return getattr(getattr(getattr(policy, "spec", None), "vla", None), "encoder", "") == "entities"


def load_executor(kind: str, policies: Mapping[str, str], device: str = "cpu"):
    """The executor registered as ``kind`` in `EXECUTORS`: ``oracle``, or ``policy`` with saved
    VLA directories per family (or ``all``: one instruction-reading policy)."""
    why = policies_problem(kind, dict(policies))  # the recipe loader asks the same
    if why is not None:
        raise ValueError(why)
    return EXECUTORS.get(kind)(dict(policies), device)


def _oracle(policies: dict[str, str], device: str) -> OracleExecutor:
    return OracleExecutor()


def _policies(policies: dict[str, str], device: str) -> PolicyExecutor:
    """Frozen VLAs read from ``policies`` (family -> directory), checked against the tasks
    they execute: what they hold is known only once they are read."""
    from .builder import load_policy

    loaded = {}
    for family, path in policies.items():
        loaded[family] = policy = load_policy(Path(path), device)
        if family == ALL or reads_entities(policy):
            if not reads_entities(policy):
                raise ValueError(
                    f"plan.policies.{ALL}={path} does not read its instruction to find the "
                    "entities (train it with vla.encoder=entities: configs/plan_exec_reader.yaml)"
                )
            continue
        got = getattr(getattr(policy, "spec", None), "objects_dim", 0)
        want = POSE_SIZE * sum(task_counts(get_task(family)).values())
        if got and got != want:
            raise ValueError(
                f"plan.policies.{family}={path} reads {got // POSE_SIZE} entity poses, but the "
                f"{family} task's scene has {want // POSE_SIZE}: it was trained on another task. "
                f"Clone each family's executor on its own env (configs/plan_exec_bc.yaml "
                f"env.id=perceptrl/{family.capitalize()}-v0)"
            )
    if len({reads_entities(p) for p in loaded.values()}) > 1:
        raise ValueError(
            "plan.policies mixes instruction-reading policies (vla.encoder=entities) with "
            "per-family ones; their envs observe differently: use one kind"
        )
    return PolicyExecutor(loaded)


EXECUTORS.register("oracle", _oracle)
EXECUTORS.register("policy", _policies, policies=True)
