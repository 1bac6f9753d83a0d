"""The shared RL algorithm core: advantage estimators, policy losses, KL estimators, aggregation.

Everything here is a pure tensor function (torch only, no model code), looked up by name in a
registry so the training loop never special-cases an algorithm. One signature per kind:

* advantage estimator: ``fn(rewards, mask, group_id, cfg, values=None, bootstrap_value=None)
  -> (advantages [B, T], returns [B, T], metrics)``
* policy loss: ``fn(logp, logp_old, advantages, mask, cfg, *, is_weight=None, num_tokens=None,
  num_seqs=None) -> (loss [], metrics)``
* KL estimator: ``fn(logp, logp_ref) -> kl [B, T]`` (per token, not masked)

Conventions: ``mask`` [B, T] is 1 on tokens/steps that count and 0 on padding (0/1 values).
``rewards`` is [B] (one per sequence; placed at the last valid token when a token-level view is
needed) or [B, T] (per token / per step, e.g. KL folded into the reward or VLA step rewards).
Advantages and returns are detached and zero on padding. ``num_tokens`` / ``num_seqs`` are the
global normalisers of the whole (mini)batch, so that summing the losses of micro-batches gives
exactly the full-batch loss and gradient. Metrics are python floats with flat names; the loop adds
its own prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from .config import AlgoConfig

AdvantageFn = Callable[..., tuple[Tensor, Tensor, dict[str, float]]]
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, float]]]
KLFn = Callable[[Tensor, Tensor], Tensor]
F = TypeVar("F", bound=Callable)

ADVANTAGES: dict[str, AdvantageFn] = {}
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
KL_ESTIMATORS: dict[str, KLFn] = {}
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

_LOG_RATIO_CLAMP = 20.0  # |logp - logp_old| beyond this is clamped before exp (as verl)


# ----------------------------------------------------------------------------- registries


def _register(table: dict, kind: str, name: str) -> Callable[[F], F]:
    def deco(fn: F) -> F:
        old = table.get(name, fn)
        if (old.__module__, old.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(
                f"{kind} {name!r} is already registered by {old.__module__}.{old.__qualname__}; "
                f"register {fn.__qualname__} under another name"
            )
        table[name] = fn
        return fn

    return deco


def _lookup(table: dict, kind: str, field: str, name: str):
    if name not in table:
        raise ValueError(
            f"unknown {kind} {name!r}; valid names: {', '.join(sorted(table))}. "
            f"Set {field} to one of them, or register a new one in perceptrl.trainer.algos."
        )
    return table[name]


def register_advantage(name: str) -> Callable[[F], F]:
    """Decorator: register an advantage estimator under ``name`` (see module docstring)."""
    return _register(ADVANTAGES, "advantage estimator", name)


def get_advantage(name: str) -> AdvantageFn:
    """The advantage estimator registered as ``name``; ValueError listing valid names if none."""
    return _lookup(ADVANTAGES, "advantage estimator", "algo.adv_estimator", name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Decorator: register a policy loss under ``name`` (see module docstring)."""
    return _register(POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``; ValueError listing valid names if none."""
    return _lookup(POLICY_LOSSES, "policy loss", "algo.policy_loss", name)


def register_kl(name: str) -> Callable[[F], F]:
    """Decorator: register a per-token KL estimator ``fn(logp, logp_ref) -> [B, T]``."""
    return _register(KL_ESTIMATORS, "KL estimator", name)


def get_kl(name: str) -> KLFn:
    """The KL estimator registered as ``name``; ValueError listing valid names if none."""
    return _lookup(KL_ESTIMATORS, "KL estimator", "algo.kl_estimator", name)


# ----------------------------------------------------------------------------- helpers


def _floats(vals: dict[str, Tensor | float]) -> dict[str, float]:
    """Scalar tensors and numbers -> python floats, with a single host sync."""
    tens = {k: v for k, v in vals.items() if isinstance(v, Tensor)}
    out = {k: float(v) for k, v in vals.items() if not isinstance(v, Tensor)}
    if tens:
        flat = torch.stack([v.detach().reshape(()).float() for v in tens.values()]).tolist()
        out.update(zip(tens, flat))
    return {k: out[k] for k in vals}


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` [B, T] over positions where ``mask`` > 0; 0 when nothing is valid."""
    valid = mask > 0
    return torch.where(valid, x, 0.0).sum() / valid.sum().clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over the valid positions of the whole batch; 0 on padding.

    The std is unbiased (n - 1), as verl's ``masked_whiten``.
    """
    valid = mask > 0
    n = valid.sum()
    mean = torch.where(valid, x, 0.0).sum() / n.clamp(min=1)
    dev = torch.where(valid, x - mean, 0.0)
    std = (dev.square().sum() / (n - 1).clamp(min=1)).sqrt()
    return dev / (std + eps)


def _as_float(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Token-level view of ``rewards``: [B, T] is masked; [B] goes to the last valid token.

    Returns:
        [B, T] rewards, zero on padding (a row without valid tokens gets nothing).
    """
    valid = mask > 0
    r = _as_float(rewards.detach())
    if r.dim() == 2:
        if r.shape != mask.shape:
            raise ValueError(f"rewards {tuple(r.shape)} must match mask {tuple(mask.shape)}")
        return torch.where(valid, r, 0.0)
    if r.dim() != 1 or r.shape[0] != mask.shape[0]:
        raise ValueError(
            f"rewards must be [B] or [B, T]; got {tuple(r.shape)} for mask {tuple(mask.shape)}"
        )
    pos = torch.arange(mask.shape[1], device=mask.device)  # (T,)
    last = torch.where(valid, pos, -1).amax(dim=1)  # (B,), -1 for empty rows
    return torch.where(pos[None, :] == last[:, None], r[:, None], 0.0)


def _seq_rewards(rewards: Tensor, mask: Tensor | None) -> Tensor:
    """[B] sequence rewards: as given, or the sum of valid per-token rewards."""
    r = _as_float(rewards.detach())
    if r.dim() == 1:
        return r
    if mask is None:
        return r.sum(dim=-1)
    return torch.where(mask > 0, r, 0.0).sum(dim=-1)


def _group_index(group_id: Tensor) -> tuple[Tensor, int]:
    """group_id [B] (any ids) -> (dense index [B] in [0, G), G)."""
    uniq, inv = torch.unique(group_id, return_inverse=True)
    return inv, int(uniq.numel())


def _group_stats(r: Tensor, inv: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group (count, mean, unbiased std), each [G]; std is 0 for single-member groups."""
    zeros = torch.zeros(n_groups, dtype=r.dtype, device=r.device)
    count = zeros.index_add(0, inv, torch.ones_like(r))
    mean = zeros.index_add(0, inv, r) / count
    dev = r - mean[inv]
    var = zeros.index_add(0, inv, dev.square()) / (count - 1).clamp(min=1)
    return count, mean, var.sqrt()


def _broadcast(score: Tensor, mask: Tensor) -> Tensor:
    """[B] score -> [B, T] on valid tokens, 0 on padding."""
    return torch.where(mask > 0, score[:, None], 0.0)


def _adv_metrics(adv: Tensor, mask: Tensor, **extra: Tensor | float) -> dict[str, float]:
    mean = masked_mean(adv, mask)
    std = masked_mean((adv - mean).square(), mask).sqrt()
    return _floats({"mean": mean, "std": std, **extra})


# ----------------------------------------------------------------------------- advantages


@register_advantage("grpo")
def grpo(rewards, mask, group_id, cfg: AlgoConfig, values=None, bootstrap_value=None):
    """GRPO: ``(r - mean_g) / (std_g + eps)`` per group, broadcast over valid tokens.

    The group std is unbiased (``torch.std`` default, as verl). ``cfg.norm_by_std=False`` gives
    Dr.GRPO (``r - mean_g``). Single-member groups get advantage 0 (r - mean_g is exactly 0, and
    so is 0 / (0 + eps)). [B, T] rewards are summed over valid tokens first. Returns are the
    advantages (no critic).

    Args:
        rewards [B] or [B, T], mask [B, T], group_id [B]; values/bootstrap_value unused.
    Returns:
        advantages [B, T], returns [B, T], metrics.
    """
    r = _seq_rewards(rewards, mask)
    inv, n_groups = _group_index(group_id)
    count, mean, std = _group_stats(r, inv, n_groups)
    score = r - mean[inv]
    if cfg.norm_by_std:
        score = score / (std[inv] + cfg.eps)
    adv = _broadcast(score, mask)
    zero = ((std <= cfg.eps) | (count < 2)).float().mean()
    return adv, adv, _adv_metrics(adv, mask, group_zero_std_frac=zero)


@register_advantage("rloo")
def rloo(rewards, mask, group_id, cfg: AlgoConfig, values=None, bootstrap_value=None):
    """RLOO: ``r_i - mean(r_j, j != i)`` = ``G / (G - 1) * (r_i - mean_g)``; groups of 1 get 0.

    Args/Returns as :func:`grpo` (returns are the advantages).
    """
    r = _seq_rewards(rewards, mask)
    inv, n_groups = _group_index(group_id)
    count, mean, _ = _group_stats(r, inv, n_groups)
    g = count[inv]
    score = torch.where(g > 1, g / (g - 1).clamp(min=1) * (r - mean[inv]), 0.0)
    adv = _broadcast(score, mask)
    return adv, adv, _adv_metrics(adv, mask)


def _discounted_returns(r: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Returns-to-go ``G_t = r_t + gamma * G_{t+1}`` over the valid positions of each row. [B, T].

    Masked positions are skipped, not reset: a hole in the mask (e.g. a tool response inside a
    multi-turn completion) passes the return through undiscounted and gets 0 itself.
    """
    valid = mask > 0
    running = torch.zeros_like(r[:, :0].sum(dim=1))  # (B,)
    out = []
    for t in reversed(range(r.shape[1])):
        running = torch.where(valid[:, t], r[:, t] + gamma * running, running)
        out.append(torch.where(valid[:, t], running, 0.0))
    return torch.stack(out[::-1], dim=1) if out else r


@register_advantage("reinforce_pp")
def reinforce_pp(rewards, mask, group_id, cfg: AlgoConfig, values=None, bootstrap_value=None):
    """REINFORCE++: token-level discounted returns-to-go (``cfg.gamma``), whitened over all
    valid tokens of the batch (masked mean, unbiased masked std + eps).

    A [B] reward sits at the last valid token. ``returns`` are the un-whitened returns-to-go.
    """
    ret = _discounted_returns(token_rewards(rewards, mask), mask, cfg.gamma)
    adv = masked_whiten(ret, mask, cfg.eps)
    return adv, ret, _adv_metrics(adv, mask, returns_mean=masked_mean(ret, mask))


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(
    rewards, mask, group_id, cfg: AlgoConfig, values=None, bootstrap_value=None
):
    """REINFORCE++ with a group baseline (verl ``reinforce_plus_plus_baseline``): subtract the
    group mean of the sequence rewards, broadcast over valid tokens, then whiten over all valid
    tokens of the batch. A single-member group is centred on itself (0 before whitening).
    Returns are the advantages.
    """
    r = _seq_rewards(rewards, mask)
    inv, n_groups = _group_index(group_id)
    _, mean, _ = _group_stats(r, inv, n_groups)
    adv = masked_whiten(_broadcast(r - mean[inv], mask), mask, cfg.eps)
    return adv, adv, _adv_metrics(adv, mask)


@register_advantage("gae")
def gae(rewards, mask, group_id, cfg: AlgoConfig, values=None, bootstrap_value=None):
    """Generalised advantage estimation (``cfg.gamma``, ``cfg.lam``) for critic policies.

    ``mask`` must be right-padded (ones then zeros per row). After the last valid step the next
    value is ``bootstrap_value`` [B] (the value of the state after a truncated episode) or 0
    (terminated). Rewards are per step [B, T] or one [B] reward at the last valid step.
    The advantages are NOT whitened here (the loop may); returns = advantages + values.

    Args:
        values [B, T]: critic values at rollout time (required).
    Returns:
        advantages [B, T], returns [B, T], metrics; all zero on padding.
    """
    if values is None:
        raise ValueError(
            "gae needs values [B, T] from a critic; the policy returned no value "
            "head (use adv_estimator grpo / rloo / reinforce_pp instead)"
        )
    valid = mask > 0
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError(
            "gae expects right-padded masks (ones then zeros in every row); got a "
            "valid step after padding"
        )
    r = token_rewards(rewards, mask)
    v = torch.where(valid, values.detach().to(r.dtype), 0.0)
    B = mask.shape[0]
    boot = (
        torch.zeros(B, dtype=r.dtype, device=r.device)
        if bootstrap_value is None
        else bootstrap_value.detach().to(r.dtype).reshape(B)
    )
    pad = torch.zeros_like(valid[:, :1])
    next_valid = torch.cat([valid[:, 1:], pad], dim=1)  # (B, T)
    next_v = torch.where(next_valid, torch.cat([v[:, 1:], v[:, :1] * 0], dim=1), boot[:, None])
    delta = r + cfg.gamma * next_v - v  # (B, T)
    carry = next_valid.to(r.dtype) * (cfg.gamma * cfg.lam)
    last = torch.zeros_like(boot)
    out = []
    for t in reversed(range(r.shape[1])):
        last = delta[:, t] + carry[:, t] * last
        out.append(last)
    adv = torch.where(valid, torch.stack(out[::-1], dim=1), 0.0) if out else r
    ret = torch.where(valid, adv + v, 0.0)
    return adv, ret, _adv_metrics(adv, mask, returns_mean=masked_mean(ret, mask))


def _log_comb(n: Tensor, k: Tensor) -> Tensor:
    """log C(n, k) for 0 <= k <= n (float64 tensors)."""
    return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)


@register_advantage("grpo_passk")
def grpo_passk(rewards, mask, group_id, cfg: AlgoConfig, values=None, bootstrap_value=None):
    """Pass@k advantage ("Pass@k Training", Chen et al. 2025, analytical form) for binary rewards.

    A sample succeeds when its sequence reward is >= 0.5. For a group of N samples, N_neg of them
    failed, and k = ``cfg.passk_k`` (0 uses N // 2, at least 1; k > N uses N):

    * mean pass@k of the group: ``R = 1 - C(N_neg, k) / C(N, k)``, ``std = sqrt(R (1 - R))``
    * success: ``(1 - R) / std``; failure: ``(1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / std``

    The advantages of a group sum to zero; groups with std 0 (all equal, or every k-subset passes,
    e.g. k = N with one success) get 0. With k = 1 this is GRPO with the population std, so k
    must be below the group size to give a learning signal to mixed groups.
    """
    r = _seq_rewards(rewards, mask)
    inv, n_groups = _group_index(group_id)
    ok = (r >= 0.5).double()
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=r.device)
    n = zeros.index_add(0, inv, torch.ones_like(ok))
    n_neg = n - zeros.index_add(0, inv, ok)
    k = (n // 2).clamp(min=1) if cfg.passk_k <= 0 else n.clamp(max=float(cfg.passk_k))
    p_fail = torch.where(n_neg >= k, torch.exp(_log_comb(n_neg, k) - _log_comb(n, k)), 0.0)
    mean = 1.0 - p_fail
    std = (mean * (1.0 - mean)).clamp(min=0).sqrt()
    has_neg = (n_neg >= 1) & (n_neg - 1 >= k - 1)
    neg_term = torch.where(
        has_neg, torch.exp(_log_comb(n_neg - 1, k - 1) - _log_comb(n - 1, k - 1)), 0.0
    )
    safe = std.clamp(min=1e-300)
    a_pos, a_neg = (1.0 - mean) / safe, (1.0 - mean - neg_term) / safe
    score = torch.where(ok > 0, a_pos[inv], a_neg[inv])
    score = torch.where(std[inv] > 0, score, 0.0).to(r.dtype)
    adv = _broadcast(score, mask)
    return adv, adv, _adv_metrics(adv, mask, passk_mean=mean.mean())


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
    """Reduce a per-token loss [B, T] to a scalar.

    Modes:
        token-mean: ``sum(loss * mask) / num_tokens`` (default ``mask.sum()``).
        seq-mean-token-sum: per-sequence token sum, summed and divided by ``num_seqs`` (default B).
        seq-mean-token-mean: per-sequence token mean, summed and divided by ``num_seqs``.
        seq-mean-token-sum-norm: per-sequence token sum / ``norm_len`` (default T), summed and
            divided by ``num_seqs`` (Dr.GRPO's constant normaliser).

    Pass the global ``num_tokens`` / ``num_seqs`` of the whole minibatch when calling on
    micro-batches: the sum of the micro-batch losses is then the full-batch loss. Padding values
    (even NaN/inf) are ignored; an all-masked batch gives 0.
    """
    if mode not in AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(AGG_MODES)} "
            f"(set algo.loss_agg_mode)"
        )
    valid = mask > 0
    loss = torch.where(valid, loss_mat, 0.0)
    if mode == "token-mean":
        return _safe_div(loss.sum(), valid.sum() if num_tokens is None else num_tokens)
    seq = loss.sum(dim=-1)  # (B,)
    if mode == "seq-mean-token-mean":
        seq = seq / valid.sum(dim=-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        seq = seq / (norm_len or loss_mat.shape[-1] or 1)
    return _safe_div(seq.sum(), loss_mat.shape[0] if num_seqs is None else num_seqs)


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


@register_policy_loss("ppo_clip")
def ppo_clip(
    logp, logp_old, advantages, mask, cfg, *, is_weight=None, num_tokens=None, num_seqs=None
):
    """PPO clipped surrogate with asymmetric clip and optional dual clip.

    ``loss_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; with ``dual_clip_c`` = c > 1,
    tokens with A < 0 use ``min(loss_t, -A c)``. Multiplied by ``is_weight`` (detached), then
    aggregated with ``cfg.loss_agg_mode``.

    Args:
        logp [B, T] (with grad), logp_old [B, T], advantages [B, T], mask [B, T],
        cfg (AlgoConfig), is_weight [B, T] or None, num_tokens / num_seqs: global normalisers.
    Returns:
        scalar loss; metrics clipfrac, approx_kl (k3, old vs new), ratio_mean (+ clipfrac_dual).
    """
    c = cfg.dual_clip_c
    if 0 < c <= 1:
        raise ValueError(f"algo.dual_clip_c must be > 1 to enable dual clip (or 0); got {c}")
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


@register_policy_loss("gspo")
def gspo(logp, logp_old, advantages, mask, cfg, *, is_weight=None, num_tokens=None, num_seqs=None):
    """GSPO (Zheng et al. 2025), token-level form.

    Sequence ratio ``s_i = exp(mean_t (logp - logp_old))`` over valid tokens; token ratio
    ``s_it = sg[s_i] * exp(logp_t - sg[logp_t])`` (value s_i, gradient s_i * d logp_t);
    ``loss_t = max(-A s_it, -A clip(s_it, 1 - gspo_clip_low, 1 + gspo_clip_high))``.
    Always aggregated ``seq-mean-token-mean`` as in the paper (``cfg.loss_agg_mode`` is ignored),
    so that with per-sequence advantages the gradient is the paper's sequence-level one;
    ``num_seqs`` is the global normaliser (``num_tokens`` is unused).
    """
    valid = mask > 0
    log_ratio = _log_ratio(logp, logp_old, valid)
    seq_log = log_ratio.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)  # (B,)
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


