"""Advantage estimators, their inputs record, and the masked statistics they share with the losses.

Every estimator has one signature and registers in ``perceptrl.registry.ADVANTAGES``::

    @ADVANTAGES.register("grpo")
    def grpo(inp: AdvantageInputs, cfg: AlgoConfig) -> (advantages [B, T], returns [B, T], metrics)

and declares there what it reads besides ``rewards``, ``mask`` and ``group_id``
(``needs=("values", "bootstrap_value")`` for gae, ``("segments",)`` for the tree estimators,
``("step_rewards",)`` for prime): the trainer fills only those fields of the record. An
estimator that does not read ``step_rewards`` gets outcome + ``cfg.process_coef`` * process as
[B, T] ``rewards``. ``per_step=True`` says it credits each step from per-step rewards and a
critic (gae), which a VLA run reads to collect PPO segments rather than whole-episode groups.

``mask`` [B, T] is 1 on the policy's own tokens/steps and 0 elsewhere: trailing padding, and
also interior holes (observations the policy did not write, e.g. a tool result inside a
multi-turn episode). A hole gets no advantage of its own, does not reset a return, and a later
reward reaches earlier policy tokens across it. ``rewards`` is [B] (one per sequence, placed at
the last policy token when a token-level view is needed) or [B, T] (per token; values at masked
positions are dropped, so a reward must sit on a policy token). Advantages and returns are
detached and zero on masked positions.

Semantics follow verl's ``core_algos`` estimators; where they differ, the docstring says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..registry import ADVANTAGES

if TYPE_CHECKING:
    from .config import AlgoConfig

WHITEN_EPS = 1e-8  # verl's masked_whiten: added to the variance


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator reads of a scored batch. The optional fields are filled only when the
    estimator declares them in ``needs`` (and the batch has them)."""

    rewards: Tensor  # [B] (one per sequence) or [B, T] (per token/step)
    mask: Tensor  # [B, T], 1 on the policy's own tokens/steps
    group_id: Tensor  # [B], rows with one id share a prompt or an initial state
    values: Tensor | None = None  # [B, T], the critic's values at rollout time
    bootstrap_value: Tensor | None = None  # [B], value after a truncated episode (else None)
    segments: Tensor | None = None  # [B, T], tree node of each token (0 on padding)
    step_rewards: Tensor | None = None  # [B, T], process rewards on the tokens that end a step


OPTIONAL_INPUTS = ("values", "bootstrap_value", "segments", "step_rewards")
"""the fields of `AdvantageInputs` an estimator may declare in ``needs``"""


def declared_needs(name: str) -> tuple[str, ...]:
    """The optional inputs that estimator ``name`` declared at registration (``needs``);
    `UnknownName` for an unregistered name, ValueError for a need that is no input."""
    needs = tuple(ADVANTAGES.meta(name)["needs"])
    unknown = [k for k in needs if k not in OPTIONAL_INPUTS]
    if unknown:
        raise ValueError(
            f"advantage estimator {name!r} declares needs={needs}; {', '.join(unknown)} is no "
            f"field of AdvantageInputs (an estimator may need {', '.join(OPTIONAL_INPUTS)})"
        )
    return needs


# ----------------------------------------------------------------------------- masked statistics


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


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    eps: float = WHITEN_EPS,
    *,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the valid positions; 0 on masked positions.

    As verl's ``masked_whiten``: unbiased variance (n - 1) and the epsilon (1e-8) added to the
    variance, not to the std. Differs where verl raises: a single valid value (or none) whitens
    to 0 instead of stopping the run (x - mean is 0 there anyway).

    Args:
        x, mask: [B, T].
        eps: added to the variance.
        all_reduce: sums a tensor over data-parallel ranks (e.g. ``engine.all_reduce_sum``);
            the count, mean and variance are then those of every rank's valid positions.
    Returns:
        [B, T] whitened values, 0 where ``mask`` is 0.
    """
    total = all_reduce or (lambda t: t)
    valid = mask > 0
    n = total(valid.sum().to(x.dtype))
    mean = total(torch.where(valid, x, 0.0).sum()) / n.clamp(min=1)
    dev = torch.where(valid, x - mean, 0.0)
    var = total(dev.square().sum()) / (n - 1).clamp(min=1)
    return dev * torch.rsqrt(var + eps)


def as_float(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Token-level view of ``rewards``: [B, T] is masked; [B] goes to the last valid token.

    Returns:
        [B, T] rewards, zero on masked positions (a row without valid tokens gets nothing).
    """
    valid = mask > 0
    r = as_float(rewards.detach())
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


