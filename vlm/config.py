"""The VLM side's recipe sections: ``model``, ``data``, ``rollout`` (with ``rollout.vllm``) and
``video``. One small dataclass per section, help beside each field (see ``trainer/config.py`` for
loading, overrides and validation; the top-level ``Config`` is composed in ``wiring.py``).

A section's ``check(root)`` holds the rules among its own keys that hold whichever side reads
the section: ranges, and the names the registries supply (rewards, step rewards, tools, the
episode environment, the generator's families; a ``module:function`` that does not import is a
`ConfigError` naming its key). The recipe loader runs them (``schema.check_sections``); the VLM
side's rules across sections, and those of its samplers and engines, are ``vlm/rules.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..trainer.config import ConfigError, at_least, choice

IMPLICIT = "implicit_prm"
"""``rollout.process_reward`` naming PRIME's implicit PRM (``vlm/process.py``)"""


def _generators() -> list[str]:
    from ..registry import GENERATORS

    return GENERATORS.names()


def _formats() -> tuple[str, ...]:
    from ..datasets.benchmarks import FORMATS

    return FORMATS


def _tiny_archs() -> list[str]:
    from .tiny import ARCHS

    return list(ARCHS)


@dataclass
class ModelConfig:
    path: str = ""
    """local directory of a Hugging Face model (or a VLA checkpoint); empty builds the tiny default"""
    tiny_arch: str = choice("qwen2_5_vl", _tiny_archs)
    """architecture of the tiny random-initialised default when `path` is empty (vlm/tiny.py)"""
    dtype: str = choice("float32", ("float32", "bfloat16", "float16"))
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

    def check(self, root) -> None:
        """LoRA adapters need layers to sit on (whether the names match the model's layers is
        known once the model loads)."""
        if self.lora_rank > 0 and not self.lora_target_modules:
            raise ConfigError(
                f"model.lora_target_modules is empty with model.lora_rank={self.lora_rank}: "
                "name at least one linear layer (e.g. [q_proj, v_proj]), or set model.lora_rank=0"
            )


@dataclass
class DataConfig:
    train: str = ""
    """training JSONL/Parquet (images relative to the file); empty generates the synthetic set"""
    val: str = ""
    """held-out JSONL/Parquet for periodic evaluation; empty uses the synthetic validation split"""
    families: list[str] = field(default_factory=list)
    """synthetic question families to generate, of data.generator's (empty: its default
    families, all of them unless the generator names a subset)"""
    n_train: int = at_least(2000, 0)
    """synthetic training questions"""
    n_val: int = at_least(200, 0)
    """synthetic validation questions"""
    image_size: int = 112
    """side of the synthetic images in pixels"""
    strict: bool = True
    """strict: a bad sample (malformed line, corrupt image) is an error; False skips and counts"""
    format: str = choice("auto", _formats)
    """layout of the data.train and data.val files. auto: a .tsv is VLMEvalKit's, a .parquet
    is told apart by its columns, else this project's; perceptrl: JSONL/JSON/Parquet samples;
    vlmevalkit: a VLMEvalKit TSV; mathvista, scienceqa, mmstar: Parquet exports of those Hugging
    Face benchmarks (docs/evaluation.md, "Benchmark files", lists the columns)"""
    seed: int = 0
    """seed of the synthetic generator"""
    generator: str = choice("clevr", _generators)
    """synthetic set when data.train is empty, a generator of datasets/registry.py (``perceptrl
    data generate --help`` describes each; zoom's small tiles need data.image_size: 448)"""
    video_seconds: float = 4.0
    """video generator: clip length in seconds"""
    video_fps: int = 4
    """video generator: frames per second written to the mp4"""

    def check(self, root) -> None:
        """The question families of the synthetic set, read from the generator's module (the
        generator's other options are its own to check when it writes the set); a named
        ``format`` needs a file to read."""
        if self.format != "auto" and not (self.train or self.val):
            raise ConfigError(
                f"data.format={self.format} names the layout of the data.train and data.val "
                "files, and neither is set; give data.val (or data.train), or data.format=auto"
            )
        if self.train or not self.families:
            return
        from ..registry import GENERATORS

        try:
            GENERATORS.get(self.generator).check_families(self.families)
        except ValueError as e:
            raise ConfigError(
                f"data.families with data.generator={self.generator}: {e}; name some of them, "
                "or leave data.families empty for the generator's default families"
            ) from None


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
class VLLMConfig:
    gpu_memory_utilization: float = 0.3
    """fraction of accelerator memory vLLM may take (weights + KV cache); training keeps the rest"""
    kv_cache_bytes: int = 0
    """explicit KV cache size in bytes (0: from gpu_memory_utilization); set it on the CPU"""
    max_model_len: int = 0
    """longest prompt + completion (0: rollout.max_prompt_length + rollout.max_new_tokens, or
    + rollout.episode.max_tokens for episodes)"""
    block_size: int = 0
    """KV cache block size in tokens (0: vLLM's, 16 on GPUs and 128 on the CPU); prefix caching
    reuses whole blocks only, so multi-turn episodes, which resend their history every turn,
    recompute less with smaller blocks"""
    enforce_eager: bool = False
    """no CUDA graphs / compilation: faster start, slower decoding"""
    sleep: bool = True
    """sleep between rollouts (weights offloaded, KV cache freed) so training gets the memory;
    GPU only (vLLM's CPU worker has no sleep mode)"""
    bucket_mb: int = 256
    """weight sync bucket size in MiB (parameters packed into flat buffers of this size)"""
    logprobs_mode: str = choice("processed_logprobs", ("processed_logprobs", "raw_logprobs"))
    """processed_logprobs (tempered/filtered, what the trainer scores) | raw_logprobs"""
    seed: int = 0
    """vLLM engine seed (each rollout also draws per-request seeds from the step's RNG)"""


