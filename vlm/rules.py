"""The VLM side's rules across sections, checked when a recipe loads (`check_vlm`, the side's
``Side.check``; the plan side, whose runs are the VLM side's, runs them too).

Each section checks its own keys (``vlm/config.py``, ``trainer/config.py``); the rules here tie
the rollout section to the others, or hold only for the VLM side's samplers and engines: how a
tree grows on each engine, what guide rows and process rewards need of the trainer, what the
vLLM engine cannot sync, whether the run has the evaluation ``checkpoint.best`` keeps, and that
the VLM policy has no critic. Each error names the key, the key it conflicts with, and the fix.
What only the run's environment knows (the number of ranks, a GPU, the data files, the model's
processor) is checked where the run is built (``vlm/builder.py``).
"""

from __future__ import annotations

from ..registry import ADVANTAGES
from ..trainer.config import ConfigError
from .schedule import TreeShape


def check_vlm(cfg) -> None:
    """Refuse a recipe the VLM side cannot run (``cfg``: the composed `wiring.Config`).

    Raises:
        ConfigError: the first rule the recipe breaks.
    """
    check_tree(cfg.rollout)
    _check_trainer_process(cfg)
    _check_vllm(cfg)
    _check_evaluation(cfg)
    _check_critic(cfg)


def check_tree(r) -> None:
    """``rollout.tree`` against the rest of the rollout section (``r``): the samplers that grow
    trees, the group it must fill, the tokens it leaves the last segment."""
    t = r.tree
    if not t.branches:
        return
    where = f"rollout.tree.branches={t.branches}"
    episodes = r.episode.enabled
    if r.engine == "hf" and r.sampler != "fork":
        raise ConfigError(f"{where} needs rollout.sampler=fork on the HF engine")
    if r.engine == "vllm" and t.allocate != "uniform":
        raise ConfigError(
            f"{where} on rollout.engine=vllm needs rollout.tree.allocate=uniform (entropy "
            "needs the next-token distribution at a fork, which vLLM does not return); use "
            "rollout.engine=hf for entropy forks"
        )
    if episodes and len(t.branches) > r.episode.max_turns:
        raise ConfigError(
            f"{where}: an episode tree forks after a turn; {len(t.branches)} levels need "
            f"rollout.episode.max_turns >= {len(t.branches)}"
        )
    try:
        shape = TreeShape(tuple(t.branches), t.segment_tokens, t.allocate)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    if shape.leaves != r.group_size:
        raise ConfigError(
            f"{where} has {shape.leaves} leaves per prompt; set rollout.group_size={shape.leaves}"
        )
    if (not episodes and len(shape.branches) > 1
            and (len(shape.branches) - 1) * t.segment_tokens >= r.max_new_tokens):  # fmt: skip
        raise ConfigError(
            f"{where}: {len(shape.branches) - 1} segments of {t.segment_tokens} tokens leave "
            f"nothing of rollout.max_new_tokens={r.max_new_tokens} for the last segment"
        )


def _check_trainer_process(cfg) -> None:
    """Guide rows and process rewards are computed in the trainer's process, on the rollout's
    own tokens."""
    r = cfg.rollout
    if r.guide and cfg.algo.tis_cap > 0:
        raise ConfigError(
            f"rollout.guide={r.guide} with algo.tis_cap > 0: guide rows have no sampling "
            "log-probs to correct; set algo.tis_cap=0 or rollout.guide=0"
        )
    if r.guide and cfg.train.pipeline != "sync":
        raise ConfigError(
            f"rollout.guide={r.guide} runs in the trainer's process; use train.pipeline=sync"
        )
    if r.process_reward and cfg.train.pipeline != "sync":
        raise ConfigError(
            "rollout.process_reward runs in the trainer's process; use train.pipeline=sync"
        )


def _check_vllm(cfg) -> None:
    """What the colocated vLLM engine cannot receive from the trainer, or run without."""
    r = cfg.rollout
    if r.engine != "vllm":
        return
    if cfg.model.lora_rank:
        raise ConfigError(
            "rollout.engine=vllm does not sync LoRA adapters yet; use model.lora_rank=0"
        )
    if cfg.train.backend == "deepspeed" and cfg.train.zero_stage == 3:
        raise ConfigError(
            "rollout.engine=vllm pushes each rank's full weights to its engine, but ZeRO-3 "
            "partitions them; use train.zero_stage=2"
        )
    if cfg.train.pipeline != "sync" and r.workers > 1 and not r.worker_gpus:
        raise ConfigError(
            f"rollout.engine=vllm with rollout.workers={r.workers}: vLLM workers need "
            "rollout.worker_gpus > 0"
        )


def _check_evaluation(cfg) -> None:
    """``checkpoint.best`` needs the periodic evaluation: held-out samples and
    ``train.eval_samples`` (the trainer refuses it too, for any side, once the run is built)."""
    best, d = cfg.checkpoint.best, cfg.data
    if not best:
        return
    held_out = d.val if d.train else d.n_val > 0
    if cfg.train.eval_samples <= 0 or not held_out:
        raise ConfigError(
            f"checkpoint.best={best} keeps the weights of the best evaluation, but this recipe "
            "has none: set train.eval_samples > 0 and held-out data (data.val, or data.n_val > 0 "
            "for the synthetic set), or unset checkpoint.best"
        )


def _check_critic(cfg) -> None:
    """The VLM policy has no value head."""
    name = cfg.algo.adv_estimator
    if "values" in ADVANTAGES.meta(name)["needs"]:
        raise ConfigError(
            f"algo.adv_estimator={name} needs a critic's values, which the VLM policy (side "
            f"{cfg.side}) does not have; use an estimator without one (e.g. grpo, rloo)"
        )
