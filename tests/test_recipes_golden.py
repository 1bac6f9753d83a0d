"""Every shipped recipe, run briefly with a fixed seed, logs the metrics committed under
``tests/golden/`` (wall-clock values aside): the check that a redesign keeps behaviour.

The golden files were recorded on the development machine (2 CPU cores, one torch thread).
Another CPU may round a kernel differently, and a tiny change of a probability can flip a
sampled token, so the comparison is exact only where the files were recorded; it runs in the
slow lane (``make test-all``). Record again, after a change that is meant to move the metrics,
with ``PERCEPTRL_RECORD_GOLDEN=1 python -m pytest -m slow tests/test_recipes_golden.py`` and say
in the commit why they moved.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from perceptrl.cli import main  # noqa: E402
from perceptrl.trainer.metrics import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
RECORD = os.environ.get("PERCEPTRL_RECORD_GOLDEN") == "1"
WALL_CLOCK = ("time/", "sys/", "rollout/env_steps_per_s")
"""metric keys (prefixes) that measure the machine, not the run"""
QUIET = ["log.progress=false", "log.tensorboard=false", "checkpoint.every=0"]
VLM = [
    "data.n_train=12", "data.n_val=4", "rollout.prompts_per_step=2", "rollout.group_size=4",
    "rollout.max_new_tokens=48", "train.micro_batch_size=8", "train.eval_samples=4",
]  # fmt: skip
"""long enough for the shipped bases to answer, so rewards and advantages vary within groups"""
VLA = ["env.num_envs=2", "env.eval_episodes=2", "vla.hidden=32"]
GRPO_VLA = ["rollout.prompts_per_step=2", "rollout.group_size=2", "env.max_episode_steps=8",
            "algo.max_collects=2"]  # fmt: skip
PLAN = ["data.n_train=4", "data.n_val=2", "rollout.prompts_per_step=1", "rollout.group_size=2",
        "rollout.max_new_tokens=8", "rollout.episode.max_turns=2", "train.micro_batch_size=4",
        "train.eval_samples=1", "plan.subgoal_steps=20"]  # fmt: skip
PIXELS = ["env.image_size=32", "env.steps_per_rollout=4", "env.max_episode_steps=6",
          "vla.channels=[4,8,8]", "train.ppo_epochs=1"]  # fmt: skip

SAC = ["env.steps_per_rollout=4", "replay.learning_starts=8", "replay.batch_size=16",
       "replay.size=64"]  # fmt: skip
"""two steps of warm-up, then updates from a buffer that wraps around"""
BC_FLOW = "{bc_flow}"
"""stands for the model of a brief vla_bc_flow run (tiny, 3 flow steps) made first"""

RECIPES: dict[str, tuple[str, list[str]]] = {
    # recipe: (command, overrides)
    "vlm_clevr": ("train", [*VLM, "train.steps=3", "train.eval_every=1",
                  "algo.dynamic_sampling=false"]),
    "vlm_demo": ("train", [*VLM, "train.steps=3", "train.eval_every=1"]),
    "vlm_sft": ("sft", [*VLM, "train.steps=2", "train.eval_every=1"]),
    "vlm_clevr_tree": ("train", [*VLM, "train.steps=2", "rollout.group_size=4",
                       "rollout.tree.branches=[2,2]", "rollout.tree.segment_tokens=3"]),
    "vlm_process": ("train", [*VLM, "train.steps=2"]),
    "vlm_spatial": ("train", [*VLM, "train.steps=1", "data.n_train=4", "data.n_val=2",
                    "train.eval_samples=2", "algo.dynamic_sampling=false"]),
    "vlm_video": ("train", [*VLM, "train.steps=1", "data.n_train=4", "data.n_val=2",
                  "train.eval_samples=2", "algo.dynamic_sampling=false"]),
    "vlm_zoom": ("train", [*VLM, "train.steps=1", "data.n_train=4", "data.n_val=2",
                 "train.eval_samples=2", "rollout.episode.max_tokens=48",
                 "algo.dynamic_sampling=false"]),
    "plan_grpo": ("train", [*PLAN, "train.steps=1"]),
    "vla_ppo_reach_state": ("train", [*VLA, "train.steps=4", "env.steps_per_rollout=8",
                            "env.max_episode_steps=12", "train.ppo_epochs=2",
                            "train.eval_every=2"]),
    "vla_ppo_reach": ("train", [*VLA, *PIXELS, "train.steps=2"]),
    "vla_ppo_reach_warp": ("train", [*VLA, *PIXELS, "train.steps=2", "env.device=cpu"]),
    "vla_grpo": ("train", [*VLA, *GRPO_VLA, "train.steps=2"]),
    "vla_grpo_flow": ("train", [*VLA, *GRPO_VLA, "train.steps=2"]),
    "vla_grpo_token": ("train", [*GRPO_VLA, "env.num_envs=2", "env.eval_episodes=2",
                       "train.steps=1"]),
    "vla_bc_pick": ("sft", [*VLA, "train.steps=2", "env.steps_per_rollout=8",
                    "train.eval_every=0"]),
    "vla_bc_flow": ("sft", [*VLA, "train.steps=2", "env.steps_per_rollout=8",
                    "train.eval_every=0"]),
    "vla_bc_token": ("sft", ["env.num_envs=2", "env.eval_episodes=2", "train.steps=2",
                     "env.steps_per_rollout=8", "train.eval_every=0"]),
    "plan_exec_bc": ("sft", [*VLA, "train.steps=2", "env.steps_per_rollout=8",
                     "train.eval_every=0", "checkpoint.best="]),
    "plan_exec_reader": ("sft", [*VLA, "train.steps=2", "env.steps_per_rollout=8",
                         "train.eval_every=0", "checkpoint.best="]),
    "vla_sac_reach_state": ("train", [*VLA, *SAC, "train.steps=4", "env.max_episode_steps=6",
                            "train.eval_every=2"]),
    "vla_sac_pick": ("train", [*VLA, *SAC, "train.steps=4", "env.max_episode_steps=6",
                     "train.eval_every=2", "replay.demos=2"]),
    "vla_dsrl_pick": ("train", [*VLA, *SAC, "train.steps=3", "env.max_episode_steps=6",
                      "vla.flow_steps=3", f"model.path={BC_FLOW}", "train.eval_every=0"]),
}  # fmt: skip
VARIANTS: dict[str, tuple[str, str, list[str]]] = {
    # name: (recipe, command, overrides): the estimators, losses and KL the recipes leave out
    "vlm_clevr+rloo+gspo": ("vlm_clevr", "train", [*RECIPES["vlm_clevr"][1],
                            "algo.adv_estimator=rloo", "algo.policy_loss=gspo"]),
    "vlm_clevr+rpp+cispo+kl": ("vlm_clevr", "train", [*RECIPES["vlm_clevr"][1],
                               "algo.adv_estimator=reinforce_pp_baseline",
                               "algo.policy_loss=cispo", "algo.kl_coef=0.05",
                               "algo.loss_agg_mode=seq-mean-token-sum-norm"]),
    "vlm_clevr+kl_in_reward": ("vlm_clevr", "train", [*RECIPES["vlm_clevr"][1],
                               "algo.kl_coef=0.05", "algo.kl_in_reward=true",
                               "algo.kl_estimator=k1", "train.ppo_epochs=2"]),
    "vlm_clevr_tree+treerl": ("vlm_clevr_tree", "train", [*RECIPES["vlm_clevr_tree"][1],
                              "algo.adv_estimator=treerl"]),
    "vlm_process+implicit": ("vlm_process", "train", [*RECIPES["vlm_process"][1],
                             "rollout.process_reward=implicit_prm"]),
    "vla_grpo+rloo": ("vla_grpo", "train", [*RECIPES["vla_grpo"][1], "algo.adv_estimator=rloo"]),
    "vla_sac_reach_state+pixels+demos": ("vla_sac_reach_state", "train", [
        *RECIPES["vla_sac_reach_state"][1], "env.obs_mode=rgb", "env.image_size=32",
        "vla.encoder=keypoint", "vla.channels=[4,8,8]", "replay.augment=shift", "replay.demos=2",
        "replay.n_step=2", "env.cameras=[agentview]"]),
}  # fmt: skip
RUNS = {**{r: (r, *RECIPES[r]) for r in RECIPES}, **VARIANTS}


def test_every_shipped_recipe_has_a_golden_run():
    shipped = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert sorted(RECIPES) == shipped


def rows(metrics: Path) -> list[dict]:
    """The run's metrics without wall-clock values and resume markers."""
    return [
        {k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)}
        for r in read_metrics(metrics)
        if "resumed_from_step" not in r
    ]


