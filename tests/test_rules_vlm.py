"""The VLM side's and the trainer's rules run when a recipe loads: every shipped recipe loads,
every invalid combination below is refused by ``load_config`` with a `ConfigError` naming its
key (so ``perceptrl config`` refuses exactly what ``perceptrl train`` would), and the run plan
is resolved from a recipe without changing it. Loading only: nothing is built or run."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from perceptrl.cli import main
from perceptrl.trainer.config import ConfigError
from perceptrl.vlm.run_plan import resolve
from perceptrl.wiring import CONFIGS, load_config

RECIPES = sorted(CONFIGS.glob("*.yaml"))
TREE = ["rollout.tree.branches=[2,2]", "rollout.group_size=4"]
ZOOM = ["rollout.episode.tools=[zoom]"]
VLLM = ["rollout.engine=vllm"]

INVALID: dict[str, tuple[str, list[str]]] = {
    # rule: (the key the error names, overrides of configs/vlm_clevr.yaml)
    # --- the model, data and rollout sections (vlm/config.py)
    "lora without target modules": (
        "model.lora_target_modules",
        ["model.lora_rank=4", "model.lora_target_modules=[]"],
    ),
    "unknown question family": ("data.families", ["data.families=[count_al]"]),
    "unknown episode environment": ("rollout.episode.env", ["rollout.episode.env=toolz"]),
    "unknown tool": ("rollout.episode.tools", ["rollout.episode.tools=[zom]"]),
    "tool module that does not import": (
        "rollout.episode.tools",
        ["rollout.episode.tools=[no_such_module_xyz:tool]"],
    ),
    "two tools of one name": (
        "rollout.episode.tools",
        ["rollout.episode.tools=[zoom, perceptrl.vlm.tools:zoom]"],
    ),
    "no episode turns": ("rollout.episode.max_turns", [*ZOOM, "rollout.episode.max_turns=0"]),
    "no episode tokens": ("rollout.episode.max_tokens", [*ZOOM, "rollout.episode.max_tokens=0"]),
    "negative episode images": (
        "rollout.episode.max_images",
        [*ZOOM, "rollout.episode.max_images=-1"],
    ),
    "negative episode vision tokens": (
        "rollout.episode.max_vision_tokens",
        [*ZOOM, "rollout.episode.max_vision_tokens=-1"],
    ),
    "empty stop string": ("rollout.episode.stop", [*ZOOM, 'rollout.episode.stop=[""]']),
    "unknown reward": ("rollout.reward", ["rollout.reward={acuracy: 1.0}"]),
    "reward module that does not import": (
        "rollout.reward",
        ['rollout.reward={"no_such_module_xyz:score": 1.0}'],
    ),
    "reward parameter it does not take": (
        "rollout.reward",
        ["rollout.reward={format: {weight: 1.0, bogus: 2}}"],
    ),
    "reward gate on no term": (
        "rollout.reward",
        ["rollout.reward={accuracy: 1, format: {weight: 1, gate: nothing}}"],
    ),
    "unknown step reward": ("rollout.process_reward", ["rollout.process_reward=step_valuez"]),
    "step reward parameter it does not take": (
        "rollout.process_params",
        ["rollout.process_reward=step_values", "rollout.process_params={nope: 1}"],
    ),
    "implicit PRM of episodes": (
        "rollout.process_reward",
        [*ZOOM, "rollout.process_reward=implicit_prm"],
    ),
    "implicit PRM parameter": (
        "rollout.process_params",
        ["rollout.process_reward=implicit_prm", "rollout.process_params={gamma: 1}"],
    ),
    "guide rows fill the group": ("rollout.guide", ["rollout.guide=4", "rollout.group_size=4"]),
    "guide rows of a tree": ("rollout.guide", [*TREE, "rollout.guide=1"]),
    "T-GRPO without a correctness reward": (
        "rollout.tgrpo_alpha",
        ["rollout.tgrpo_alpha=0.5", "rollout.reward={format: 1, iou: 1, numeric: 1}"],
    ),
    # --- the VLM side's rules across sections (vlm/rules.py)
    "tree on model.generate": (
        "rollout.sampler",
        ["rollout.group_size=4", "rollout.tree.branches=[4]", "rollout.sampler=generate"],
    ),
    "entropy tree on vLLM": (
        "rollout.tree.allocate",
        [*VLLM, *TREE, "rollout.tree.allocate=entropy"],
    ),
    "episode tree deeper than its turns": (
        "rollout.episode.max_turns",
        [
            *ZOOM,
            "rollout.tree.branches=[2,2,2]",
            "rollout.group_size=8",
            "rollout.episode.max_turns=2",
        ],
    ),
    "tree branch of no children": (
        "rollout.tree.branches",
        ["rollout.tree.branches=[0,2]"],
    ),
    "deep tree of empty segments": ("segment_tokens", [*TREE, "rollout.tree.segment_tokens=0"]),
    "tree leaves and group size": ("rollout.group_size", [*TREE, "rollout.group_size=8"]),
    "tree segments past the completion": (
        "rollout.max_new_tokens",
        [*TREE, "rollout.max_new_tokens=16"],
    ),
    "guide rows with TIS": ("algo.tis_cap", ["rollout.guide=1", "algo.tis_cap=2.0"]),
    "guide rows in a pipeline": ("train.pipeline", ["rollout.guide=1", "train.pipeline=async"]),
    "process reward in a pipeline": (
        "train.pipeline",
        ["rollout.process_reward=step_values", "train.pipeline=one_step_off"],
    ),
    "vLLM with LoRA": ("model.lora_rank", [*VLLM, "model.lora_rank=8"]),
    "vLLM with ZeRO-3": (
        "train.zero_stage",
        [*VLLM, "train.backend=deepspeed", "train.zero_stage=3"],
    ),
    "vLLM workers without GPUs": (
        "rollout.worker_gpus",
        [*VLLM, "train.pipeline=async", "rollout.workers=2"],
    ),
    "best weights without held-out data": (
        "checkpoint.best",
        ["checkpoint.best=accuracy", "data.n_val=0"],
    ),
    "best weights without evaluation": (
        "checkpoint.best",
        ["checkpoint.best=accuracy", "train.eval_samples=0"],
    ),
    "best weights of user data without data.val": (
        "checkpoint.best",
        ["checkpoint.best=accuracy", "data.train=train.jsonl"],
    ),
    "estimator that needs a critic": ("algo.adv_estimator", ["algo.adv_estimator=gae"]),
    # --- the trainer's sections (trainer/config.py)
    "dual clip at or below 1": ("algo.dual_clip_c", ["algo.dual_clip_c=0.5"]),
    "correction floor above its cap": (
        "algo.correction_low",
        ["algo.tis_cap=2.0", "algo.correction_low=3.0"],
    ),
    "correction floor below 0": (
        "algo.correction_low",
        ["algo.tis_cap=2.0", "algo.correction_low=-0.5"],
    ),
    "two-sided floor above its cap": (
        "algo.correction_low",
        ["algo.tis_cap=0.4", "algo.rollout_correction=icepop"],
    ),
}

CLI_SAMPLE = [
    "unknown reward",
    "tree leaves and group size",
    "vLLM with LoRA",
    "best weights without evaluation",
    "dual clip at or below 1",
]
"""rules checked through ``perceptrl config`` as well (exit status 2, as ``train`` would)"""

PLAN_SIDE = {
    # the VLM side's rules hold on the plan side too (configs/plan_grpo.yaml)
    "implicit PRM of episodes": ("rollout.process_reward", ["rollout.process_reward=implicit_prm"]),
    "estimator that needs a critic": ("algo.adv_estimator", ["algo.adv_estimator=gae"]),
    "guide rows with TIS": ("algo.tis_cap", ["rollout.guide=1", "algo.tis_cap=2.0"]),
    "unknown reward": ("rollout.reward", ["rollout.reward={plan_succes: 1.0}"]),
}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_loads(recipe):
    cfg = load_config(recipe)
    if cfg.side in ("vlm", "plan"):
        assert resolve(cfg).rollout == cfg.rollout


@pytest.mark.parametrize("rule", list(INVALID))
def test_invalid_combination_is_refused_when_the_recipe_loads(rule):
    key, overrides = INVALID[rule]
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(CONFIGS / "vlm_clevr.yaml", overrides)


def test_each_rule_is_refused_on_its_own():
    """Every override list above is refused only with its own conflict: without its last
    override, the recipe loads (so each case tests the rule it names, not another one)."""
    for _, overrides in INVALID.values():
        load_config(CONFIGS / "vlm_clevr.yaml", overrides[:-1])


@pytest.mark.parametrize("rule", CLI_SAMPLE)
def test_perceptrl_config_refuses_what_train_would(rule, capsys):
    key, overrides = INVALID[rule]
    assert main(["config", str(CONFIGS / "vlm_clevr.yaml"), *overrides]) == 2
    assert key in capsys.readouterr().err


@pytest.mark.parametrize("rule", list(PLAN_SIDE))
def test_the_vlm_rules_hold_on_the_plan_side(rule):
    key, overrides = PLAN_SIDE[rule]
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(CONFIGS / "plan_grpo.yaml", overrides)


def test_a_vla_recipe_is_not_held_to_the_vlm_samplers_rules():
    """The VLM side's tree rules are its samplers': a VLA recipe whose tree segments outgrow
    rollout.max_new_tokens (which the VLA side does not read) still loads."""
    load_config(
        CONFIGS / "vla_grpo.yaml",
        ["rollout.tree.branches=[2,2,2]", "rollout.group_size=8", "rollout.max_new_tokens=8"],
    )


def test_the_run_plan_is_resolved_once_and_shares_nothing_with_the_recipe():
    cfg = load_config(CONFIGS / "vlm_zoom.yaml", ["algo.tis_cap=2.0"])
    before = dataclasses.asdict(cfg)
    plan = resolve(cfg)
    assert dataclasses.asdict(cfg) == before  # resolving changes nothing
    assert plan.sampling.return_logprobs and plan.episode is not None and plan.tree is None
    assert plan.completion_length == cfg.rollout.episode.max_tokens
    assert set(plan.prompt.tools) == {"zoom"} and set(plan.data.tools) == {"zoom"}
    assert plan.engine.max_model_len == cfg.rollout.max_prompt_length + plan.completion_length
    cfg.rollout.max_new_tokens, cfg.data.n_train = 1, 1
    assert plan.sampling.max_new_tokens != 1 and plan.data.n_train != 1  # nor is it changed by it
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.guide = 3


def test_an_evaluation_leaves_the_recipe_alone(tmp_path: Path):
    """``perceptrl eval`` writes only the validation split of a synthetic set (no training
    split), from the plan's data source (the recipe's ``data.n_train`` is not touched)."""
    from perceptrl.vlm.builder import eval_data

    cfg = load_config(CONFIGS / "vlm_clevr.yaml", ["data.n_val=2"])
    before = dataclasses.asdict(cfg)
    data = eval_data(resolve(cfg), tmp_path)
    assert (len(data.train), len(data.val)) == (0, 2) and dataclasses.asdict(cfg) == before


def test_episode_trees_load_on_either_engine():
    """Trees of episodes run on vLLM as on HF (one sampler driver): no longer refused."""
    for engine in ("hf", "vllm"):
        load_config(None, [f"rollout.engine={engine}", *TREE, *ZOOM])
