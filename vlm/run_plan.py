"""The VLM side's run plan: a checked recipe resolved once into typed, immutable settings.

`resolve` reads a `wiring.Config` that ``load_config`` has checked (every section's rules and
the side's, ``vlm/rules.py``) and derives, once, what building a run needs: the prompt and
sampling settings, the episode (or None), the tree (or None), the completion length, the reward
and the held-out reward, the process reward, the guide rows, the rollout engine, the data source
and the evaluation. ``vlm/builder.py`` builds the components from it in a straight line; no
builder reads the recipe again, and nothing here or there changes it (`resolve` works on a
copy).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..registry import EPISODE_ENVS, GENERATORS
from ..trainer.config import TrainConfig
from .config import ModelConfig, RolloutConfig, VLLMConfig
from .episode import EpisodeEnv, EpisodeSettings
from .prompts import PromptConfig
from .rollout import SamplingParams
from .schedule import TreeShape
from .tool_env import resolve_tools
from .tools import Tool

EVAL_REWARD = {"accuracy": 1.0}
"""Held-out accuracy: the correctness reward alone (no format bonus)."""


@dataclass(frozen=True)
class DataSource:
    """Where a run's samples come from: the user's files (``data.train``, ``data.val``) or the
    splits the synthetic ``data.generator`` writes."""

    train: str
    val: str
    strict: bool
    """a bad sample is an error (False: skipped and counted; user files only)"""
    format: str
    """the layout of the user's files (``data.format``: auto, perceptrl or a benchmark's)"""
    generator: str
    families: tuple[str, ...]
    n_train: int
    n_val: int
    seed: int
    options: Mapping[str, Any]
    """the generator's common options (``image_size``, ``seconds``, ``fps``)"""
    tools: Mapping[str, Tool]
    """the recipe's tools, which a sample's own ``tools`` list must stay within"""

    def for_evaluation(self) -> DataSource:
        """This source for an evaluation: the validation split alone (no training split is
        read or written)."""
        return dataclasses.replace(self, train="", n_train=0)


@dataclass(frozen=True)
class EpisodePlan:
    """``rollout.episode`` resolved, for recipes whose rollouts are multi-turn episodes."""

    env: str
    """the registered episode environment (``rollout.episode.env``)"""
    make_env: Callable[[], Callable[[], EpisodeEnv]]
    """builds the environment factory, once per policy (the environment's registered
    ``build``, bound to the recipe)"""
    max_turns: int
    max_tokens: int
    max_images: int
    max_vision_tokens: int
    observation_role: str
    min_pixels: int | None
    max_pixels: int | None
    tool_names: tuple[str, ...]
    stop: tuple[str, ...]

    def settings(self) -> EpisodeSettings:
        """The policy's `EpisodeSettings`, with the environment factory built now."""
        return EpisodeSettings(
            env=self.make_env(), max_turns=self.max_turns, max_tokens=self.max_tokens,
            max_images=self.max_images, max_vision_tokens=self.max_vision_tokens,
            observation_role=self.observation_role, min_pixels=self.min_pixels,
            max_pixels=self.max_pixels, tool_names=self.tool_names, stop=self.stop,
        )  # fmt: skip


@dataclass(frozen=True)
class EnginePlan:
    """The rollout engine: ``hf`` (the trained model samples itself) or a colocated ``vllm``."""

    name: str
    vllm: VLLMConfig
    dtype: str
    max_model_len: int
    """longest prompt + completion the vLLM engine holds"""
    mm_processor_kwargs: Mapping[str, int] | None
    """the image processor's pixel bounds for the vLLM engine (None: its own)"""


@dataclass(frozen=True)
class ProcessPlan:
    """``rollout.process_reward``: a step reward by name (or ``module:function``), or the
    implicit PRM."""

    name: str
    params: Mapping[str, Any]
    timeout_s: float
    micro_batch_size: int
    """the implicit PRM's rows per forward (``train.micro_batch_size``)"""


@dataclass(frozen=True)
class EvalPlan:
    """Greedy held-out scoring (``vlm.source.evaluate_accuracy``)."""

    samples: int
    """held-out questions per evaluation (``train.eval_samples``; 0: none)"""
    reward: Mapping[str, Any]
    """the held-out score: `EVAL_REWARD`, or the episode environment's own"""
    reward_timeout_s: float
    batch_size: int
    max_new_tokens: int
    token_budget: int
    strict: bool


