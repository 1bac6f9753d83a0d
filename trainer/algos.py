"""The shared RL algorithm core: policy losses, KL estimators, loss aggregation, value loss.

Everything here is a pure tensor function (torch only, no model code), registered by name in
the registries of :mod:`perceptrl.registry` so the training loop never special-cases an
algorithm. One signature per kind:

* policy loss (``POLICY_LOSSES``): ``fn(logp, logp_old, advantages, mask, cfg, *,
  is_weight=None, num_tokens=None, num_seqs=None) -> (loss [], metrics)``
* KL estimator (``KL_ESTIMATORS``): ``fn(logp, logp_ref) -> kl [B, T]`` (per token, not masked)
* loss aggregation mode (``AGG_MODES``): ``fn(loss, valid, *, num_tokens, num_seqs, norm_len)
  -> loss []``, called through :func:`agg_loss`

Advantage estimators live in :mod:`.advantages` (their masked statistics are re-exported here).

Conventions: ``mask`` [B, T] is 1 on the policy's own tokens/steps and 0 elsewhere (padding,
and interior holes such as observations inside a multi-turn episode). ``rewards`` is [B] (one
per sequence; placed at the last valid token when a token-level view is needed) or [B, T].
Advantages and returns are detached and zero on masked positions. ``num_tokens`` / ``num_seqs``
are the global normalisers of the whole (mini)batch (valid tokens / rows with at least one
valid token), so that summing the losses of micro-batches gives exactly the full-batch loss and
gradient. Metrics are python floats with flat names; the loop adds its own prefix.

Semantics follow verl (``trainer/ppo/core_algos.py``) so that a ported recipe optimises the
same objective; each place that differs says why in its docstring.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..registry import AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES
from .advantages import (
    WHITEN_EPS,
    _floats,
    group_index,
    masked_mean,
    masked_whiten,
    seq_rewards,
    token_rewards,
)

if TYPE_CHECKING:
    from .config import AlgoConfig

__all__ = [
    "WHITEN_EPS",
    "agg_loss",
    "filter_groups",
    "filter_metrics",
    "kl_to_reward",
    "masked_mean",
    "masked_whiten",
    "rollout_gap_metrics",
    "token_rewards",
    "value_loss",
]

_LOG_RATIO_CLAMP = 20.0  # |logp - logp_old| beyond this is clamped before exp (as verl)


# ----------------------------------------------------------------------------- aggregation


def _safe_div(num: Tensor, den: Tensor | float | int) -> Tensor:
    den_t = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return num / den_t.clamp(min=1e-8)


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: Tensor | float | None = None,
    num_seqs: Tensor | float | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar with the aggregation mode ``mode`` (one of
    ``AGG_MODES``, as verl's ``agg_loss``; an unknown name raises with the valid ones).

    Pass the global ``num_tokens`` / ``num_seqs`` of the whole minibatch when calling on
    micro-batches: the sum of the micro-batch losses is then the full-batch loss. Padding values
    (even NaN/inf) are ignored; an all-masked batch gives 0.

    Args:
        loss_mat [B, T], mask [B, T]; num_tokens: valid tokens of the whole (mini)batch;
        num_seqs: its rows with at least one valid token; norm_len: constant divisor of
        seq-mean-token-sum-norm.
    Returns:
        scalar loss.
    """
    fn = AGG_MODES.get(mode)
    valid = mask > 0
    loss = torch.where(valid, loss_mat, 0.0)
    return fn(loss, valid, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)


def _seq_mean(seq: Tensor, valid: Tensor, num_seqs) -> Tensor:
    """Row values [B] summed and divided by ``num_seqs``. As verl, ``num_seqs`` counts the rows
    with at least one valid token (default: those of this batch), so that empty rows (all
    observation, or all padding) do not shrink the weight of every other row."""
    n = valid.any(dim=-1).sum() if num_seqs is None else num_seqs
    return _safe_div(seq.sum(), n)


