"""Run configuration: one small dataclass per component, help beside each field.

A recipe is a YAML file whose top-level keys are the component names below; dotted overrides on
the command line (``algo.kl_coef=0.01``) are applied on top. Unknown keys and wrong types fail
with a message that names the nearest valid key or the expected type.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import textwrap
import types
import typing
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass
class AlgoConfig:
    adv_estimator: str = "grpo"
    """advantage estimator: grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae | grpo_passk"""
    norm_by_std: bool = True
    """grpo: divide by the group std (False gives Dr.GRPO)"""
    gamma: float = 1.0
    """discount factor (gae, reinforce_pp)"""
    lam: float = 1.0
    """GAE lambda"""
    policy_loss: str = "ppo_clip"
    """policy loss: ppo_clip | gspo | cispo"""
    clip_low: float = 0.2
    """PPO lower clip range: ratio >= 1 - clip_low"""
    clip_high: float = 0.2
    """PPO upper clip range: ratio <= 1 + clip_high (DAPO clip-higher uses 0.28)"""
    dual_clip_c: float = 0.0
    """dual-clip constant c > 1 bounding the loss for negative advantages; 0 disables it"""
    gspo_clip_low: float = 3e-4
    """GSPO lower clip on the sequence-level ratio"""
    gspo_clip_high: float = 4e-4
    """GSPO upper clip on the sequence-level ratio"""
    cispo_clip_high: float = 5.0
    """CISPO: the stop-gradient importance weight is capped at 1 + cispo_clip_high"""
    cispo_clip_low: float = 0.0
    """CISPO: the importance weight is floored at 1 - cispo_clip_low (0 disables the floor)"""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean (means over rows with a valid token) |
    seq-mean-token-sum-norm (summed row token sums / loss_norm_len, no division by rows), as
    verl; the policy, KL, entropy and value losses all use it"""
    loss_norm_len: int = 0
    """constant divisor for seq-mean-token-sum-norm (Dr.GRPO); 0 uses the batch's T"""
    kl_coef: float = 0.0
    """weight of the KL(policy || reference) term in the loss; 0 skips the reference model"""
    kl_estimator: str = "k3"
    """KL estimator: k1 | k2 | k3 (low variance) | abs | k1+ | k3+ (value of k1/k3, gradient
    of k2: straight-through); verl's kl / mse / low_var_kl are k1 / k2 / k3"""
    kl_in_reward: bool = False
    """fold the KL penalty into the per-token reward instead of the loss"""
    entropy_coef: float = 0.0
    """entropy bonus weight (subtracted from the loss)"""
    value_coef: float = 0.5
    """weight of the value loss (critic policies only)"""
    value_clip: float = 0.2
    """clip range of the value update around values_old; 0 disables clipping"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (no learning signal) and collect more"""
    max_collects: int = 3
    """dynamic sampling: collections per step at most while refilling the batch with signal"""
    tis_cap: float = 0.0
    """truncated importance sampling cap for rollout/trainer log-prob mismatch; 0 disables"""
    passk_k: int = 0
    """grpo_passk: k of pass@k (0 uses half the group size; k must be below the group size to learn)"""
    whiten_advantages: bool = False
    """normalise advantages to zero mean / unit std over the batch's valid tokens (PPO's norm_adv)"""
    eps: float = 1e-6
    """grpo: added to the group std before dividing (verl's epsilon); whitening adds a fixed
    1e-8 to the variance instead (as verl)"""


@dataclass
class ModelConfig:
    path: str = ""
    """local directory of a Hugging Face model (or a VLA checkpoint); empty builds the tiny default"""
    tiny_arch: str = "qwen2_5_vl"
    """architecture of the tiny random-initialised default when `path` is empty: qwen2_5_vl | qwen3_vl"""
    dtype: str = "float32"
    """parameter dtype: float32 | bfloat16 | float16"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    share_prefix: bool = True
    """training forward: each distinct prompt runs once and its G completions attend to its
    keys/values (same log-probs and gradients, fewer tokens; Qwen2/2.5-VL, falls back to one
    forward per row for videos, activation checkpointing, ZeRO-3 and other model families)"""
    trust_remote_code: bool = False
    """allow the model directory to run its own Python code (off unless you trust it)"""
    min_pixels: int = 0
    """processor min_pixels per image (0 keeps the processor's setting)"""
    max_pixels: int = 0
    """processor max_pixels per image (0 keeps the processor's setting)"""
    lora_rank: int = 0
    """LoRA rank of peft adapters on the language model (0: full fine-tuning); the reference
    policy is then the same model with its adapters disabled (no second copy)"""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_rank)"""
    lora_dropout: float = 0.0
    """dropout on the LoRA input (keep 0 for RL: logp_old and logp must match)"""
    lora_target_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    """names of the language model's linear layers that get adapters"""
    lora_vision: bool = False
    """also put adapters on the vision tower (its attention qkv/proj and MLP projections)"""