def _run(name: str, run_dir: Path) -> None:
    """`perceptrl` in this process, on one thread, after drawing from the global generators."""
    recipe, command, overrides = RUNS[name]
    if any(BC_FLOW in o for o in overrides):  # a warm start to steer, made first
        bc = run_dir.parent / "bc_flow"
        bc_args = ["sft", "vla_bc_flow", *VLA, "train.steps=1", "env.steps_per_rollout=4",
                   "train.eval_every=0", "vla.flow_steps=3", *QUIET, "--run-dir", str(bc)]  # fmt: skip
        assert main(bc_args) == 0
        model = str(bc / "checkpoints" / "step_000001" / "model")
        overrides = [o.replace(BC_FLOW, model) for o in overrides]
    threads, old = torch.get_num_threads(), Path.cwd()
    torch.set_num_threads(1)
    os.chdir(run_dir.parent)
    try:
        random.random(), np.random.rand(3), torch.rand(5)
        assert main([command, recipe, *overrides, *QUIET, "--run-dir", str(run_dir)]) == 0
    finally:
        os.chdir(old)
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_recipe_logs_its_golden_metrics(name, tmp_path):
    run_dir = tmp_path / name.replace("+", "_")
    _run(name, run_dir)
    got = rows(run_dir / "metrics.jsonl")
    golden = GOLDEN / f"{name}.jsonl"
    if RECORD:
        GOLDEN.mkdir(exist_ok=True)
        golden.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in got))
        return
    want = [json.loads(line) for line in golden.read_text().splitlines()]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(want, got, strict=True):
        assert a == b, {
            k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)
        }