@AGG_MODES.register("token-mean")
def token_mean(loss: Tensor, valid: Tensor, *, num_tokens=None, num_seqs=None, norm_len=None):
    """``sum(loss) / num_tokens`` (default: this batch's valid tokens)."""
    return _safe_div(loss.sum(), valid.sum() if num_tokens is None else num_tokens)


@AGG_MODES.register("seq-mean-token-sum")
def seq_mean_token_sum(
    loss: Tensor, valid: Tensor, *, num_tokens=None, num_seqs=None, norm_len=None
):
    """Each row's token sum, summed and divided by ``num_seqs``."""
    return _seq_mean(loss.sum(dim=-1), valid, num_seqs)


@AGG_MODES.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss: Tensor, valid: Tensor, *, num_tokens=None, num_seqs=None, norm_len=None
):
    """Each row's token mean, summed and divided by ``num_seqs``."""
    seq = loss.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)  # (B,)
    return _seq_mean(seq, valid, num_seqs)


@AGG_MODES.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss: Tensor, valid: Tensor, *, num_tokens=None, num_seqs=None, norm_len=None
):
    """Each row's token sum, summed and divided by ``norm_len`` only (default T; Dr.GRPO's
    constant normaliser).

    This is verl's formula, which has no division by the number of rows: the loss is the
    batch's token sum over a constant. (verl's legacy workers then also scale each micro-batch
    by 1 / gradient-accumulation steps, and data parallelism averages over ranks, so its
    effective divisor depends on the parallel layout; ours does not. Dr.GRPO's paper and TRL's
    ``dr_grpo`` also divide by the number of rows: set ``loss_norm_len`` to rows x length to
    get theirs.)
    """
    return loss.sum(dim=-1).sum() / (norm_len or loss.shape[-1] or 1)


# ----------------------------------------------------------------------------- policy losses


def _log_ratio(logp: Tensor, logp_old: Tensor, valid: Tensor) -> Tensor:
    lr = torch.where(valid, logp - logp_old.detach(), 0.0)
    return lr.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _weighted(loss: Tensor, is_weight: Tensor | None) -> Tensor:
    return loss if is_weight is None else loss * is_weight.detach()


def _agg_pg(loss, mask, cfg, is_weight, num_tokens, num_seqs) -> Tensor:
    """IS-weight a per-token policy loss and aggregate it with ``cfg.loss_agg_mode``."""
    mode, norm_len = cfg.loss_agg_mode, cfg.loss_norm_len or None
    loss = _weighted(loss, is_weight)
    return agg_loss(loss, mask, mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)


def _pg_metrics(log_ratio: Tensor, ratio: Tensor, clipped: Tensor, mask: Tensor, **extra):
    with torch.no_grad():
        k3 = ratio - 1 - log_ratio  # KL(old || new) sampled from old
        return _floats(
            {
                "clipfrac": masked_mean(clipped.float(), mask),
                "approx_kl": masked_mean(k3, mask),
                "ratio_mean": masked_mean(ratio, mask),
                **extra,
            }
        )


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logp, logp_old, advantages, mask, cfg, *, is_weight=None, num_tokens=None, num_seqs=None
):
    """PPO clipped surrogate with asymmetric clip and dual clip, as verl's vanilla policy loss
    (``compute_policy_loss_vanilla``, volcengine/verl ``verl/trainer/ppo/core_algos.py`` at
    b178a3c).

    ``loss_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` with ``r`` from the log-ratio
    clamped to +-20; with ``dual_clip_c`` = c > 1 (3 by default, as verl, which always applies
    it), tokens with A < 0 use ``min(loss_t, -A c)``; 0 turns the dual clip off. Multiplied by
    ``is_weight`` (detached) after the clips, then aggregated with ``cfg.loss_agg_mode``.

    Args:
        logp [B, T] (with grad), logp_old [B, T], advantages [B, T], mask [B, T],
        cfg (AlgoConfig), is_weight [B, T] or None, num_tokens / num_seqs: global normalisers.
    Returns:
        scalar loss; metrics clipfrac, approx_kl (k3, old vs new), ratio_mean (+ clipfrac_dual).
    """
    c = cfg.dual_clip_c  # 0 or > 1: AlgoConfig.check refuses the rest when the recipe loads
    valid = mask > 0
    log_ratio = _log_ratio(logp, logp_old, valid)
    ratio = torch.exp(log_ratio)
    adv = torch.where(valid, advantages.detach(), 0.0)
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    loss = torch.maximum(l1, l2)
    extra = {}
    if c > 1:
        l3 = -adv * c
        neg = adv < 0
        extra["clipfrac_dual"] = masked_mean((neg & (loss > l3)).float(), mask)
        loss = torch.where(neg, torch.minimum(loss, l3), loss)
    loss = _agg_pg(loss, mask, cfg, is_weight, num_tokens, num_seqs)
    return loss, _pg_metrics(log_ratio, ratio, l2 > l1, mask, **extra)


