"""The VLA side's recipe sections: ``env`` (the vector env it trains and evaluates on) and ``vla``
(the policy). One small dataclass per section, help beside each field; the names with a fixed
set of values are defined here once and read by the policy code (see ``trainer/config.py`` for
loading and validation; the top-level ``Config`` is composed in ``wiring.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..registry import VLA_HEADS
from ..trainer.config import choice

OBS_MODES = ("rgb", "state")
CONTROLS = ("ee", "joint")
REWARD_MODES = ("sparse", "dense")
POLICIES = ("compact", "token")
BACKENDS = ("mujoco", "warp")
IMAGE_ENCODERS = ("cnn", "keypoint")
ENCODERS = (*IMAGE_ENCODERS, "state", "entities")
INSTRUCTION_ENCODERS = ("bag", "gru")
CRITICS = ("shared", "state")
AUX = ("none", "subject")
FLOW_NOISE = ("sde", "learned")
FLOW_LOGP = ("step", "chain")


@dataclass
class EnvConfig:
    id: str = "perceptrl/Reach-v0"
    """gymnasium id of the task the VLA side trains on (perceptrl/<Task>-v0)"""
    num_envs: int = 8
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
    max_episode_steps: int = 0
    """env steps per episode (0 keeps the task's registered time limit)"""
    steps_per_rollout: int = 64
    """PPO: policy steps collected per env per training step"""
    action_chunk: int = 1
    """K: env steps executed open-loop per policy step (the policy outputs K actions)"""
    eval_episodes: int = 50
    """evaluation episodes per task (deterministic actions, fixed seeds)"""
    eval_seed: int = 1_000_000
    """seed of the first evaluation episode (episode i uses eval_seed + i; held out from training)"""
    eval_tasks: list[str] = field(default_factory=list)
    """gymnasium ids evaluated (empty: env.id)"""
    eval_videos: int = 1
    """episodes per task written to mp4 by `perceptrl eval` (0: none)"""


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
    hidden: int = 256
    """width of the fused trunk (and of the state MLP)"""
    embed_dim: int = 64
    """instruction word-embedding size"""
    instruction_encoder: str = choice("bag", INSTRUCTION_ENCODERS)
    """bag (mean of word embeddings) | gru (a one-layer GRU over the words)"""
    max_words: int = 16
    """instruction length in words (longer ones are cut)"""
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


EXECUTORS = ("oracle", "policy")


@dataclass
class PlanConfig:
    """Reason-then-act (``side: plan``): how the planner's subgoals are executed."""

    executor: str = choice("oracle", EXECUTORS)
    """what executes a subgoal: oracle (the scripted experts: an upper bound) | policy (frozen
    VLA policies from plan.policies)"""
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
    eval_videos: int = 2
    """held-out episodes per planner that ``perceptrl eval`` with several planners writes as mp4
    (the executor's view with the current subgoal drawn on it)"""