def seq_rewards(rewards: Tensor, mask: Tensor | None) -> Tensor:
    """[B] sequence rewards: as given, or the sum of valid per-token rewards."""
    r = as_float(rewards.detach())
    if r.dim() == 1:
        return r
    if mask is None:
        return r.sum(dim=-1)
    return torch.where(mask > 0, r, 0.0).sum(dim=-1)


def group_index(group_id: Tensor) -> tuple[Tensor, int]:
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


def group_baseline(r: Tensor, group_id: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row group size, baseline mean and std, each [B], plus the per-group std [G].

    A group of one has no baseline: mean 0 and std 1 (verl's convention), so its row keeps its
    raw reward (plain REINFORCE) rather than losing its signal.
    """
    inv, n_groups = group_index(group_id)
    count, mean, std = _group_stats(r, inv, n_groups)
    single = count < 2
    mean_b = torch.where(single, 0.0, mean)[inv]
    std_b = torch.where(single, 1.0, std)[inv]
    return count[inv], mean_b, std_b, torch.where(single, 0.0, std)


def broadcast_rows(score: Tensor, mask: Tensor) -> Tensor:
    """[B] score -> [B, T] on valid tokens, 0 on masked positions."""
    return torch.where(mask > 0, score[:, None], 0.0)


def adv_metrics(adv: Tensor, mask: Tensor, **extra: Tensor | float) -> dict[str, float]:
    mean = masked_mean(adv, mask)
    std = masked_mean((adv - mean).square(), mask).sqrt()
    return _floats({"mean": mean, "std": std, **extra})


# ----------------------------------------------------------------------------- estimators


@ADVANTAGES.register("grpo")
def grpo(inp: AdvantageInputs, cfg: AlgoConfig):
    """GRPO: ``(r - mean_g) / (std_g + eps)`` per group, broadcast over valid tokens.

    As verl's ``grpo``: unbiased group std, ``cfg.eps`` added to the std, and a group of one
    keeps its reward (mean 0, std 1: ``r / (1 + eps)``). ``cfg.norm_by_std=False`` gives
    Dr.GRPO (``r - mean_g``; a singleton keeps ``r``). [B, T] rewards are summed over valid
    tokens first. Returns are the advantages (no critic).

    Args:
        inp: ``rewards`` [B] or [B, T], ``mask`` [B, T], ``group_id`` [B].
    Returns:
        advantages [B, T], returns [B, T], metrics (``group_zero_std_frac``: groups without a
        group-relative signal, singletons included).
    """
    mask = inp.mask
    r = seq_rewards(inp.rewards, mask)
    _, mean, std, group_std = group_baseline(r, inp.group_id)
    score = r - mean
    if cfg.norm_by_std:
        score = score / (std + cfg.eps)
    adv = broadcast_rows(score, mask)
    zero = (group_std <= cfg.eps).float().mean()
    return adv, adv, adv_metrics(adv, mask, group_zero_std_frac=zero)


@ADVANTAGES.register("rloo")
def rloo(inp: AdvantageInputs, cfg: AlgoConfig):
    """RLOO: ``r_i - mean(r_j, j != i)`` = ``G / (G - 1) * (r_i - mean_g)``.

    A group of one has no other member to average and keeps its reward, as verl's ``rloo``
    (its ``rloo_vectorized`` gives 0 instead; we follow the estimator named ``rloo``).
    Args/Returns as :func:`grpo` (returns are the advantages).
    """
    r = seq_rewards(inp.rewards, inp.mask)
    g, mean, _, _ = group_baseline(r, inp.group_id)
    score = torch.where(g > 1, g / (g - 1).clamp(min=1) * (r - mean), r)
    adv = broadcast_rows(score, inp.mask)
    return adv, adv, adv_metrics(adv, inp.mask)


def discounted_returns(r: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Returns-to-go ``G_t = r_t + gamma * G_{t'}`` where t' is the next valid position. [B, T].

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


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(inp: AdvantageInputs, cfg: AlgoConfig):
    """REINFORCE++: token-level discounted returns-to-go (``cfg.gamma``), whitened over all
    valid tokens of the batch (:func:`masked_whiten`, as verl).

    Differs from verl at interior holes: verl's recursion zeroes the running return at every
    masked position (its "reset after EOS", written for right padding), so a reward in a later
    turn never reaches the tokens of earlier turns. Here a hole is skipped: no reset, no
    discount step, no advantage of its own (as verl's own GAE treats holes). On right-padded
    masks the two agree. A [B] reward sits at
    the last valid token. ``returns`` are the un-whitened returns-to-go (0 on masked positions).
    """
    mask = inp.mask
    ret = discounted_returns(token_rewards(inp.rewards, mask), mask, cfg.gamma)
    adv = masked_whiten(ret, mask)
    return adv, ret, adv_metrics(adv, mask, returns_mean=masked_mean(ret, mask))


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline(inp: AdvantageInputs, cfg: AlgoConfig):
    """REINFORCE++ with a group baseline (verl ``reinforce_plus_plus_baseline``): subtract the
    group mean of the sequence rewards, broadcast over valid tokens, then whiten over all valid
    tokens of the batch. A group of one keeps its reward (baseline 0, as verl) before
    whitening. Returns are the advantages.
    """
    mask = inp.mask
    r = seq_rewards(inp.rewards, mask)
    _, mean, _, _ = group_baseline(r, inp.group_id)
    adv = masked_whiten(broadcast_rows(r - mean, mask), mask)
    return adv, adv, adv_metrics(adv, mask)


@ADVANTAGES.register("gae", needs=("values", "bootstrap_value"), per_step=True)
def gae(inp: AdvantageInputs, cfg: AlgoConfig):
    """Generalised advantage estimation (``cfg.gamma``, ``cfg.lam``) for critic policies.

    Masked positions (padding and interior holes) are skipped, as in verl's
    ``compute_gae_advantage_return``: the step after a valid step t is the next valid step, so
    its value is t's next value and its advantage is carried back to t with one factor of
    ``gamma * lam``. After the last valid step the next value is ``bootstrap_value`` [B] (the
    value of the state after a truncated episode) or 0 (terminated). Rewards are per step
    [B, T] or one [B] reward at the last valid step.

    Differs from verl in one place: verl also whitens the advantages inside the estimator; here
    the loop does that (``algo.whiten_advantages``, over every data-parallel rank), so set it
    to get verl's GAE. returns = advantages + values.

    Args:
        inp: ``rewards`` [B] or [B, T], ``mask`` [B, T], ``values`` [B, T] (the critic's at
            rollout time, required), ``bootstrap_value`` [B] or None.
    Returns:
        advantages [B, T], returns [B, T], metrics; all zero on masked positions.
    """
    mask, values, bootstrap_value = inp.mask, inp.values, inp.bootstrap_value
    if values is None:
        raise ValueError(
            "gae needs values [B, T] from a critic; the policy returned no value "
            "head (use adv_estimator grpo / rloo / reinforce_pp instead)"
        )
    valid = mask > 0
    r = token_rewards(inp.rewards, mask)
    v = torch.where(valid, values.detach().to(r.dtype), 0.0)
    B = mask.shape[0]
    next_v = (
        torch.zeros(B, dtype=r.dtype, device=r.device)
        if bootstrap_value is None
        else bootstrap_value.detach().to(r.dtype).reshape(B)
    )
    last = torch.zeros_like(next_v)  # advantage of the next valid step, (B,)
    out = []
    for t in reversed(range(r.shape[1])):
        ok = valid[:, t]
        delta = r[:, t] + cfg.gamma * next_v - v[:, t]
        last = torch.where(ok, delta + cfg.gamma * cfg.lam * last, last)
        next_v = torch.where(ok, v[:, t], next_v)
        out.append(torch.where(ok, last, 0.0))
    adv = torch.stack(out[::-1], dim=1) if out else r
    ret = torch.where(valid, adv + v, 0.0)
    return adv, ret, adv_metrics(adv, mask, returns_mean=masked_mean(ret, mask))


def _log_comb(n: Tensor, k: Tensor) -> Tensor:
    """log C(n, k) for 0 <= k <= n (float64 tensors)."""
    return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)


@ADVANTAGES.register("grpo_passk")
def grpo_passk(inp: AdvantageInputs, cfg: AlgoConfig):
    """Pass@k advantage ("Pass@k Training", Chen et al. 2025, analytical form) for binary rewards.

    A sample succeeds when its sequence reward is >= 0.5. For a group of N samples, N_neg of them
    failed, and k = ``cfg.passk_k`` (0 uses N // 2, at least 1; k > N uses N):

    * mean pass@k of the group: ``R = 1 - C(N_neg, k) / C(N, k)``, ``std = sqrt(R (1 - R))``
    * success: ``(1 - R) / std``; failure: ``(1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / std``

    The advantages of a group sum to zero; groups with std 0 (all equal, or every k-subset passes,
    e.g. k = N with one success) get 0, and so does a group of one. With k = 1 this is GRPO with
    the population std, so k must be below the group size to give a learning signal to mixed
    groups. (Not verl's ``grpo_passk``, which credits only the best sample of a group.)
    """
    r = seq_rewards(inp.rewards, inp.mask)
    inv, n_groups = group_index(inp.group_id)
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
    adv = broadcast_rows(score, inp.mask)
    return adv, adv, adv_metrics(adv, inp.mask, passk_mean=mean.mean())


# ----------------------------------------------------------------------------- process rewards


def _masked_rloo(x: Tensor, mask: Tensor, group_id: Tensor) -> Tensor:
    """PRIME's leave-one-out of a [B, T] reward: ``x_t - mean(m_j, j != i) + (x_t - m_i) / (n - 1)``
    on the valid tokens, where ``m_i`` is row i's mean over its valid tokens and n its group's
    size (``x_t n / (n - 1) - sum_j m_j / (n - 1)``); a group of one keeps its reward."""
    valid = mask > 0
    x = torch.where(valid, x, 0.0)
    row_mean = x.sum(1) / valid.sum(1).clamp(min=1)
    g, mean, _, _ = group_baseline(row_mean, group_id)
    n = g[:, None]
    out = torch.where(n > 1, (x * n - (g * mean)[:, None]) / (n - 1).clamp(min=1), x)
    return torch.where(valid, out, 0.0)


@ADVANTAGES.register("prime", needs=("step_rewards",))
def prime(inp: AdvantageInputs, cfg: AlgoConfig):
    """PRIME's advantage (Cui et al. 2025), as ``compute_rloo_advantage_return`` in verl's
    ``recipe/prime/prime_core_algos.py`` (volcengine/verl at 246cac4) with its released config
    (``recipe/prime/config/prime_trainer.yaml``).

    Outcome and process rewards each go through PRIME's leave-one-out, per group: the outcome
    (one reward per row, on its last valid token) becomes ``r_i - mean(r_j, j != i)``; every valid
    token of the process rewards ``step_rewards`` becomes ``p_t - mean(m_j, j != i) +
    (p_t - m_i) / (n - 1)``, with ``m_i`` the row's mean process reward per valid token. The sum
    ``cfg.outcome_coef * outcome + cfg.process_coef * process`` (PRIME's ``reward_gt_coef`` and
    ``reward_dpo_coef``, 5 and 5 released, the same as 1 and 1 after whitening) is summed into
    returns-to-go (``cfg.gamma``, 1 in PRIME) and whitened over every valid token of the batch
    (``cfg.prime_whiten``). Without ``step_rewards`` the process term is absent.

    Differs from PRIME where this project's conventions differ: masked positions get 0 (PRIME
    leaves ``-mean / std`` on padding, which its loss masks out); a group of one keeps its
    rewards (PRIME divides by zero); interior holes are skipped by the returns as in
    :func:`reinforce_pp`. PRIME's process reward is its implicit PRM's dense log-ratio scaled
    by the batch's largest return; here it is whatever ``rollout.process_reward`` gives
    (``implicit_prm`` is PRIME's, without that scaling).

    Args:
        inp: ``rewards``, ``mask``, ``group_id`` as ``rloo``; ``step_rewards`` [B, T]: process
            rewards on the tokens that end each step (0 elsewhere), or None.
    Returns:
        advantages [B, T], returns [B, T] (the un-whitened returns-to-go), metrics
        (``process_mean``, ``outcome_mean``: the two leave-one-out terms per valid token).
    """
    mask = inp.mask
    last = token_rewards(seq_rewards(inp.rewards, mask), mask)  # the outcome on the last token
    outcome = _masked_rloo(last, _last_token(mask), inp.group_id)
    process = torch.zeros_like(outcome)
    if inp.step_rewards is not None:
        process = _masked_rloo(as_float(inp.step_rewards.detach()), mask, inp.group_id)
    final = cfg.outcome_coef * outcome + cfg.process_coef * process
    ret = discounted_returns(final, mask, cfg.gamma)
    adv = masked_whiten(ret, mask) if cfg.prime_whiten else ret
    return (
        adv,
        ret,
        adv_metrics(
            adv,
            mask,
            process_mean=masked_mean(process, mask),
            outcome_mean=masked_mean(broadcast_rows(outcome.sum(1), mask), mask),
        ),
    )


def _last_token(mask: Tensor) -> Tensor:
    """[B, T] mask of each row's last valid token."""
    return (token_rewards(torch.ones(mask.shape[0], device=mask.device), mask) > 0).float()