@register_policy_loss("cispo")
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
    Always aggregated token-mean with the global ``num_tokens`` (``num_seqs`` is accepted for a
    uniform call and unused).

    Args:
        values [B, T] (with grad), values_old [B, T] or None, returns [B, T], mask [B, T].
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
    loss = 0.5 * agg_loss(l1, mask, "token-mean", num_tokens=num_tokens)
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


@register_kl("k1")
def kl_k1(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k1 = logp - logp_ref (unbiased, high variance, can be negative). [B, T]."""
    return logp - logp_ref


@register_kl("k2")
def kl_k2(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k2 = 0.5 (logp - logp_ref)^2. [B, T]."""
    return 0.5 * (logp - logp_ref).square()


@register_kl("k3")
def kl_k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1 (unbiased, >= 0, low variance).

    As verl: the log ratio is clamped to [-20, 20] and the result to [-10, 10]. [B, T].
    """
    d = (logp_ref - logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1).clamp(-10.0, 10.0)


# ----------------------------------------------------------------------------- batch utilities


def filter_groups(rewards: Tensor, group_id: Tensor, tol: float = 1e-6) -> Tensor:
    """DAPO dynamic sampling: keep mask [B] (bool) that drops every group whose rewards are all
    equal within ``tol`` (max - min <= tol), which carries no group-relative signal. Single-member
    groups are dropped too. [B, T] rewards are summed over T first.
    """
    r = _seq_rewards(rewards, None)
    inv, n_groups = _group_index(group_id)
    hi = r.new_full((n_groups,), -math.inf).scatter_reduce(0, inv, r, "amax")  # (G,)
    lo = r.new_full((n_groups,), math.inf).scatter_reduce(0, inv, r, "amin")  # (G,)
    return (hi - lo)[inv] > tol


def filter_metrics(keep: Tensor, group_id: Tensor) -> dict[str, float]:
    """Fractions of samples and of groups kept by :func:`filter_groups`."""
    n_groups, kept_groups = torch.unique(group_id).numel(), torch.unique(group_id[keep]).numel()
    frac = float(keep.float().mean()) if keep.numel() else 0.0
    return {"filter_kept_frac": frac, "filter_kept_groups_frac": kept_groups / max(n_groups, 1)}


def truncated_is_weights(
    logp_old: Tensor, logp_rollout: Tensor, mask: Tensor, cap: float
) -> Tensor:
    """Truncated importance weights ``min(exp(logp_old - logp_rollout), cap)`` [B, T], detached,
    1 on padding. Corrects the mismatch between the rollout engine's and the trainer's log-probs.
    """
    if cap <= 0:
        raise ValueError(f"truncated_is_weights needs cap > 0 (algo.tis_cap); got {cap}")
    lw = (logp_old.detach() - logp_rollout.detach()).clamp(max=math.log(cap))
    return torch.where(mask > 0, torch.exp(lw), 1.0)


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
        estimator: name of a registered KL estimator (k1 | k2 | k3).
    Returns:
        [B, T] detached token rewards, 0 on padding.
    """
    kl = get_kl(estimator)(logp.detach(), logp_ref.detach())
    r = token_rewards(rewards, mask)
    return torch.where(mask > 0, r - kl_coef * kl.to(r.dtype), 0.0)
