"""The VLA and plan sides' rules run when a recipe loads: every shipped recipe of those sides
loads, and each rule refuses its invalid combination with a `ConfigError` that names the keys,
in `wiring.load_config` and in ``perceptrl config`` alike (exit status 2). Loading only: nothing
is built.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest  # noqa: E402

from perceptrl.cli import EXIT_CONFIG_ERROR, main  # noqa: E402
from perceptrl.trainer.config import ConfigError  # noqa: E402
from perceptrl.vla.run_plan import resolve, resolve_executor  # noqa: E402
from perceptrl.wiring import load_config  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHIPPED = sorted(p.stem for p in CONFIGS.glob("*.yaml") if p.stem.startswith(("vla_", "plan_")))

INVALID: dict[str, tuple[str, list[str], tuple[str, ...]]] = {
    # rule: (recipe, overrides, keys its message names)
    "env.id is a registered task": ("vla_grpo", ["env.id=perceptrl/Pik-v0"], ("env.id",)),
    "env.eval_tasks are registered tasks": (
        "vla_grpo", ["env.eval_tasks=[perceptrl/Pick-v0,perceptrl/Nope-v0]"],
        ("env.eval_tasks[1]",),
    ),
    "at least one env": ("vla_ppo_reach_state", ["env.num_envs=0"], ("env.num_envs",)),
    "warp has no entity features": (
        "vla_ppo_reach_warp", ["env.entity_features=true"], ("env.entity_features", "env.backend"),
    ),
    "warp has no subgoal focus": (
        "vla_ppo_reach_warp", ["env.subgoal_focus=true"], ("env.subgoal_focus", "env.backend"),
    ),
    "a token policy needs two bins": (
        "vla_grpo_token", ["vla.action_bins=1"], ("vla.action_bins", "vla.policy"),
    ),
    "a registered head": ("vla_grpo", ["vla.head=diffusion"], ("vla.head",)),
    "a registered executor": ("plan_grpo", ["plan.executor=magic"], ("plan.executor",)),
    "a policy executor needs policies": (
        "plan_grpo", ["plan.executor=policy"], ("plan.executor", "plan.policies"),
    ),
    "executor policies per subgoal family": (
        "plan_grpo", ["plan.executor=policy", "plan.policies.pick=runs/x"], ("plan.policies.pick",),
    ),
    "a token policy has no critic": (
        "vla_grpo_token", ["algo.adv_estimator=gae"], ("vla.policy", "algo.adv_estimator"),
    ),
    "a token policy reads images": (
        "vla_grpo_token", ["env.obs_mode=state"], ("vla.policy", "env.obs_mode"),
    ),
    "the entities encoder and the entity features come together": (
        "plan_exec_reader", ["env.entity_features=false"], ("vla.encoder", "env.entity_features"),
    ),
    "an image encoder reads images": (
        "vla_ppo_reach", ["env.obs_mode=state", "env.privileged_state=false"],
        ("vla.encoder", "env.obs_mode"),
    ),
    "a pose encoder reads poses": ("vla_grpo", ["env.obs_mode=rgb"], ("vla.encoder", "env.obs_mode")),
    "a state critic reads poses": (
        "vla_ppo_reach", ["env.privileged_state=false"], ("vla.critic", "env.privileged_state"),
    ),
    "an auxiliary loss reads poses": (
        "vla_ppo_reach", ["env.privileged_state=false", "vla.critic=shared"],
        ("vla.aux", "env.privileged_state"),
    ),
    "a flow head takes steps": ("vla_grpo_flow", ["vla.flow_steps=0"], ("vla.flow_steps", "vla.head")),
    "learned flow noise is a range": (
        "vla_grpo_flow", ["vla.flow_noise=learned", "vla.flow_noise_std=[0.2,0.1]"],
        ("vla.flow_noise_std", "vla.flow_noise"),
    ),
    "SDE flow noise is positive": (
        "vla_grpo_flow", ["vla.flow_noise_level=0"], ("vla.flow_noise_level", "vla.flow_noise"),
    ),
    "every pipeline worker has envs": (
        "vla_grpo", ["train.pipeline=async", "rollout.workers=16"],
        ("rollout.workers", "env.num_envs"),
    ),
    "GRPO groups are not empty": (
        "vla_grpo", ["rollout.group_size=0"], ("rollout.group_size",),
    ),
    "a tree's leaves are the group": (
        "vla_grpo", ["rollout.tree.branches=[2,3]"], ("rollout.tree.branches", "rollout.group_size"),
    ),
    "a tree's segments are steps": (
        "vla_grpo", ["rollout.tree.branches=[2,4]", "rollout.tree.segment_tokens=0"],
        ("rollout.tree.segment_tokens", "rollout.tree.branches"),
    ),
    "the best evaluation needs an evaluation": (
        "plan_exec_bc", ["env.eval_episodes=0"], ("checkpoint.best", "env.eval_episodes"),
    ),
    "the plan side runs planner episodes": (
        "plan_grpo", ["rollout.episode.env=tools"], ("side: plan", "rollout.episode.env"),
    ),
    "bc.dataset is side vla's": ("plan_grpo", ["bc.dataset=runs/x"], ("bc.dataset", "side: plan")),
    "bc.features maps the policy's inputs": (
        "vla_bc_pick", ["bc.features.front=observation.images.front"], ("bc.features.front",),
    ),
}  # fmt: skip
"""one invalid combination per rule checked at load"""
CLI_SAMPLE = (
    "env.id is a registered task",
    "warp has no entity features",
    "a policy executor needs policies",
    "a token policy has no critic",
    "a tree's leaves are the group",
    "the plan side runs planner episodes",
)
"""the rules also tried through ``perceptrl config``"""


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_loads_and_resolves(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert cfg.side in ("vla", "plan")
    if cfg.side == "vla":
        plan = resolve(cfg)
        assert plan.policy.kind == cfg.vla.policy and plan.env is cfg.env
    else:
        assert resolve_executor(cfg).executor == cfg.plan.executor


@pytest.mark.parametrize("rule", sorted(INVALID))
def test_each_rule_refuses_its_combination_when_the_recipe_loads(rule):
    recipe, overrides, keys = INVALID[rule]
    load_config(CONFIGS / f"{recipe}.yaml")  # the recipe itself is fine
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / f"{recipe}.yaml", overrides)
    assert all(key in str(e.value) for key in keys), (keys, str(e.value))


@pytest.mark.parametrize("rule", CLI_SAMPLE)
def test_perceptrl_config_refuses_what_a_run_would(rule, capsys):
    recipe, overrides, keys = INVALID[rule]
    assert main(["config", recipe, *overrides]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.startswith("perceptrl: config error:") and keys[0] in err


def test_a_saved_policy_s_own_sections_are_checked_when_it_is_read():
    """With ``model.path`` the policy's encoder, critic and head are the saved ones: the recipe's
    vla section is not held against the env when it loads (the builder checks the saved one)."""
    with pytest.raises(ConfigError, match="vla.encoder=state"):
        load_config(CONFIGS / "vla_grpo.yaml", ["env.obs_mode=rgb"])
    cfg = load_config(CONFIGS / "vla_grpo.yaml", ["env.obs_mode=rgb", "model.path=runs/bc"])
    assert resolve(cfg).policy.path == Path("runs/bc")


def test_a_worker_s_plan_is_its_share():
    cfg = load_config(
        CONFIGS / "vla_grpo.yaml",
        ["train.pipeline=async", "rollout.workers=3", "rollout.worker_gpus=0"],
    )
    plan = resolve(cfg)
    mine = plan.worker(2)
    assert (mine.env.num_envs, mine.collect.groups) == (3, 3)
    assert mine.seed == mine.collect.seed == mine.policy.seed != plan.seed
    assert mine.policy.device == "cpu" and cfg.env.num_envs == 8  # the recipe is unchanged