@POLICY_LOSSES.register("gspo")
def gspo(logp, logp_old, advantages, mask, cfg, *, is_weight=None, num_tokens=None, num_seqs=None):
    """GSPO (Zheng et al. 2025), token-level form.

    Sequence ratio ``s_i = exp(mean_t (logp - logp_old))`` over valid tokens; token ratio
    ``s_it = sg[s_i] * exp(logp_t - sg[logp_t])`` (value s_i, gradient s_i * d logp_t);
    ``loss_t = max(-A s_it, -A clip(s_it, 1 - gspo_clip_low, 1 + gspo_clip_high))``. As verl's
    ``compute_policy_loss_gspo`` (volcengine/verl ``verl/trainer/ppo/core_algos.py`` at b178a3c):
    the token log-ratios are averaged unclamped, and only the combined log-ratio is clamped at
    10 from above; no dual clip. Always aggregated ``seq-mean-token-mean`` as in the paper (``cfg.loss_agg_mode`` is ignored),
    so that with per-sequence advantages the gradient is the paper's sequence-level one;
    ``num_seqs`` (rows with a valid token) is the global normaliser (``num_tokens`` is unused).
    """
    valid = mask > 0
    log_ratio = _log_ratio(logp, logp_old, valid)  # clamped: for the metrics only
    raw = torch.where(valid, logp - logp_old.detach(), 0.0)  # as verl: no clamp before the mean
    seq_log = raw.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)  # (B,)
    lp = torch.where(valid, logp, 0.0)
    log_s = (seq_log.detach()[:, None] + lp - lp.detach()).clamp(max=10.0)  # (B, T)
    s = torch.exp(log_s)
    adv = torch.where(valid, advantages.detach(), 0.0)
    l1 = -adv * s
    l2 = -adv * s.clamp(1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high)
    loss = agg_loss(
        _weighted(torch.maximum(l1, l2), is_weight), mask, "seq-mean-token-mean", num_seqs=num_seqs
    )
    return loss, _pg_metrics(
        log_ratio, torch.exp(log_ratio), l2 > l1, mask, seq_ratio_mean=masked_mean(s.detach(), mask)
    )


@POLICY_LOSSES.register("cispo")
def cispo(logp, logp_old, advantages, mask, cfg, *, is_weight=None, num_tokens=None, num_seqs=None):
    """CISPO (MiniMax-M1): ``loss_t = -sg[clip(r, 1 - cispo_clip_low, 1 + cispo_clip_high)] A logp``.

    The importance weight is clipped and detached, so every token keeps a gradient (no token is
    dropped as in PPO). ``cispo_clip_low = 0`` disables the lower bound. Aggregated with
    ``cfg.loss_agg_mode``.
    """
    valid = mask > 0
    log_ratio = _log_ratio(logp, logp_old, valid)
    ratio = torch.exp(log_ratio)
    low = 1 - cfg.cispo_clip_low if cfg.cispo_clip_low > 0 else None
    w = ratio.clamp(min=low, max=1 + cfg.cispo_clip_high).detach()
    adv = torch.where(valid, advantages.detach(), 0.0)
    loss = -w * adv * torch.where(valid, logp, 0.0)
    loss = _agg_pg(loss, mask, cfg, is_weight, num_tokens, num_seqs)
    return loss, _pg_metrics(log_ratio, ratio, w != ratio.detach(), mask)