@dataclass
class DataConfig:
    train: str = ""
    """training JSONL/Parquet (images relative to the file); empty generates the synthetic set"""
    val: str = ""
    """held-out JSONL/Parquet for periodic evaluation; empty uses the synthetic validation split"""
    families: list[str] = field(default_factory=lambda: ["count_all", "count_color", "count_shape"])
    """synthetic question families to generate"""
    n_train: int = 2000
    """synthetic training questions"""
    n_val: int = 200
    """synthetic validation questions"""
    image_size: int = 112
    """side of the synthetic images in pixels"""
    strict: bool = True
    """strict: a bad sample (malformed line, corrupt image) is an error; False skips and counts"""
    seed: int = 0
    """seed of the synthetic generator"""
    generator: str = "clevr"
    """synthetic set when data.train is empty: clevr (images) | video (moving shapes, mp4) |
    spatial (MuJoCo rooms, several views per question)"""
    video_seconds: float = 4.0
    """video generator: clip length in seconds"""
    video_fps: int = 4
    """video generator: frames per second written to the mp4"""


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = 0.3
    """fraction of accelerator memory vLLM may take (weights + KV cache); training keeps the rest"""
    kv_cache_bytes: int = 0
    """explicit KV cache size in bytes (0: from gpu_memory_utilization); set it on the CPU"""
    max_model_len: int = 0
    """longest prompt + completion (0: rollout.max_prompt_length + rollout.max_new_tokens)"""
    enforce_eager: bool = False
    """no CUDA graphs / compilation: faster start, slower decoding"""
    sleep: bool = True
    """sleep between rollouts (weights offloaded, KV cache freed) so training gets the memory;
    GPU only (vLLM's CPU worker has no sleep mode)"""
    bucket_mb: int = 256
    """weight sync bucket size in MiB (parameters packed into flat buffers of this size)"""
    logprobs_mode: str = "processed_logprobs"
    """processed_logprobs (tempered/filtered, what the trainer scores) | raw_logprobs"""
    seed: int = 0
    """vLLM engine seed (each rollout also draws per-request seeds from the step's RNG)"""


@dataclass
class RolloutConfig:
    engine: str = "hf"
    """rollout engine: hf (transformers generate) | vllm (colocated vLLM, see rollout.vllm)"""
    prompts_per_step: int = 8
    """prompts (groups) sampled per training step"""
    group_size: int = 4
    """completions per prompt (G)"""
    temperature: float = 1.0
    """sampling temperature"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    max_new_tokens: int = 64
    """completion length limit"""
    max_prompt_length: int = 512
    """prompt length limit in tokens, vision tokens included (never truncated: too long is an error)"""
    token_budget: int = 16384
    """prompt + completion tokens per generation call (sets the generation micro-batch)"""
    system_prompt: str = (
        "First think about the question step by step inside <think> </think>, "
        "then give the final answer inside <answer> </answer>."
    )
    """system prompt of the chat template"""
    reward: dict[str, float | dict[str, Any]] = field(
        default_factory=lambda: {"format": 0.2, "accuracy": 1.0}
    )
    """reward components (registered names or module:function): name -> weight, or name ->
    {weight, gate, parameters}, e.g. {accuracy: 1, overlong: {max_len: 256, cache_len: 64}}"""
    reward_timeout_s: float = 10.0
    """time limit of one reward call; a timeout scores 0 and is counted"""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM engine settings (rollout.engine=vllm)"""
    tgrpo_alpha: float = 0.0
    """T-GRPO (Video-R1): bonus added to correct rollouts of a video prompt whose group is at least
    tgrpo_mu times as accurate on ordered frames as on shuffled ones; 0 turns T-GRPO off"""
    tgrpo_mu: float = 1.0
    """T-GRPO: the bonus needs accuracy(ordered) >= tgrpo_mu * accuracy(shuffled)"""
    tgrpo_shuffled: int = 0
    """T-GRPO: extra rollouts per video prompt on shuffled frames (generated, never trained on);
    0 uses group_size"""
    tgrpo_threshold: float = 0.5
    """T-GRPO: a rollout is correct when its accuracy reward is at least this"""