@dataclass
class EpisodeConfig:
    env: str = "tools"
    """what answers a policy turn: tools (the tools below, built in) or an episode environment
    a side registers when imported (the plan side's: a robot executes the planner's subgoals,
    for recipes with side: plan)"""
    tools: list[str] = field(default_factory=list)
    """tools the policy may call in multi-turn episodes (registered names of vlm/tools.py, or
    package.module:function); empty: one completion per rollout. A sample may list the subset it
    allows (its "tools" key)"""
    max_turns: int = at_least(4, 1)
    """policy turns per episode (each turn is at most rollout.max_new_tokens)"""
    max_tokens: int = at_least(512, 1)
    """tokens after the prompt per episode, policy turns and observations together"""
    max_images: int = 4
    """images tools may return per episode"""
    max_vision_tokens: int = 1024
    """vision tokens of the observation images per episode"""
    tool_timeout_s: float = 5.0
    """time limit of one tool call; a slow call becomes an error observation and is counted"""
    observation_role: str = choice("user", ("user", "tool"))
    """chat role of observation turns: user | tool (for chat templates that render tool turns)"""
    min_pixels: int = 0
    """smallest observation image area after resizing (0: model.min_pixels)"""
    max_pixels: int = 0
    """largest observation image area after resizing (0: model.max_pixels)"""
    tool_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """per-tool options, e.g. {zoom: {size: 224}} (the longer side of a zoomed crop)"""
    stop: list[str] = field(default_factory=list)
    """strings that end a policy turn like the stop token (vLLM's stop strings), e.g. the
    planner's </subgoal> and <done/>: the turn keeps the string and the chat template's end of
    turn opens the observation; empty: turns end at the stop token only"""

    @property
    def enabled(self) -> bool:
        """Rollouts are multi-turn episodes: tools are enabled or another environment named."""
        return bool(self.tools) or self.env != "tools"

    def check(self, root) -> None:
        """The registered environment and tools; with episodes on, the budgets and stop
        strings."""
        from ..registry import EPISODE_ENVS, UnknownName
        from .tools import resolve_tools

        try:
            EPISODE_ENVS.entry(self.env)
        except UnknownName as e:
            raise ConfigError(str(e)) from None
        try:
            resolve_tools(self.tools)
        except ValueError as e:  # an unknown name, or a module:function that does not import
            raise ConfigError(f"rollout.episode.tools: {e}") from None
        if not self.enabled:
            return
        for name, low in (("max_turns", 1), ("max_tokens", 1), ("max_images", 0),
                          ("max_vision_tokens", 0)):  # fmt: skip
            if getattr(self, name) < low:
                raise ConfigError(
                    f"rollout.episode.{name}={getattr(self, name)} is out of range; set "
                    f"rollout.episode.{name} >= {low}"
                )
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise ConfigError(
                f"rollout.episode.stop={self.stop!r}: stop strings must be non-empty text; "
                "remove the empty ones"
            )


@dataclass
class TreeConfig:
    branches: list[int] = field(default_factory=list)
    """children per node at each depth (e.g. [2, 2, 2]: 8 leaves); the product must equal
    rollout.group_size; empty: flat groups (vlm/sampler.py; on the VLA side, GRPO groups
    that branch from saved simulator states, vla/collect.py)"""
    segment_tokens: int = 16
    """tokens of every segment but the last (the last runs to the stop token or max_new_tokens);
    with rollout.episode.tools a segment is a policy turn and its observation instead; on the
    VLA side, policy steps (the last segment runs to the episode's end)"""
    allocate: str = choice("uniform", ("uniform", "entropy"))
    """how a depth's forks are spread over the branches still running: uniform | entropy (more
    children where the policy's next-token entropy is highest)"""