@dataclass(frozen=True)
class VLMRunPlan:
    """Everything a VLM run is built from (see the module docstring)."""

    model: ModelConfig
    """the ``model`` section (weights, dtype, LoRA)"""
    device: str
    seed: int
    prompt: PromptConfig
    sampling: SamplingParams
    episode: EpisodePlan | None
    """None: one completion per rollout"""
    tree: TreeShape | None
    """None: flat groups"""
    fork: bool
    """the HF engine prefills a prompt once and forks its KV cache (``rollout.sampler=fork``)"""
    completion_length: int
    """most tokens after a prompt: one completion, or a whole episode"""
    engine: EnginePlan
    reward: Mapping[str, Any]
    """the training reward's spec (``rollout.reward``)"""
    reward_timeout_s: float
    process: ProcessPlan | None
    guide: int
    """guide rows per group (``rollout.guide``; 0: none)"""
    reference_trace: Callable[[dict], str | list[str]]
    """the generator's reference trace of a sample (a text, or an episode's turns): the SFT
    target and the guide rows"""
    data: DataSource
    rollout: RolloutConfig
    """what the rollout source reads (prompts per step, group size, guide rows, T-GRPO)"""
    evaluation: EvalPlan
    train: TrainConfig
    """the optimisation engine's settings"""
    kl_reference: bool
    """the loss or the reward reads a reference policy (``algo.kl_coef > 0``)"""


def resolve(cfg) -> VLMRunPlan:
    """The run plan of a checked recipe (``cfg``: a `wiring.Config` from ``load_config``)."""
    cfg = copy.deepcopy(cfg)  # the plan shares nothing with the caller's recipe
    r, m, e = cfg.rollout, cfg.model, cfg.rollout.episode
    tools = resolve_tools(e.tools)
    env = EPISODE_ENVS.entry(e.env)
    completion = e.max_tokens if e.enabled else r.max_new_tokens
    return VLMRunPlan(
        model=m, device=cfg.train.device, seed=cfg.train.seed,
        prompt=PromptConfig(
            system_prompt=r.system_prompt, max_prompt_length=r.max_prompt_length,
            min_pixels=m.min_pixels or None, max_pixels=m.max_pixels or None, video=cfg.video,
            tools={name: t.usage for name, t in tools.items()},
        ),
        sampling=SamplingParams(
            temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
            token_budget=r.token_budget, return_logprobs=cfg.algo.tis_cap > 0,
        ),
        episode=_episode(cfg, functools.partial(env.obj, cfg)) if e.enabled else None,
        tree=TreeShape(tuple(r.tree.branches), r.tree.segment_tokens, r.tree.allocate)
        if r.tree.branches else None,
        fork=r.sampler == "fork",
        completion_length=completion, engine=_engine(cfg, completion),
        reward=dict(r.reward), reward_timeout_s=r.reward_timeout_s,
        process=ProcessPlan(
            r.process_reward, dict(r.process_params), r.reward_timeout_s,
            cfg.train.micro_batch_size,
        ) if r.process_reward else None,
        guide=r.guide,
        reference_trace=functools.partial(
            GENERATORS.get(cfg.data.generator).reasoning_trace, tools=e.tools
        ),
        data=_data(cfg, tools),
        rollout=r,
        evaluation=EvalPlan(
            samples=cfg.train.eval_samples, reward=dict(env.meta["eval_reward"] or EVAL_REWARD),
            reward_timeout_s=r.reward_timeout_s,
            batch_size=max(r.prompts_per_step * r.group_size, 16),
            max_new_tokens=r.max_new_tokens, token_budget=r.token_budget, strict=cfg.data.strict,
        ),
        train=cfg.train, kl_reference=cfg.algo.kl_coef > 0,
    )  # fmt: skip


def _episode(cfg, make_env) -> EpisodePlan:
    e, m = cfg.rollout.episode, cfg.model
    return EpisodePlan(
        env=e.env, make_env=make_env, max_turns=e.max_turns, max_tokens=e.max_tokens,
        max_images=e.max_images, max_vision_tokens=e.max_vision_tokens,
        observation_role=e.observation_role, min_pixels=e.min_pixels or m.min_pixels or None,
        max_pixels=e.max_pixels or m.max_pixels or None, tool_names=tuple(e.tools),
        stop=tuple(e.stop),
    )  # fmt: skip


def _engine(cfg, completion: int) -> EnginePlan:
    r, m = cfg.rollout, cfg.model
    pixels = {"min_pixels": m.min_pixels, "max_pixels": m.max_pixels}
    return EnginePlan(
        name=r.engine, vllm=r.vllm, dtype=m.dtype,
        max_model_len=r.vllm.max_model_len or r.max_prompt_length + completion,
        mm_processor_kwargs={k: v for k, v in pixels.items() if v} or None,
    )  # fmt: skip


def _data(cfg, tools: Mapping[str, Tool]) -> DataSource:
    d = cfg.data
    return DataSource(
        train=d.train, val=d.val, strict=d.strict, format=d.format, generator=d.generator,
        families=tuple(d.families), n_train=d.n_train, n_val=d.n_val, seed=d.seed,
        options={"image_size": d.image_size, "seconds": d.video_seconds, "fps": d.video_fps},
        tools=tools,
    )  # fmt: skip