@dataclass
class VideoConfig:
    fps: float = 2.0
    """frames sampled per second of video (qwen-vl-utils' FPS)"""
    min_frames: int = 4
    """fewest frames sampled from one video (rounded up to frame_factor)"""
    max_frames: int = 16
    """most frames sampled from one video (rounded down to frame_factor)"""
    frame_factor: int = 2
    """the frame count is a multiple of this (the vision tower's temporal patch)"""
    min_pixels: int = 0
    """smallest frame area after resizing (0: one merged patch)"""
    max_pixels: int = 768 * 28 * 28
    """largest area of one frame after resizing"""
    total_pixels: int = 24576 * 28 * 28
    """pixel budget of one video: frames shrink so (frames / frame_factor) * area stays within it"""


@dataclass
class TrainConfig:
    steps: int = 100
    """training steps (one rollout batch and its update each)"""
    lr: float = 1e-5
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 0
    """linear learning-rate warm-up steps"""
    grad_clip: float = 1.0
    """max global gradient norm (0 disables clipping)"""
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    minibatch_size: int = 0
    """samples per optimizer step (0: the whole rollout batch is one minibatch)"""
    micro_batch_size: int = 8
    """samples per forward/backward (gradient accumulation inside a minibatch)"""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N (auto picks cuda when available)"""
    seed: int = 0
    """seed of everything (torch, numpy, python, data order)"""
    time_limit_min: float = 0.0
    """stop after this many minutes of training (evaluation and checkpoint still run); 0: no limit"""
    max_bad_steps: int = 3
    """stop after this many consecutive steps with a non-finite loss or gradient"""
    eval_every: int = 0
    """evaluate on held-out data every N steps (0: only before and after training)"""
    eval_samples: int = 200
    """held-out questions per evaluation"""
    backend: str = "torch"
    """optimisation engine: torch (one process) | deepspeed (ZeRO, data parallel under torchrun
    or the deepspeed launcher; bf16 on GPU, fp32 on CPU)"""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage when backend=deepspeed: 2 (optimizer state + gradients partitioned)
    | 3 (parameters too; rollouts gather the full weights)"""


@dataclass
class LogConfig:
    dir: str = "runs"
    """parent directory of run directories"""
    name: str = ""
    """run name (default: recipe name + timestamp)"""
    tensorboard: bool = True
    """write TensorBoard event files beside metrics.jsonl"""
    progress: bool = True
    """show a progress bar with ETA"""


@dataclass
class CheckpointConfig:
    every: int = 0
    """write a checkpoint every N steps (0: only at the end)"""
    keep_last: int = 2
    """checkpoints kept on disk (older ones are deleted)"""


@dataclass
class EnvConfig:
    id: str = "perceptrl/Reach-v0"
    """gymnasium id of the task the VLA side trains on (perceptrl/<Task>-v0)"""
    num_envs: int = 8
    """envs stepped in parallel by the collector (rows of a PPO batch, groups fill them for GRPO)"""
    async_envs: bool = False
    """one subprocess per env (AsyncVectorEnv) instead of stepping them in a loop"""
    obs_mode: str = "rgb"
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
    control: str = "ee"
    """action space: ee (dx, dy, dz, dyaw, gripper) | joint (q1..q7, gripper)"""
    reward_mode: str = "sparse"
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
    policy: str = "compact"
    """VLA policy: compact (CNN/MLP + FiLM, Gaussian and value heads) | token (VLM action tokens)"""
    encoder: str = "cnn"
    """compact policy observation encoder: cnn (camera images) | keypoint (CNN + spatial softmax) | state (entity poses, MLP)"""
    channels: list[int] = field(default_factory=lambda: [32, 64, 64])
    """CNN channels of the three conv layers (8x8/4, 4x4/2, 3x3/1), each FiLM-conditioned"""
    hidden: int = 256
    """width of the fused trunk (and of the state MLP)"""
    embed_dim: int = 64
    """instruction word-embedding size"""
    instruction_encoder: str = "bag"
    """bag (mean of word embeddings) | gru (a one-layer GRU over the words)"""
    max_words: int = 16
    """instruction length in words (longer ones are cut)"""
    init_log_std: float = -0.5
    """initial log standard deviation of the Gaussian action head (state-independent)"""
    critic: str = "shared"
    """value function of the compact policy: shared (a head on the actor's trunk) | state (an
    asymmetric critic: a separate MLP on the true entity poses + proprio, needs
    env.privileged_state=true with an image encoder)"""
    aux: str = "none"
    """auxiliary loss of the compact policy: none | subject (regress the position of the entity
    the instruction names, relative to the gripper, from the actor's features; needs
    env.privileged_state=true)"""
    aux_coef: float = 1.0
    """weight of the auxiliary loss in the trainer's loss"""


