"""Rollout corrections: importance weights and rejection masks from the rollout log-probs.

When the policy that sampled a batch (the *behaviour* policy: an inference engine, or an older
copy of the weights in an asynchronous pipeline) differs from the one the update starts from
(the *proximal* policy: the trainer's weights at the start of the update, whose log-probs are
``logp_old``), the policy loss is corrected with the behaviour log-probs ``logp_rollout``. Every
correction is a pure function registered in ``perceptrl.registry.CORRECTIONS``, selected by
``algo.rollout_correction``, with one signature::

    fn(logp_old [B, T], logp_rollout [B, T], mask [B, T], cfg) -> (weight [B, T], keep [B, T])

``weight`` multiplies the per-token policy loss after its clip (detached, 1 where nothing is
corrected) and ``keep`` (bool) removes tokens or whole sequences from the loss, its normaliser
included; a weight of 0 silences a token that still counts in the normaliser. ``cfg.tis_cap``
is the upper bound (a weight cap or a rejection threshold on the ratio ``pi_prox / pi_behav``; 0
turns the correction off) and ``cfg.correction_low`` the lower one, 0 taking the correction's
declared default (``low``: 0.5 for the two-sided rejections, none for the others). On-policy
data with agreeing engines has ratio 1: every correction then gives weight 1 and keeps every
token, so the loss is exactly the uncorrected one.

The clip of the policy loss is always taken against the proximal policy (``logp_old``), so
with a behaviour weight this is AReaL's decoupled PPO objective (Fu et al. 2025).
``decoupled`` and ``decoupled_seq`` are AReaL's own rule (inclusionAI/AReaL,
``areal/utils/functional.py``, ``compute_behave_imp_weight`` at d37095a and its successor
``apply_rejection_sampling`` at 4aef98d; defaults in ``areal/api/cli_args.py``: cap 5, mode
``token_mask``): a token (a row) whose weight is outside the bounds gets weight 0 and still
counts in the token mean. ``tis`` is AReaL's ``token_truncate`` mode and verl's token TIS (the
weight clamped into the bounds). The masked and sequence-level forms follow the
rollout-correction family verl documents (token/sequence truncated IS, masked IS,
geometric-mean rejection) and IcePop's two-sided token masking (Ling team 2025).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..registry import CORRECTIONS
from .advantages import masked_mean

_CLAMP = 20.0  # |log ratio| bound before exp


def _log_ratio(logp_old: Tensor, logp_rollout: Tensor, mask: Tensor) -> Tensor:
    """log(pi_prox / pi_behav) per token [B, T], 0 on masked positions, detached."""
    d = (logp_old.detach() - logp_rollout.detach()).clamp(-_CLAMP, _CLAMP)
    return torch.where(mask > 0, d, 0.0)


def _seq_log_ratio(d: Tensor, mask: Tensor, mean: bool = False) -> Tensor:
    """Per-sequence log ratio [B]: the sum over valid tokens (the sequence's IS ratio), or
    their mean (the geometric mean of the token ratios)."""
    s = d.sum(-1)
    return s / (mask > 0).sum(-1).clamp(min=1) if mean else s


def _ones(mask: Tensor) -> Tensor:
    return torch.ones_like(mask, dtype=torch.float32)


@CORRECTIONS.register("none", low=0.0)
def none(logp_old, logp_rollout, mask, cfg):
    """No correction: weight 1, every token kept."""
    return _ones(mask), mask > 0


def _low(cfg, name: str) -> float:
    """The lower bound of correction ``name``: ``cfg.correction_low``, or its declared ``low``."""
    return cfg.correction_low or CORRECTIONS.meta(name)["low"]


def _bounded(x: Tensor, low: float, cap: float) -> Tensor:
    """Whether the log ratios ``x`` lie in ``[low, cap]`` (bounds inclusive, as AReaL; a low
    of 0 is no bound)."""
    inside = x <= math.log(cap)
    return inside & (x >= math.log(low)) if low > 0 else inside


def _clamped(x: Tensor, low: float, cap: float) -> Tensor:
    """The log ratios ``x`` clamped into ``[low, cap]`` (a low of 0 is no bound)."""
    x = x.clamp(max=math.log(cap))
    return x.clamp(min=math.log(low)) if low > 0 else x


@CORRECTIONS.register("tis", low=0.0)
def token_tis(logp_old, logp_rollout, mask, cfg):
    """Token-level truncated IS: ``w_t = clamp(r_t, correction_low, tis_cap)`` (AReaL's
    ``token_truncate`` and its clamp action, whose lower bound defaults to none; verl's token
    TIS). Every token keeps training, with its weight truncated."""
    d = _clamped(_log_ratio(logp_old, logp_rollout, mask), _low(cfg, "tis"), cfg.tis_cap)
    return torch.where(mask > 0, torch.exp(d), 1.0), mask > 0


@CORRECTIONS.register("decoupled", low=0.0)
def decoupled(logp_old, logp_rollout, mask, cfg):
    """AReaL's decoupled PPO at its default (``token_mask``): ``w_t = r_t`` when ``r_t`` lies in
    ``[correction_low, tis_cap]``, else 0. A silenced token still counts in the token mean
    (AReaL divides by the loss mask's original count), unlike ``token_mask``, which removes it.
    AReaL's released cap is 5 (``algo.tis_cap=5``) with no lower bound."""
    d = _log_ratio(logp_old, logp_rollout, mask)
    w = torch.where(_bounded(d, _low(cfg, "decoupled"), cfg.tis_cap), torch.exp(d), 0.0)
    return torch.where(mask > 0, w, 1.0), mask > 0


@CORRECTIONS.register("decoupled_seq", low=0.0)
def decoupled_seq(logp_old, logp_rollout, mask, cfg):
    """AReaL's sequence-level behaviour weight (``sequence_mask``): every token of row i weighs
    the geometric mean of its token ratios, ``exp(mean_t log r_t)``, or 0 when that mean lies
    outside ``[correction_low, tis_cap]``; silenced rows still count in the token mean."""
    g = _seq_log_ratio(_log_ratio(logp_old, logp_rollout, mask), mask, mean=True)
    w = torch.where(_bounded(g, _low(cfg, "decoupled_seq"), cfg.tis_cap), torch.exp(g), 0.0)
    return torch.where(mask > 0, w[:, None], 1.0), mask > 0


@CORRECTIONS.register("seq_tis", low=0.0)
def seq_tis(logp_old, logp_rollout, mask, cfg):
    """Sequence-level truncated IS: every token of row i weighs its ratio ``prod_t r_t`` clamped
    into ``[correction_low, tis_cap]`` (no lower bound unless set)."""
    s = _seq_log_ratio(_log_ratio(logp_old, logp_rollout, mask), mask)
    w = torch.exp(_clamped(s, _low(cfg, "seq_tis"), cfg.tis_cap))[:, None].expand_as(mask)
    return torch.where(mask > 0, w, 1.0), mask > 0


@CORRECTIONS.register("token_mask", low=0.0)
def token_mask(logp_old, logp_rollout, mask, cfg):
    """Masked IS, token level: tokens whose ratio lies outside ``[correction_low, tis_cap]`` (no
    lower bound unless set) leave the loss, its token count included."""
    d = _log_ratio(logp_old, logp_rollout, mask)
    return _ones(mask), (mask > 0) & _bounded(d, _low(cfg, "token_mask"), cfg.tis_cap)


@CORRECTIONS.register("seq_mask", low=0.0)
def seq_mask(logp_old, logp_rollout, mask, cfg):
    """Masked IS, sequence level: rows whose sequence ratio lies outside ``[correction_low,
    tis_cap]`` (no lower bound unless set) leave the loss."""
    s = _seq_log_ratio(_log_ratio(logp_old, logp_rollout, mask), mask)
    return _ones(mask), (mask > 0) & _bounded(s, _low(cfg, "seq_mask"), cfg.tis_cap)[:, None]


@CORRECTIONS.register("geo_mask", low=0.5)
def geo_mask(logp_old, logp_rollout, mask, cfg):
    """Geometric-mean rejection: rows whose geometric-mean token ratio is outside
    ``[correction_low, tis_cap]`` leave the loss (length-normalised, so long sequences are not
    rejected for their length alone)."""
    g = _seq_log_ratio(_log_ratio(logp_old, logp_rollout, mask), mask, mean=True)
    return _ones(mask), (mask > 0) & _bounded(g, _low(cfg, "geo_mask"), cfg.tis_cap)[:, None]


@CORRECTIONS.register("icepop", low=0.5)
def icepop(logp_old, logp_rollout, mask, cfg):
    """IcePop: two-sided token masking, tokens whose ratio is outside ``[correction_low,
    tis_cap]`` leave the loss (the others keep weight 1)."""
    d = _log_ratio(logp_old, logp_rollout, mask)
    return _ones(mask), (mask > 0) & _bounded(d, _low(cfg, "icepop"), cfg.tis_cap)


def apply_correction(
    name: str, logp_old: Tensor, logp_rollout: Tensor, mask: Tensor, cfg
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Run correction ``name``; returns (weight [B, T] detached, new mask [B, T] float,
    metrics ``correction/weight_mean`` and ``correction/masked_frac`` over the valid tokens: the
    share removed or silenced, weight 0)."""
    if cfg.tis_cap <= 0:  # the correction is off: the trainer never calls it then
        raise ValueError(
            f"algo.rollout_correction={name!r} needs algo.tis_cap > 0 (its upper bound)"
        )
    weight, keep = CORRECTIONS.get(name)(logp_old, logp_rollout, mask, cfg)
    valid = mask > 0
    new_mask = mask * keep.to(mask.dtype)
    metrics = {
        "correction/weight_mean": float(masked_mean(weight.float(), mask)),
        "correction/masked_frac": (
            float(1 - (keep & (weight > 0))[valid].float().mean()) if valid.any() else 0.0
        ),
    }
    return weight.detach(), new_mask, metrics
