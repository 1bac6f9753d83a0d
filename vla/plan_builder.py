"""Side ``plan``: a VLM planner whose subgoals a VLA executes, built from the VLM side's runs.

A planner recipe is a VLM recipe whose episodes run in the ``plan`` episode environment
(`vla.plan_env.PlanEnv`, registered when ``vla/plan_env.py`` is imported): training, the warm start,
evaluation and pass@k are the VLM side's (``vlm/builder.py``) with that environment, and several
planners are compared side by side with the oracle plan by ``vla/plan_eval.py``. Its rules
(``check``) are the VLM side's and its own (`vla.config.check_plan`), run when a recipe loads;
the executor's settings resolve once (`vla.run_plan.resolve_executor`).
"""

from __future__ import annotations

from ..registry import SIDES, Side
from ..vlm import builder as vlm_builder
from . import plan_env  # noqa: F401  (registers the "plan" episode environment, workers need it too)
from .config import check_plan
from .plan_eval import compare


def check(cfg) -> None:
    """Side plan's rules, run when a recipe naming it loads: its own (planner episodes), then
    the VLM side's, whose runs it uses."""
    check_plan(cfg)
    vlm_rules = SIDES.get("vlm").check
    if vlm_rules is not None:
        vlm_rules(cfg)


def build_trainer(cfg, run_dir):
    """GRPO of the planner: the VLM side's trainer with the planner's episodes."""
    return vlm_builder.build_trainer(cfg, run_dir, worker=rollout_worker)


def rollout_worker(*args, **kwargs):
    """A pipeline worker of the plan side (``train.pipeline=one_step_off|async``): the VLM side's
    worker, run from this module so that the worker process imports it and, through it,
    ``vla/plan_env.py``, which registers the ``plan`` episode environment."""
    return vlm_builder.rollout_worker(*args, **kwargs)


def run_sft(cfg, run_dir):
    """The warm start: the oracle plans as planner turns, each executed for real."""
    return vlm_builder.run_sft(cfg, run_dir)


def run_eval(cfg, out_dir, more=()):
    """Held-out task success of one planner (`plan.PLAN_EVAL`), as the VLM side evaluates."""
    return vlm_builder.run_eval(cfg, out_dir, more)


def run_compare(cfgs, out_dir):
    """Several planners side by side with the oracle plan on the same held-out states (table,
    bar chart, videos; `vla.plan_eval.compare`)."""
    return compare(cfgs, out_dir)


def run_pass_k(cfgs, out_dir, ks, n):
    """pass@k of planners: ``n`` sampled planner episodes per held-out state, scored by task
    success (`plan.PLAN_EVAL`)."""
    return vlm_builder.run_pass_k(cfgs, out_dir, ks, n)


SIDES.register(
    "plan",
    Side(
        build_trainer,
        run_eval,
        run_sft=run_sft,
        run_compare=run_compare,
        run_pass_k=run_pass_k,
        check=check,
    ),
)