@dataclass
class Config:
    side: str = "vlm"
    """which policy side the recipe trains: vlm | vla"""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    vla: VLAConfig = field(default_factory=VLAConfig)


# ---------------------------------------------------------------------------------------------
# Loading, overrides, validation
# ---------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A recipe or override that does not fit the dataclasses above."""


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Build a `Config` from a YAML recipe and ``key.sub=value`` overrides (applied in order).

    Override values are parsed as YAML scalars/lists/maps (``algo.kl_coef=0.01``,
    ``data.families=[count_all]``, ``rollout.reward={format: 0.5}``).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: a recipe must be a YAML mapping, got {type(loaded).__name__}"
            )
        raw = loaded
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        _set_dotted(raw, key.strip(), yaml.safe_load(value) if value.strip() else "")
    return from_dict(Config, raw, where="")


def from_dict(cls: type, raw: dict[str, Any], where: str) -> Any:
    """Instantiate dataclass ``cls`` from ``raw``, recursing into nested dataclasses."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{where}.{key}" if where else str(key)
        if key not in names:
            raise ConfigError(_unknown_key_message(dotted, where, names))
        kind = hints[key]
        if is_dataclass(kind):
            kwargs[key] = from_dict(kind, value or {}, dotted)
        else:
            kwargs[key] = _check_type(value, kind, dotted)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    return asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config (every field, defaults included) as YAML."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of ``cls`` (``algo.kl_coef`` ...)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        dotted = f"{prefix}{f.name}"
        if is_dataclass(hints[f.name]):
            out += all_keys(hints[f.name], dotted + ".")
        else:
            out.append(dotted)
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Help text of each field: the string literal right below it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, help) for every leaf field, for ``perceptrl config``."""
    rows = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    default = cls()
    for f in fields(cls):
        kind = hints[f.name]
        if is_dataclass(kind):
            rows += describe(kind, f"{prefix}{f.name}.")
        else:
            rows.append(
                (
                    f"{prefix}{f.name}",
                    _type_name(kind),
                    getattr(default, f.name),
                    docs.get(f.name, ""),
                )
            )
    return rows


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {p!r} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _unknown_key_message(dotted: str, where: str, names: list[str]) -> str:
    candidates = all_keys() + [f.name for f in fields(Config)]
    near = difflib.get_close_matches(dotted, candidates, n=1, cutoff=0.5)
    if not near:
        near = difflib.get_close_matches(dotted.rsplit(".", 1)[-1], names, n=1, cutoff=0.4)
        near = [f"{where}.{near[0]}" if where else near[0]] if near else []
    hint = f"; did you mean {near[0]!r}?" if near else ""
    section = f" in section {where!r}" if where else ""
    return f"unknown config key {dotted!r}{section}{hint} (valid here: {', '.join(names)})"


def _type_name(kind: Any) -> str:
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


def _check_type(value: Any, kind: Any, dotted: str) -> Any:
    """Validate (and gently coerce int -> float) ``value`` against the annotation ``kind``."""
    origin = typing.get_origin(kind)
    args = typing.get_args(kind)
    bad = ConfigError(
        f"{dotted}: expected {_type_name(kind)}, got {type(value).__name__} {value!r}"
    )
    if kind is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _check_type(value, arg, dotted)
            except ConfigError:
                continue
        raise bad
    if kind is type(None):
        if value is None:
            return None
        raise bad
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `2e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. `model.path=123` written without quotes
        raise bad
    if origin is list:
        if not isinstance(value, list):
            raise bad
        return [_check_type(v, args[0], f"{dotted}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return {
            _check_type(k, args[0], f"{dotted} key"): _check_type(v, args[1], f"{dotted}.{k}")
            for k, v in value.items()
        }
    raise ConfigError(f"{dotted}: unsupported annotation {kind!r}")