@dataclass
class RolloutConfig:
    engine: str = choice("hf", ("hf", "vllm"))
    """rollout engine: hf (transformers, see rollout.sampler) | vllm (colocated vLLM, see
    rollout.vllm)"""
    sampler: str = choice("fork", ("fork", "generate"))
    """hf engine, single turn: fork (each prompt prefilled once, its KV cache forked to its G rows;
    trees) | generate (model.generate on G copies of each prompt)"""
    tree: TreeConfig = field(default_factory=TreeConfig)
    """tree rollouts (rollout.tree.branches non-empty turns them on; needs rollout.sampler=fork);
    episodes fork after a turn's observation"""
    prompts_per_step: int = at_least(8, 1)
    """prompts (groups) sampled per training step"""
    group_size: int = at_least(4, 1)
    """completions per prompt (G)"""
    guide: int = at_least(0, 0)
    """off-policy guidance (as LUFFY): this many of each group's G members are the generator's
    reference trace of the sample (`perceptrl sft`'s target; an episode's turns run for real)
    instead of samples; rewarded and given advantages within the group like the others, so a
    group whose samples all fail still learns from the trace when it succeeds. 0: none"""
    temperature: float = 1.0
    """sampling temperature"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    max_new_tokens: int = at_least(64, 1)
    """completion length limit"""
    max_prompt_length: int = at_least(512, 0)
    """prompt length limit in tokens, vision tokens included (never truncated: too long is an error)"""
    token_budget: int = at_least(16384, 0)
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
    process_reward: str = ""
    """process rewards next to the outcome reward (RolloutBatch.step_rewards, weighed by
    algo.process_coef; algo.adv_estimator=prime keeps the two apart): a registered step reward
    (rewards/process.py; e.g. step_values checks sub-results by rule, judge_steps has a judge
    model grade each step with the judge reward's parameters), implicit_prm (PRIME's implicit
    PRM, vlm/process.py), or module:function; empty: outcome only"""
    process_params: dict[str, Any] = field(default_factory=dict)
    """parameters of the process reward: a step reward's keywords (step_values: right, wrong),
    or implicit_prm's beta (0.05) and lr (1e-5)"""
    reward_timeout_s: float = 10.0
    """time limit of one reward call; a timeout scores 0 and is counted"""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM engine settings (rollout.engine=vllm)"""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """multi-turn episodes (rollout.episode.tools non-empty, or an env other than tools, turns
    them on)"""
    workers: int = at_least(1, 1)
    """rollout workers (Ray actors) when train.pipeline is one_step_off or async"""
    worker_cpus: float = 1.0
    """CPUs each rollout worker reserves (and its torch threads)"""
    worker_gpus: float = 0.0
    """GPUs each rollout worker reserves (fractions share one)"""
    worker_timeout_s: float = 600.0
    """a rollout chunk that takes longer kills its worker (Ray restarts it; counted)"""
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

    def check(self, root) -> None:
        """The rollout section's own rules: the reward and the process reward resolve through
        their registries with their parameters, guide rows fit a group, T-GRPO finds its
        correctness reward. Trees and engines are the VLM side's samplers' (``vlm/rules.py``;
        the VLA side grows trees of its own)."""
        from ..rewards import check_reward

        try:
            check_reward(self.reward)
        except ValueError as e:  # an unknown name, or a module:function that does not import
            raise ConfigError(f"rollout.reward: {e}") from None
        self._check_process_reward()
        if self.guide:
            where = f"rollout.guide={self.guide}"
            if not 0 < self.guide < self.group_size:
                raise ConfigError(
                    f"{where}: a group needs at least one sample; set 0 < rollout.guide < "
                    f"rollout.group_size ({self.group_size})"
                )
            if self.tree.branches:
                raise ConfigError(
                    f"{where} with rollout.tree.branches: a trace is no branch of a tree; set "
                    "rollout.guide=0 or rollout.tree.branches=[]"
                )
        if self.tgrpo_alpha > 0:
            try:
                tgrpo_correct_key(self.reward)
            except ValueError as e:
                raise ConfigError(f"rollout.tgrpo_alpha={self.tgrpo_alpha}: {e}") from None

    def _check_process_reward(self) -> None:
        name, params = self.process_reward, self.process_params
        if not name:
            return
        where = f"rollout.process_reward={name}"
        if name == IMPLICIT:
            if self.episode.enabled:
                raise ConfigError(
                    f"{where}: the implicit PRM of multi-turn episodes (rollout.episode) is not "
                    "supported yet; use a rule-based step reward (e.g. plan_turns on the plan "
                    "side)"
                )
            unknown = sorted(set(params) - {"beta", "lr"})
            if unknown:
                raise ConfigError(f"rollout.process_params {unknown}: implicit_prm takes beta, lr")
            return
        from ..registry import STEP_REWARDS
        from ..rewards.registry import check_call

        try:  # what it declares to prepare (a judge's worker) runs when the run is built
            check_call(STEP_REWARDS.resolve(name), params, "step reward")
        except ValueError as e:
            raise ConfigError(f"{where} with rollout.process_params={params}: {e}") from None


def tgrpo_correct_key(reward_weights: dict[str, float]) -> str:
    """The reward component that decides correctness for T-GRPO: ``accuracy`` when the recipe
    has it, else its one component other than ``format``."""
    if "accuracy" in reward_weights:
        return "accuracy"
    others = [k for k in reward_weights if k != "format"]
    if len(others) != 1:
        raise ValueError(
            f"T-GRPO needs one correctness reward in rollout.reward, got {list(reward_weights)}; "
            "add `accuracy` (it dispatches on each sample's reward) or keep one besides `format`"
        )
    return others[0]
