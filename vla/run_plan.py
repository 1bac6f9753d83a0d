"""The VLA side's run plan: a checked recipe resolved once into typed, immutable settings.

`resolve` reads the recipe (``Config``, already checked when it loaded: `vla.config.check_vla`)
and derives what the VLA builder builds in a straight line (``vla/builder.py``): which policy
and head, from a saved directory or fresh, the collector (PPO segments when the estimator
declares ``per_step`` in ``ADVANTAGES``, else GRPO groups, flat or trees), evaluation, the
reference model and the rollout pipeline's workers. Nothing here builds anything or mutates the
recipe; a pipeline worker's share is a plan too (`VLARunPlan.worker`).

The planner's executor settings (``plan`` section) resolve here as well, as `ExecutorPlan`
(`resolve_executor`): `vla.plan_env.plan_settings` builds the executor from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from .config import OFFPOLICY_HEADS, EnvConfig, ReplayConfig, VLAConfig, per_step

WORKER_SEED = 7919
"""a pipeline worker ``i`` seeds its envs, collector and policy with ``train.seed + WORKER_SEED
* (i + 1)`` (its own initial states, never the trainer's)"""


@dataclass(frozen=True)
class TokenLoad:
    """How a token policy's VLM loads (the model section; `TokenVLA.from_pretrained`'s keyword
    arguments)."""

    dtype: str
    gradient_checkpointing: bool
    trust_remote_code: bool
    min_pixels: int | None
    max_pixels: int | None


@dataclass(frozen=True)
class PolicyPlan:
    """What `vla.builder.build_policy` builds: a saved policy (``path``) or a fresh one."""

    kind: str
    """vla.policy: compact (CNN/MLP + FiLM, `CompactVLA` and its heads) | token (`TokenVLA`)"""
    head: str
    """the compact action head a fresh policy gets (vla.head; a saved policy keeps its own)"""
    path: Path | None
    """model.path, user-expanded: the saved policy (compact) or VLM directory (token) to start
    from; None: a fresh policy (token: a tiny VLM built under the run directory)"""
    device: str
    """train.device as written (auto | cpu | cuda ...); resolved in the process that builds the
    policy, which is where its GPUs are known"""
    chunk: int
    """K actions per policy step (env.action_chunk)"""
    image_size: int
    """side of the camera images (env.image_size), for a fresh compact policy's convolutions"""
    entity_features: bool
    """the env gives each entity's kind and colour (env.entity_features), which only the
    entities encoder reads (a saved policy's encoder is checked against it when read)"""
    vla: VLAConfig
    """the recipe's vla section: a fresh compact policy's spec (copied into it, never changed)"""
    bins: int
    """token: action tokens per action dimension (vla.action_bins)"""
    tiny_arch: str
    """token, no path: the tiny VLM architecture built under the run directory"""
    seed: int
    """token, no path: the seed of the tiny VLM's weights"""
    load: TokenLoad
    """token: how the VLM loads"""


@dataclass(frozen=True)
class CollectPlan:
    """What `vla.builder.build_source` builds: the collector of training experience."""

    per_step: bool
    """PPO segments of ``env.steps_per_rollout`` steps (the estimator declares per_step) |
    GRPO groups of whole episodes"""
    env: EnvConfig
    """the env section: the envs, their steps per rollout and action chunks"""
    seed: int
    """the collector's RNG (initial states of the groups)"""
    groups: int
    """GRPO: groups (indexed initial states) per collection (rollout.prompts_per_step)"""
    group_size: int
    """GRPO: episodes per group (rollout.group_size)"""
    branches: tuple[int, ...]
    """GRPO: the tree's branching per depth (rollout.tree.branches; empty: flat groups)"""
    segment_steps: int
    """GRPO trees: policy steps per node (rollout.tree.segment_tokens)"""
    replay: ReplayConfig | None = None
    """off-policy heads (vla.head=sac | dsrl): the replay section; None: on-policy collection"""
    gamma: float = 0.99
    """off-policy: discount per policy step (algo.gamma)"""


@dataclass(frozen=True)
class BCPlan:
    """Behaviour cloning from a dataset on disk (the ``bc`` section): what
    `vla.bc_dataset.DatasetSource` reads; it draws ``env.num_envs`` windows of
    ``env.steps_per_rollout`` frames per batch, as the expert source steps its envs."""

    dataset: Path
    """bc.dataset, user-expanded: the LeRobot dataset folder"""
    features: tuple[tuple[str, str], ...]
    """bc.features: (input, dataset feature) pairs replacing the default names"""


@dataclass(frozen=True)
class PipelinePlan:
    """The rollout workers of ``train.pipeline = one_step_off | async`` (`PipelineSource`)."""

    mode: str
    workers: int
    cpus: float
    gpus: float
    max_staleness: int
    buffer_chunks: int
    worker_timeout_s: float
    timeout_s: float
    address: str
    imports: tuple[str, ...] = ()
    """the recipe's ``imports``, which each worker process imports first"""


@dataclass(frozen=True)
class VLARunPlan:
    """A VLA run, resolved from its recipe (`resolve`)."""

    seed: int
    """train.seed: the process's generators are seeded with it before anything is built"""
    env: EnvConfig
    """the env section (the envs, BC's targets, evaluation)"""
    policy: PolicyPlan
    collect: CollectPlan
    evaluate: bool
    """held-out evaluation during training (env.eval_episodes > 0)"""
    reference: bool
    """a frozen copy of the initial policy for the KL term (algo.kl_coef > 0)"""
    pipeline: PipelinePlan | None
    """rollouts on Ray workers (train.pipeline); None: in this process"""
    bc: BCPlan | None = None
    """`perceptrl sft`: clone the dataset it names; None: the scripted experts, live"""

    def worker(self, index: int) -> VLARunPlan:
        """The plan pipeline worker ``index`` runs: its share of the envs and GRPO groups
        (rounded up), its own seed, its device (a GPU when the workers have one)."""
        assert self.pipeline is not None, "only a pipelined run has workers"
        w, seed = self.pipeline.workers, self.seed + WORKER_SEED * (index + 1)
        env = dataclasses.replace(self.env, num_envs=-(-self.env.num_envs // w))
        device = "cuda" if self.pipeline.gpus else "cpu"
        collect = dataclasses.replace(
            self.collect, env=env, seed=seed, groups=-(-self.collect.groups // w)
        )
        policy = dataclasses.replace(self.policy, device=device, seed=seed)
        return dataclasses.replace(self, seed=seed, env=env, policy=policy, collect=collect)


def resolve(cfg) -> VLARunPlan:
    """The run plan of a checked VLA recipe (see the module docstring)."""
    env, vla, m, r, t = cfg.env, cfg.vla, cfg.model, cfg.rollout, cfg.train
    policy = PolicyPlan(
        kind=vla.policy, head=vla.head, path=Path(m.path).expanduser() if m.path else None,
        device=t.device, chunk=env.action_chunk, image_size=env.image_size,
        entity_features=env.entity_features, vla=vla, bins=vla.action_bins,
        tiny_arch=m.tiny_arch, seed=t.seed,
        load=TokenLoad(
            dtype=m.dtype, gradient_checkpointing=m.gradient_checkpointing,
            trust_remote_code=m.trust_remote_code, min_pixels=m.min_pixels or None,
            max_pixels=m.max_pixels or None,
        ),
    )  # fmt: skip
    collect = CollectPlan(
        per_step=per_step(cfg.algo.adv_estimator), env=env, seed=t.seed,
        groups=r.prompts_per_step, group_size=r.group_size, branches=tuple(r.tree.branches),
        segment_steps=r.tree.segment_tokens,
        replay=cfg.replay if vla.head in OFFPOLICY_HEADS else None, gamma=cfg.algo.gamma,
    )  # fmt: skip
    pipeline = None
    if t.pipeline != "sync":
        pipeline = PipelinePlan(
            t.pipeline, workers=r.workers, cpus=r.worker_cpus, gpus=r.worker_gpus,
            max_staleness=t.max_staleness, buffer_chunks=t.pipeline_buffer,
            worker_timeout_s=r.worker_timeout_s, timeout_s=t.pipeline_timeout_s,
            address=t.ray_address, imports=tuple(cfg.imports),
        )  # fmt: skip
    bc = None
    if cfg.bc.dataset:
        bc = BCPlan(Path(cfg.bc.dataset).expanduser(), tuple(cfg.bc.features.items()))
    return VLARunPlan(
        seed=t.seed, env=env, policy=policy, collect=collect, evaluate=env.eval_episodes > 0,
        reference=cfg.algo.kl_coef > 0, pipeline=pipeline, bc=bc,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the planner's executor (side plan, and the plan episode environment on any side)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExecutorPlan:
    """How a planner's subgoals are executed, resolved from the ``plan`` section;
    `vla.plan_env.plan_settings` loads the executor it names."""

    executor: str
    """an entry of ``EXECUTORS`` (plan.executor)"""
    policies: tuple[tuple[str, str], ...]
    """(subgoal family or ``all``, directory of a saved VLA) pairs, in the recipe's order
    (plan.policies)"""
    device: str
    """train.device as written; the policies load on it (resolved where they load)"""
    subgoal_steps: int
    """env steps per subgoal (0: the primitive task's time limit)"""
    home: bool | None
    """the arm returns home after each subgoal (plan.home: always True, never False, auto None:
    the executor's own ``from_home``)"""
    image_size: int
    obs_mode: str
    cameras: tuple[str, ...]
    memo: int


def resolve_executor(cfg) -> ExecutorPlan:
    """The `ExecutorPlan` of a checked recipe's ``plan`` section (and ``train.device``)."""
    p = cfg.plan
    return ExecutorPlan(
        executor=p.executor, policies=tuple(p.policies.items()), device=cfg.train.device,
        subgoal_steps=p.subgoal_steps, home={"always": True, "never": False}.get(p.home),
        image_size=p.image_size, obs_mode=p.obs_mode, cameras=tuple(p.cameras), memo=p.memo,
    )  # fmt: skip