def value_loss(
    values, values_old, returns, mask, cfg: AlgoConfig, *, num_tokens=None, num_seqs=None
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss ``0.5 * max((v - R)^2, (clip(v, v_old -+ value_clip) - R)^2)``.

    Unclipped ``0.5 * (v - R)^2`` when ``cfg.value_clip`` is 0 (``values_old`` may then be None).
    Aggregated with ``cfg.loss_agg_mode`` (and ``cfg.loss_norm_len``) like the policy loss, as
    verl's critic (its ``loss_agg_mode`` defaults to the actor's).

    Args:
        values [B, T] (with grad), values_old [B, T] or None, returns [B, T], mask [B, T];
        num_tokens / num_seqs: global normalisers, as :func:`agg_loss`.
    Returns:
        scalar loss; metrics vf_clipfrac, vf_mean, vf_explained_var.
    """
    valid = mask > 0
    ret = torch.where(valid, returns.detach(), 0.0)
    l1 = (values - ret).square()
    clipped = torch.zeros_like(valid)
    if cfg.value_clip > 0:
        if values_old is None:
            raise ValueError(
                "value_loss with algo.value_clip > 0 needs values_old [B, T]; "
                "store values at rollout time or set algo.value_clip=0"
            )
        vo = values_old.detach()
        v_clip = vo + (values - vo).clamp(-cfg.value_clip, cfg.value_clip)
        l2 = (v_clip - ret).square()
        clipped = l2 > l1
        l1 = torch.maximum(l1, l2)
    norm = {"num_tokens": num_tokens, "num_seqs": num_seqs, "norm_len": cfg.loss_norm_len or None}
    loss = 0.5 * agg_loss(l1, mask, cfg.loss_agg_mode, **norm)
    with torch.no_grad():
        v = values.detach()
        var_r, var_e = (
            masked_mean((x - masked_mean(x, mask)).square(), mask) for x in (ret, ret - v)
        )
        ev = 1 - var_e / var_r.clamp(min=1e-8)
        clipfrac, v_mean = masked_mean(clipped.float(), mask), masked_mean(v, mask)
    metrics = {"vf_clipfrac": clipfrac, "vf_mean": v_mean, "vf_explained_var": ev}
    return loss, _floats(metrics)


# ----------------------------------------------------------------------------- KL estimators


# Names follow Schulman's "Approximating KL divergence"; verl calls k1 / k2 / k3 also
# kl / mse / low_var_kl.


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k1 = logp - logp_ref (unbiased, high variance, can be negative). [B, T]."""
    return logp - logp_ref


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k2 = 0.5 (logp - logp_ref)^2 (its gradient is an unbiased KL gradient). [B, T]."""
    return 0.5 * (logp - logp_ref).square()


@KL_ESTIMATORS.register("abs")
def kl_abs(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """|logp - logp_ref| (verl's ``abs``). [B, T]."""
    return (logp - logp_ref).abs()


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1 (unbiased, >= 0, low variance).

    As verl: the log ratio is clamped to [-20, 20] and the result to [-10, 10]. [B, T].
    """
    d = (logp_ref - logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1).clamp(-10.0, 10.0)


def _k2_gradient(value: Tensor, logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Straight-through: the value of ``value``, the gradient of k2. [B, T]."""
    k2 = kl_k2(logp, logp_ref)
    return value.detach() + (k2 - k2.detach())


@KL_ESTIMATORS.register("k1+")
def kl_k1_plus(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Straight-through k1: the value of k1, the gradient of k2. [B, T].

    The expected value of k1 (or k3) is the KL, but the expected gradient of neither is the KL's
    gradient, while k2's is; verl's ``k1+`` keeps k1's value for the penalty and logging and
    takes k2's gradient. (verl documents ``k1+``/``k3+`` this way; the version read, Jan 2026,
    passes the name with its ``+`` to the forward function, which raises. We implement the
    documented meaning.)
    """
    return _k2_gradient(kl_k1(logp, logp_ref), logp, logp_ref)


@KL_ESTIMATORS.register("k3+")
def kl_k3_plus(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Straight-through k3: the value of k3 (clamped as :func:`kl_k3`), the gradient of k2
    (unclamped, so a clamped token still pulls towards the reference). [B, T]. See ``k1+``."""
    return _k2_gradient(kl_k3(logp, logp_ref), logp, logp_ref)


# ----------------------------------------------------------------------------- batch utilities


def filter_groups(rewards: Tensor, group_id: Tensor, tol: float = 1e-6) -> Tensor:
    """DAPO dynamic sampling: keep mask [B] (bool) that drops every group whose rewards are all
    equal within ``tol`` (max - min <= tol), which carries no group-relative signal. Single-member
    groups are dropped too. [B, T] rewards are summed over T first.
    """
    r = seq_rewards(rewards, None)
    inv, n_groups = group_index(group_id)
    hi = r.new_full((n_groups,), -math.inf).scatter_reduce(0, inv, r, "amax")  # (G,)
    lo = r.new_full((n_groups,), math.inf).scatter_reduce(0, inv, r, "amin")  # (G,)
    return (hi - lo)[inv] > tol


def filter_metrics(keep: Tensor, group_id: Tensor) -> dict[str, float]:
    """Fractions of samples and of groups kept by :func:`filter_groups`."""
    n_groups, kept_groups = torch.unique(group_id).numel(), torch.unique(group_id[keep]).numel()
    frac = float(keep.float().mean()) if keep.numel() else 0.0
    return {"filter_kept_frac": frac, "filter_kept_groups_frac": kept_groups / max(n_groups, 1)}


def rollout_gap_metrics(
    logp_old: Tensor, logp_rollout: Tensor, mask: Tensor, cap: float = 0.0
) -> dict[str, float]:
    """How far the rollout engine's log-probs are from the trainer's on the sampled tokens.

    Args:
        logp_old, logp_rollout, mask: [B, T] (trainer's, engine's, valid tokens).
        cap: TIS cap (``algo.tis_cap``); > 0 adds the fraction of tokens whose weight it caps.

    Returns:
        ``rollout_gap/abs_mean`` and ``/abs_max`` (|logp_old - logp_rollout| over valid tokens),
        ``/kl_k3`` (k3 estimate of KL(rollout || trainer)), ``/seq_abs_max`` (largest per-sequence
        sum), and ``tis/capped_frac``, ``tis/weight_mean`` when ``cap > 0``.
    """
    valid = mask > 0
    if not valid.any():
        return {}
    d = (logp_old.detach() - logp_rollout.detach()).float()  # [B, T]
    diff = d[valid]
    out = {
        "rollout_gap/abs_mean": float(diff.abs().mean()),
        "rollout_gap/abs_max": float(diff.abs().max()),
        "rollout_gap/kl_k3": float((torch.exp(diff) - 1 - diff).mean()),
        "rollout_gap/seq_abs_max": float((d * valid).sum(1).abs().max()),
    }
    if cap > 0:
        w = torch.exp(diff)
        out["tis/capped_frac"] = float((w > cap).float().mean())
        out["tis/weight_mean"] = float(w.clamp(max=cap).mean())
    return out


def kl_to_reward(
    rewards: Tensor, logp: Tensor, logp_ref: Tensor, mask: Tensor, kl_coef: float, estimator: str
) -> Tensor:
    """Fold the KL penalty into per-token rewards: ``token_rewards(rewards) - kl_coef * kl``.

    Args:
        rewards [B] (placed at the last valid token) or [B, T]; logp, logp_ref, mask [B, T];
        estimator: name of a registered KL estimator (``perceptrl.registry.KL_ESTIMATORS``).
    Returns:
        [B, T] detached token rewards, 0 on padding.
    """
    kl = KL_ESTIMATORS.get(estimator)(logp.detach(), logp_ref.detach())
    r = token_rewards(rewards, mask)
    return torch.where(mask > 0, r - kl_coef * kl.to(r.dtype), 0.0)
