"""Tests for trainer/algos.py and trainer/advantages.py: every estimator and loss against a plain
Python reference loop, hand-computed cases (the verl semantics, and each deliberate difference),
finite-difference gradients, registries and micro-batch invariance."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from perceptrl.trainer import advantages, algos
from perceptrl.trainer.algos import (
    ADVANTAGES,
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    agg_loss,
    filter_groups,
    filter_metrics,
    get_advantage,
    get_kl,
    get_policy_loss,
    kl_to_reward,
    truncated_is_weights,
    value_loss,
)
from perceptrl.trainer.config import AlgoConfig

DT = torch.float64
SHAPES = [(1, 1), (4, 5), (8, 3), (12, 7)]
PADDINGS = ["full", "random", "with_empty"]
SEEDS = [0, 1]
CASES = [(b, t, p, s) for (b, t) in SHAPES for p in PADDINGS for s in SEEDS]
CASE_IDS = [f"B{b}T{t}-{p}-s{s}" for (b, t, p, s) in CASES]
cases = pytest.mark.parametrize("B,T,padding,seed", CASES, ids=CASE_IDS)


# ----------------------------------------------------------------------------- input makers


def make_mask(B: int, T: int, padding: str) -> torch.Tensor:
    """Right-padded 0/1 mask [B, T] (call after torch.manual_seed)."""
    if padding == "full":
        lengths = [T] * B
    else:
        lengths = torch.randint(1, T + 1, (B,)).tolist()
        if padding == "with_empty":
            lengths[0] = 0
    return torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=DT)


def make_groups(B: int) -> torch.Tensor:
    """Group ids drawn from a few non-contiguous ids: varying sizes, singletons possible."""
    n_groups = int(torch.randint(1, 4, ()).item())
    return torch.tensor([42, 3, 17])[torch.randint(0, n_groups, (B,))]


def make_inputs(B, T, padding, seed, binary=False):
    torch.manual_seed(seed)
    mask = make_mask(B, T, padding)
    gid = make_groups(B)
    rewards = torch.randint(0, 2, (B,)).to(DT) if binary else torch.randn(B, dtype=DT)
    return rewards, mask, gid


def make_policy_inputs(B, T, padding, seed):
    torch.manual_seed(seed)
    mask = make_mask(B, T, padding)
    logp = -2 * torch.rand(B, T, dtype=DT)
    logp_old = logp + 0.4 * torch.randn(B, T, dtype=DT)
    adv = torch.randn(B, T, dtype=DT)
    is_w = 0.5 + torch.rand(B, T, dtype=DT)
    return logp, logp_old, adv, mask, is_w


def assert_close(x: torch.Tensor, ref, tol: float = 1e-9):
    torch.testing.assert_close(x.to(DT), torch.as_tensor(ref, dtype=DT), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- references
# Plain Python over lists: no tensors, no vectorisation.


def ref_seq_reward(r, m):
    if isinstance(r[0], list):
        return [sum(r[i][t] for t in range(len(m[i])) if m[i][t] > 0) for i in range(len(m))]
    return list(r)


def ref_token_rewards(r, m):
    out = []
    for i in range(len(m)):
        row = [0.0] * len(m[i])
        if isinstance(r[0], list):
            for t in range(len(m[i])):
                row[t] = r[i][t] if m[i][t] > 0 else 0.0
        else:
            last = max([t for t in range(len(m[i])) if m[i][t] > 0], default=-1)
            if last >= 0:
                row[last] = r[i]
        out.append(row)
    return out


def ref_groups(g):
    members = {}
    for i, gi in enumerate(g):
        members.setdefault(gi, []).append(i)
    return members


def ref_broadcast(score, m):
    return [[score[i] if m[i][t] > 0 else 0.0 for t in range(len(m[i]))] for i in range(len(m))]


def ref_grpo(r, m, g, norm, eps):
    r = ref_seq_reward(r, m)
    members = ref_groups(g)
    score = []
    for i in range(len(r)):
        vals = [r[j] for j in members[g[i]]]
        n = len(vals)
        mean, std = 0.0, 1.0  # a singleton group has no baseline (verl's convention)
        if n > 1:
            mean = sum(vals) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in vals) / (n - 1))
        s = r[i] - mean
        score.append(s / (std + eps) if norm else s)
    return ref_broadcast(score, m)


def ref_rloo(r, m, g):
    r = ref_seq_reward(r, m)
    members = ref_groups(g)
    score = []
    for i in range(len(r)):
        others = [r[j] for j in members[g[i]] if j != i]
        score.append(r[i] - sum(others) / len(others) if others else r[i])
    return ref_broadcast(score, m)


def ref_whiten(x, m, eps=1e-8):
    vals = [x[i][t] for i in range(len(m)) for t in range(len(m[i])) if m[i][t] > 0]
    n = len(vals)
    mean = sum(vals) / max(n, 1)
    var = sum((v - mean) ** 2 for v in vals) / max(n - 1, 1)
    return [
        [(x[i][t] - mean) / math.sqrt(var + eps) if m[i][t] > 0 else 0.0 for t in range(len(m[i]))]
        for i in range(len(m))
    ]


def ref_returns_to_go(r, m, gamma):
    out = []
    for i in range(len(m)):
        row, running = [0.0] * len(m[i]), 0.0
        for t in reversed(range(len(m[i]))):
            if m[i][t] > 0:  # masked positions are skipped, the return passes through them
                running = r[i][t] + gamma * running
                row[t] = running
        out.append(row)
    return out


def ref_gae(r, v, m, gamma, lam, boot):
    """GAE over the valid steps of each row in order; masked steps (padding or interior holes)
    are dropped, so the step after a valid one is the next valid one (or the bootstrap)."""
    tok = ref_token_rewards(r, m)
    adv, ret = [], []
    for i in range(len(m)):
        steps = [t for t in range(len(m[i])) if m[i][t] > 0]
        row = [0.0] * len(m[i])
        for k in reversed(range(len(steps))):
            t = steps[k]
            last = k + 1 == len(steps)
            next_v = (boot[i] if boot is not None else 0.0) if last else v[i][steps[k + 1]]
            delta = tok[i][t] + gamma * next_v - v[i][t]
            row[t] = delta + (0.0 if last else gamma * lam * row[steps[k + 1]])
        adv.append(row)
        ret.append([row[t] + v[i][t] if m[i][t] > 0 else 0.0 for t in range(len(m[i]))])
    return adv, ret


def ref_passk(r, m, g, k_cfg):
    r = ref_seq_reward(r, m)
    members = ref_groups(g)
    score = []
    for i in range(len(r)):
        idx = members[g[i]]
        n = len(idx)
        n_neg = sum(1 for j in idx if r[j] < 0.5)
        k = max(1, n // 2) if k_cfg <= 0 else min(k_cfg, n)
        mean = 1 - math.comb(n_neg, k) / math.comb(n, k)
        std = math.sqrt(mean * (1 - mean))
        if std == 0:
            score.append(0.0)
        elif r[i] >= 0.5:
            score.append((1 - mean) / std)
        else:
            score.append((1 - mean - math.comb(n_neg - 1, k - 1) / math.comb(n - 1, k - 1)) / std)
    return ref_broadcast(score, m)


def ref_agg(L, m, mode, num_tokens=None, num_seqs=None, norm_len=None):
    B, T = len(m), len(m[0]) if m else 0
    if mode == "token-mean":
        tot = sum(L[i][t] for i in range(B) for t in range(T) if m[i][t] > 0)
        n = num_tokens if num_tokens is not None else sum(sum(row) for row in m)
        return tot / n if n > 0 else 0.0
    seqs = []
    for i in range(B):
        n_i = sum(1 for x in m[i] if x > 0)
        if n_i == 0:
            continue  # a row without a valid token is not a sequence of the mean
        s = sum(L[i][t] for t in range(T) if m[i][t] > 0)
        if mode == "seq-mean-token-mean":
            s = s / n_i
        elif mode == "seq-mean-token-sum-norm":
            s = s / (norm_len or T)
        seqs.append(s)
    if mode == "seq-mean-token-sum-norm":
        return sum(seqs)  # verl: no division by the number of sequences
    n = num_seqs if num_seqs is not None else len(seqs)
    return sum(seqs) / n if n > 0 else 0.0


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def ref_ppo_mat(lp, lo, A, m, cfg, w):
    out = []
    for i in range(len(m)):
        row = []
        for t in range(len(m[i])):
            ratio = math.exp(lp[i][t] - lo[i][t])
            a = A[i][t]
            loss = max(-a * ratio, -a * clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high))
            if cfg.dual_clip_c > 1 and a < 0:
                loss = min(loss, -a * cfg.dual_clip_c)
            row.append(loss * (w[i][t] if w else 1.0))
        out.append(row)
    return out


def ref_gspo_loss(lp, lo, A, m, cfg, w):
    mat = []
    for i in range(len(m)):
        valid = [t for t in range(len(m[i])) if m[i][t] > 0]
        s = math.exp(sum(lp[i][t] - lo[i][t] for t in valid) / len(valid)) if valid else 1.0
        sc = clip(s, 1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high)
        mat.append(
            [max(-A[i][t] * s, -A[i][t] * sc) * (w[i][t] if w else 1.0) for t in range(len(m[i]))]
        )
    return ref_agg(mat, m, "seq-mean-token-mean")


def ref_cispo_weights(lp, lo, cfg):
    lo_b = 1 - cfg.cispo_clip_low if cfg.cispo_clip_low > 0 else -math.inf
    return [
        [
            clip(math.exp(lp[i][t] - lo[i][t]), lo_b, 1 + cfg.cispo_clip_high)
            for t in range(len(lp[i]))
        ]
        for i in range(len(lp))
    ]


def ref_cispo_mat(lp, lo, A, m, cfg, w):
    cw = ref_cispo_weights(lp, lo, cfg)
    return [
        [-cw[i][t] * A[i][t] * lp[i][t] * (w[i][t] if w else 1.0) for t in range(len(m[i]))]
        for i in range(len(m))
    ]


def ref_value_loss(v, vo, R, m, c, mode="token-mean"):
    mat = []
    for i in range(len(m)):
        row = []
        for t in range(len(m[i])):
            l1 = (v[i][t] - R[i][t]) ** 2
            if c > 0:
                vc = vo[i][t] + clip(v[i][t] - vo[i][t], -c, c)
                l1 = max(l1, (vc - R[i][t]) ** 2)
            row.append(0.5 * l1)
        mat.append(row)
    return ref_agg(mat, m, mode)


def ref_kl(lp, lr, name):
    out = []
    for i in range(len(lp)):
        row = []
        for t in range(len(lp[i])):
            d = lp[i][t] - lr[i][t]
            if name in ("k1", "k1+"):
                row.append(d)
            elif name == "k2":
                row.append(0.5 * d * d)
            elif name == "abs":
                row.append(abs(d))
            else:
                x = clip(-d, -20.0, 20.0)
                row.append(clip(math.exp(x) - x - 1, -10.0, 10.0))
        out.append(row)
    return out


# ----------------------------------------------------------------------------- advantages


@cases
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference(B, T, padding, seed, norm):
    rewards, mask, gid = make_inputs(B, T, padding, seed)
    cfg = AlgoConfig(norm_by_std=norm)
    adv, ret, metrics = get_advantage("grpo")(rewards, mask, gid, cfg)
    ref = ref_grpo(rewards.tolist(), mask.tolist(), gid.tolist(), norm, cfg.eps)
    assert_close(adv, ref)
    assert_close(ret, ref)
    assert all(isinstance(x, float) for x in metrics.values())
    vals = [ref[i][t] for i in range(B) for t in range(T) if mask[i, t] > 0]
    assert metrics["mean"] == pytest.approx(sum(vals) / max(len(vals), 1), abs=1e-6)


@cases
def test_grpo_token_rewards_are_summed(B, T, padding, seed):
    _, mask, gid = make_inputs(B, T, padding, seed)
    tok = torch.randn(B, T, dtype=DT)
    adv, _, _ = advantages.grpo(tok, mask, gid, AlgoConfig())
    assert_close(adv, ref_grpo(tok.tolist(), mask.tolist(), gid.tolist(), True, 1e-6))


@cases
def test_rloo_matches_reference(B, T, padding, seed):
    rewards, mask, gid = make_inputs(B, T, padding, seed)
    adv, _, _ = get_advantage("rloo")(rewards, mask, gid, AlgoConfig())
    assert_close(adv, ref_rloo(rewards.tolist(), mask.tolist(), gid.tolist()))


@cases
@pytest.mark.parametrize("token_level", [False, True])
def test_reinforce_pp_matches_reference(B, T, padding, seed, token_level):
    rewards, mask, gid = make_inputs(B, T, padding, seed)
    if token_level:
        rewards = torch.randn(B, T, dtype=DT)
    cfg = AlgoConfig(gamma=0.9)
    adv, ret, _ = get_advantage("reinforce_pp")(rewards, mask, gid, cfg)
    m = mask.tolist()
    ref_ret = ref_returns_to_go(ref_token_rewards(rewards.tolist(), m), m, 0.9)
    assert_close(ret, ref_ret)
    assert_close(adv, ref_whiten(ref_ret, m))


def test_hand_computed_masked_whiten():
    # verl: (x - mean) * rsqrt(var + 1e-8), unbiased var over the valid positions. Valid values
    # {0, 2, 4}: mean 2, var (4 + 0 + 4) / 2 = 4 -> (x - 2) / sqrt(4 + 1e-8)
    x = torch.tensor([[0.0, 2.0, 77.0], [4.0, float("nan"), 1.0]], dtype=DT)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=DT)
    s = math.sqrt(4 + 1e-8)
    assert_close(algos.masked_whiten(x, mask), [[-2 / s, 0.0, 0.0], [2 / s, 0.0, 0.0]])
    # the epsilon is added to the variance, not to the std: with eps = 5, 1 / sqrt(9) = 1/3
    assert_close(algos.masked_whiten(x, mask, 5.0), [[-2 / 3, 0.0, 0.0], [2 / 3, 0.0, 0.0]])
    # a constant batch or a single valid value whitens to 0 (verl raises on a single value)
    assert_close(algos.masked_whiten(x, torch.tensor([[1.0, 0, 0], [0, 0, 0]])), [[0.0] * 3] * 2)
    assert_close(algos.masked_whiten(x, torch.zeros(2, 3)), [[0.0] * 3] * 2)
    # all_reduce sums the statistics over data-parallel ranks: two ranks holding the same rows
    # whiten like the batch of both copies
    both = algos.masked_whiten(torch.cat([x, x]), torch.cat([mask, mask]))
    assert_close(algos.masked_whiten(x, mask, all_reduce=lambda t: 2 * t), both[:2])


@pytest.mark.parametrize("seed", SEEDS + [2, 3])
@pytest.mark.parametrize("token_level", [False, True])
def test_reinforce_pp_mask_holes(seed, token_level):
    # interior zeros (e.g. tool output inside a multi-turn completion) do not cut the return
    torch.manual_seed(seed)
    mask = (torch.rand(6, 8) < 0.6).to(DT)
    rewards = torch.randn(6, 8, dtype=DT) if token_level else torch.randn(6, dtype=DT)
    cfg = AlgoConfig(gamma=0.8)
    adv, ret, _ = advantages.reinforce_pp(rewards, mask, torch.zeros(6), cfg)
    m = mask.tolist()
    ref_ret = ref_returns_to_go(ref_token_rewards(rewards.tolist(), m), m, 0.8)
    assert_close(ret, ref_ret)
    assert_close(adv, ref_whiten(ref_ret, m))


def test_hand_computed_reinforce_pp_across_a_hole():
    # turn 1 (t=0,1), an observation the policy did not write (t=2, masked), turn 2 (t=3),
    # padding (t=4). Token rewards 1 at t=1 and 2 at t=3, junk on the masked positions.
    # gamma 0.5: G3 = 2; the hole neither resets nor discounts: G1 = 1 + .5 * 2 = 2;
    # G0 = 0 + .5 * 2 = 1. (verl resets at every masked position, which gives G1 = 1, G0 = .5:
    # the second turn's reward would never reach the first turn.)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0]], dtype=DT)
    r = torch.tensor([[0.0, 1.0, 9.0, 2.0, 9.0]], dtype=DT)
    adv, ret, _ = advantages.reinforce_pp(r, mask, torch.zeros(1), AlgoConfig(gamma=0.5))
    assert_close(ret, [[1.0, 2.0, 0.0, 2.0, 0.0]])
    # whitened over the 3 valid returns {1, 2, 2}: mean 5/3, unbiased var 1/3
    z = 1 / math.sqrt(1 / 3 + 1e-8)
    assert_close(adv, [[-2 / 3 * z, 1 / 3 * z, 0.0, 1 / 3 * z, 0.0]])
    # a [B] outcome reward sits at the last policy token and reaches the first turn
    one = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    _, ret, _ = advantages.reinforce_pp(
        torch.tensor([1.0]), one, torch.zeros(1), AlgoConfig(gamma=0.5)
    )
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.0, 1.0, 0.0]]))


@cases
def test_reinforce_pp_baseline_matches_reference(B, T, padding, seed):
    rewards, mask, gid = make_inputs(B, T, padding, seed)
    cfg = AlgoConfig()
    adv, _, _ = get_advantage("reinforce_pp_baseline")(rewards, mask, gid, cfg)
    r, g, m = rewards.tolist(), gid.tolist(), mask.tolist()
    members = ref_groups(g)
    mean = [sum(r[j] for j in members[g[i]]) / len(members[g[i]]) for i in range(B)]
    centred = [r[i] - (mean[i] if len(members[g[i]]) > 1 else 0.0) for i in range(B)]
    assert_close(adv, ref_whiten(ref_broadcast(centred, m), m))


@cases
@pytest.mark.parametrize("token_level", [False, True])
@pytest.mark.parametrize("truncated", [False, True])
def test_gae_matches_reference(B, T, padding, seed, token_level, truncated):
    rewards, mask, gid = make_inputs(B, T, padding, seed)
    if token_level:
        rewards = torch.randn(B, T, dtype=DT)
    values = torch.randn(B, T, dtype=DT)
    values_junk = torch.where(mask > 0, values, torch.full_like(values, float("nan")))
    boot = torch.randn(B, dtype=DT) if truncated else None
    cfg = AlgoConfig(gamma=0.95, lam=0.9)
    adv, ret, _ = get_advantage("gae")(
        rewards, mask, gid, cfg, values=values_junk, bootstrap_value=boot
    )
    ref_adv, ref_ret = ref_gae(
        rewards.tolist(),
        values.tolist(),
        mask.tolist(),
        0.95,
        0.9,
        boot.tolist() if truncated else None,
    )
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)


@pytest.mark.parametrize("seed", SEEDS + [2, 3])
@pytest.mark.parametrize("token_level", [False, True])
@pytest.mark.parametrize("truncated", [False, True])
def test_gae_mask_holes_match_reference(seed, token_level, truncated):
    # interior zeros (observations inside a multi-turn episode), leading zeros and empty rows
    torch.manual_seed(seed)
    B, T = 7, 9
    mask = (torch.rand(B, T) < 0.6).to(DT)
    mask[0] = 0.0
    rewards = torch.randn(B, T, dtype=DT) if token_level else torch.randn(B, dtype=DT)
    values = torch.randn(B, T, dtype=DT)
    junk = torch.where(mask > 0, values, torch.full_like(values, float("nan")))
    boot = torch.randn(B, dtype=DT) if truncated else None
    cfg = AlgoConfig(gamma=0.9, lam=0.7)
    adv, ret, _ = advantages.gae(
        rewards, mask, torch.zeros(B), cfg, values=junk, bootstrap_value=boot
    )
    ref_adv, ref_ret = ref_gae(
        rewards.tolist(),
        values.tolist(),
        mask.tolist(),
        0.9,
        0.7,
        boot.tolist() if truncated else None,
    )
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)


@cases
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_grpo_passk_matches_reference(B, T, padding, seed, k):
    rewards, mask, gid = make_inputs(B, T, padding, seed, binary=True)
    adv, _, _ = get_advantage("grpo_passk")(rewards, mask, gid, AlgoConfig(passk_k=k))
    assert_close(adv, ref_passk(rewards.tolist(), mask.tolist(), gid.tolist(), k))


def test_grpo_passk_success_threshold():
    # success means reward >= 0.5; a group of {0.5, 0.49} is mixed, {0.2, 0.49} is not
    r = torch.tensor([0.5, 0.49, 0.2, 0.49])
    adv, _, _ = advantages.grpo_passk(
        r, torch.ones(4, 1), torch.tensor([0, 0, 1, 1]), AlgoConfig(passk_k=2)
    )
    assert adv.abs().max().item() == 0.0  # k = N = 2: the one 2-subset passes -> no signal
    adv, _, _ = advantages.grpo_passk(
        r, torch.ones(4, 1), torch.tensor([0, 0, 1, 1]), AlgoConfig(passk_k=1)
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_grpo_passk_k1_is_grpo_with_population_std_and_sums_to_zero():
    torch.manual_seed(0)
    r = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1], dtype=DT)
    gid = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    mask = torch.ones(8, 1, dtype=DT)
    adv, _, _ = advantages.grpo_passk(r, mask, gid, AlgoConfig(passk_k=1))
    for g in (0, 1):
        x = r[gid == g]
        expect = (x - x.mean()) / x.std(unbiased=False)
        assert_close(adv[gid == g, 0], expect)
    adv2, _, _ = advantages.grpo_passk(r, mask, gid, AlgoConfig(passk_k=2))
    for g in (0, 1):
        assert abs(adv2[gid == g].sum().item()) < 1e-12
    # k = group size: every mixed group passes for sure -> no signal
    adv_n, _, _ = advantages.grpo_passk(r, mask, gid, AlgoConfig(passk_k=5))
    assert adv_n[gid == 0].abs().max().item() == 0.0
    # the default k (0) is half the group size, which does give mixed groups a signal
    adv_0, _, _ = advantages.grpo_passk(r, mask, gid, AlgoConfig(passk_k=0))
    assert adv_0[gid == 0].abs().min().item() > 0.0


def test_hand_computed_grpo_drgrpo_rloo():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    gid = torch.zeros(4, dtype=torch.long)
    a = 0.5 / math.sqrt(1 / 3)  # 0.8660...
    adv, _, _ = advantages.grpo(r, mask, gid, AlgoConfig())
    torch.testing.assert_close(
        adv, torch.tensor([[a, a], [-a, 0], [-a, -a], [a, a]]), atol=1e-5, rtol=1e-5
    )
    assert abs(a - 0.8660254) < 1e-6
    adv, _, _ = advantages.grpo(r, mask, gid, AlgoConfig(norm_by_std=False))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5], [-0.5, 0], [-0.5, -0.5], [0.5, 0.5]]))
    adv, _, _ = advantages.rloo(r, mask, gid, AlgoConfig())
    b = 2 / 3  # 1 - mean(0, 0, 1)
    torch.testing.assert_close(adv, torch.tensor([[b, b], [-b, 0], [-b, -b], [b, b]]))


def test_token_rewards():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = algos.token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0] * 3]))
    per_step = torch.full((3, 3), float("nan"))  # padding holds junk that must not leak
    per_step[0, :2], per_step[1, 0] = torch.tensor([1.0, 2.0]), 5.0
    out = algos.token_rewards(per_step, mask)
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0, 0.0], [5.0, 0, 0], [0.0] * 3]))
    with pytest.raises(ValueError, match="must match mask"):
        algos.token_rewards(torch.ones(3, 2), mask)
    with pytest.raises(ValueError, match=r"\[B\] or \[B, T\]"):
        algos.token_rewards(torch.ones(2), mask)


def test_hand_computed_singleton_groups_keep_their_reward():
    # a group of one has no baseline: verl uses mean 0 and std 1, so the row keeps its reward
    r = torch.tensor([3.0, 1.0, 2.0], dtype=DT)
    mask = torch.ones(3, 2, dtype=DT)
    gid = torch.tensor([0, 1, 1])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # the pair {1, 2}: mean 1.5, unbiased std sqrt(.5)
    adv, _, _ = advantages.grpo(r, mask, gid, AlgoConfig(eps=1e-6))
    assert_close(adv[:, 0], [3.0 / (1 + 1e-6), -a, a])
    adv, _, _ = advantages.grpo(r, mask, gid, AlgoConfig(norm_by_std=False))
    assert_close(adv[:, 0], [3.0, -0.5, 0.5])
    adv, _, _ = advantages.rloo(r, mask, gid, AlgoConfig())
    assert_close(adv[:, 0], [3.0, -1.0, 1.0])
    # reinforce_pp_baseline: centred [3, -.5, .5] on 2 tokens each, whitened over 6 tokens:
    # mean 1, deviations [2, -1.5, -.5], unbiased var (2 * (4 + 2.25 + .25)) / 5 = 2.6
    adv, _, _ = advantages.reinforce_pp_baseline(r, mask, gid, AlgoConfig())
    assert_close(adv, [[x / math.sqrt(2.6 + 1e-8)] * 2 for x in (2.0, -1.5, -0.5)])
    # pass@k has no defined value for a group of one (k must be below the group size): 0
    adv, _, _ = advantages.grpo_passk(r, mask, gid, AlgoConfig())
    assert adv[0].abs().max().item() == 0.0


def test_hand_computed_gae():
    # 3 valid steps then a padded one whose value is junk; gamma 0.9, lam 0.8.
    r = torch.tensor([[1.0, 0.0, 2.0, 7.0]])
    v = torch.tensor([[0.5, 1.0, 1.5, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    gid = torch.zeros(1, dtype=torch.long)
    cfg = AlgoConfig(gamma=0.9, lam=0.8)
    # terminated: d2 = 2 - 1.5 = .5; d1 = .9*1.5 - 1 = .35; d0 = 1 + .9 - .5 = 1.4
    # A2 = .5; A1 = .35 + .72*.5 = .71; A0 = 1.4 + .72*.71 = 1.9112
    adv, ret, _ = advantages.gae(r, mask, gid, cfg, values=v)
    torch.testing.assert_close(adv, torch.tensor([[1.9112, 0.71, 0.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[2.4112, 1.71, 2.0, 0.0]]))
    # truncated, bootstrap 2: d2 = 2 + 1.8 - 1.5 = 2.3; A1 = .35 + .72*2.3 = 2.006;
    # A0 = 1.4 + .72*2.006 = 2.84432
    adv, _, _ = advantages.gae(r, mask, gid, cfg, values=v, bootstrap_value=torch.tensor([2.0]))
    torch.testing.assert_close(adv, torch.tensor([[2.84432, 2.006, 2.3, 0.0]]))
    # scalar reward 2 at the last valid step: d0 = .9 - .5 = .4; A0 = .4 + .72*.71 = .9112
    adv, _, _ = advantages.gae(torch.tensor([2.0]), mask, gid, cfg, values=v)
    torch.testing.assert_close(adv, torch.tensor([[0.9112, 0.71, 0.5, 0.0]]))


def test_hand_computed_gae_across_a_hole():
    # policy step t=0, an observation (t=1, masked, junk value and reward), policy step t=2,
    # padding t=3. gamma 0.9, lam 0.8. The hole is skipped: the step after t=0 is t=2.
    # d2 = 1 + .9 * 0 - .5 = .5 -> A2 = .5; d0 = 0 + .9 * .5 - .5 = -.05;
    # A0 = -.05 + .72 * .5 = .31. Returns A + v: 0.81 and 1.0.
    r = torch.tensor([[0.0, 5.0, 1.0, 7.0]])
    v = torch.tensor([[0.5, 99.0, 0.5, 99.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    gid = torch.zeros(1, dtype=torch.long)
    cfg = AlgoConfig(gamma=0.9, lam=0.8)
    adv, ret, _ = advantages.gae(r, mask, gid, cfg, values=v)
    torch.testing.assert_close(adv, torch.tensor([[0.31, 0.0, 0.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.81, 0.0, 1.0, 0.0]]))
    # truncated, bootstrap 2: d2 = 1 + 1.8 - .5 = 2.3; A0 = -.05 + .72 * 2.3 = 1.606
    adv, _, _ = advantages.gae(r, mask, gid, cfg, values=v, bootstrap_value=torch.tensor([2.0]))
    torch.testing.assert_close(adv, torch.tensor([[1.606, 0.0, 2.3, 0.0]]))


def test_gae_needs_values():
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    with pytest.raises(ValueError, match="values"):
        advantages.gae(torch.ones(1), mask, torch.zeros(1, dtype=torch.long), AlgoConfig())


def test_advantages_detached_and_zero_on_padding():
    rewards = torch.randn(6, requires_grad=True)
    values = torch.randn(6, 4, requires_grad=True)
    mask = torch.tensor([[1.0] * k + [0.0] * (4 - k) for k in (4, 3, 2, 1, 4, 0)])
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    for name, fn in ADVANTAGES.items():
        adv, ret, _ = fn(rewards, mask, gid, AlgoConfig(), values=values)
        assert not adv.requires_grad and not ret.requires_grad, name
        assert adv[mask == 0].abs().max().item() == 0.0, name
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name


# ----------------------------------------------------------------------------- policy losses


def _cfgs():
    return {
        "ppo_clip": [AlgoConfig(), AlgoConfig(clip_high=0.28, dual_clip_c=3.0)],
        "gspo": [AlgoConfig(), AlgoConfig(gspo_clip_low=0.05, gspo_clip_high=0.1)],
        "cispo": [
            AlgoConfig(cispo_clip_high=0.3),
            AlgoConfig(cispo_clip_low=0.2, cispo_clip_high=0.1),
        ],
    }


@cases
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
def test_policy_losses_match_reference(B, T, padding, seed, mode, name):
    lp, lo, A, mask, w = make_policy_inputs(B, T, padding, seed)
    L, Lo, Aa, m, W = lp.tolist(), lo.tolist(), A.tolist(), mask.tolist(), w.tolist()
    for cfg in _cfgs()[name]:
        cfg = replace(cfg, loss_agg_mode=mode)
        for weight in (None, W):
            loss, metrics = get_policy_loss(name)(
                lp, lo, A, mask, cfg, is_weight=None if weight is None else w
            )
            if name == "ppo_clip":
                ref = ref_agg(ref_ppo_mat(L, Lo, Aa, m, cfg, weight), m, mode)
            elif name == "gspo":
                ref = ref_gspo_loss(L, Lo, Aa, m, cfg, weight)
            else:
                ref = ref_agg(ref_cispo_mat(L, Lo, Aa, m, cfg, weight), m, mode)
            assert_close(loss, ref)
            assert set(metrics) >= {"clipfrac", "approx_kl", "ratio_mean"}
            assert all(isinstance(x, float) for x in metrics.values())


@cases
def test_ppo_metrics_match_reference(B, T, padding, seed):
    lp, lo, A, mask, _ = make_policy_inputs(B, T, padding, seed)
    _, metrics = algos.ppo_clip(lp, lo, A, mask, AlgoConfig())
    clipped, kl, ratio, n = 0, 0.0, 0.0, 0
    for i in range(B):
        for t in range(T):
            if mask[i, t] > 0:
                r = math.exp(lp[i, t].item() - lo[i, t].item())
                a = A[i, t].item()
                clipped += -a * clip(r, 0.8, 1.2) > -a * r
                kl += r - 1 - math.log(r)
                ratio += r
                n += 1
    n = max(n, 1)
    assert metrics["clipfrac"] == pytest.approx(clipped / n, abs=1e-6)
    assert metrics["approx_kl"] == pytest.approx(kl / n, abs=1e-6)
    assert metrics["ratio_mean"] == pytest.approx(ratio / n if n else 0.0, abs=1e-6)


@cases
def test_cispo_gradient_matches_reference(B, T, padding, seed):
    lp, lo, A, mask, w = make_policy_inputs(B, T, padding, seed)
    cfg = AlgoConfig(cispo_clip_low=0.2, cispo_clip_high=0.1)
    lp = lp.clone().requires_grad_(True)
    loss, _ = algos.cispo(lp, lo, A, mask, cfg, is_weight=w)
    loss.backward()
    cw = ref_cispo_weights(lp.tolist(), lo.tolist(), cfg)
    n = mask.sum().item()
    ref = [
        [
            -cw[i][t] * A[i, t].item() * w[i, t].item() / n if mask[i, t] > 0 else 0.0
            for t in range(T)
        ]
        for i in range(B)
    ]
    assert_close(lp.grad, ref)


def test_ppo_clip_outside_clip_range_has_zero_gradient():
    cfg = AlgoConfig(clip_low=0.2, clip_high=0.2)
    mask = torch.ones(1, 1)
    for adv, ratio, want_loss, want_grad in [
        (1.0, 1.5, -1.2, 0.0),  # A > 0, ratio above 1 + eps: clipped
        (-1.0, 0.5, 0.8, 0.0),  # A < 0, ratio below 1 - eps: clipped
        (1.0, 0.5, -0.5, -0.5),  # A > 0, ratio low: unclipped, d(-A r)/dlogp = -A r
        (-1.0, 1.5, 1.5, 1.5),  # A < 0, ratio high: unclipped (pessimistic max)
    ]:
        lp = torch.zeros(1, 1, requires_grad=True)
        lo = torch.full((1, 1), -math.log(ratio))
        loss, metrics = algos.ppo_clip(lp, lo, torch.tensor([[adv]]), mask, cfg)
        loss.backward()
        assert loss.item() == pytest.approx(want_loss, abs=1e-6)
        assert lp.grad.item() == pytest.approx(want_grad, abs=1e-6)
        assert metrics["clipfrac"] == (1.0 if want_grad == 0 else 0.0)


def test_ppo_dual_clip():
    mask = torch.ones(1, 1)
    lp0 = torch.zeros(1, 1)
    A = torch.tensor([[-1.0]])
    cfg = AlgoConfig(dual_clip_c=3.0)
    for ratio, want_loss, want_grad in [(5.0, 3.0, 0.0), (2.0, 2.0, 2.0)]:
        lp = lp0.clone().requires_grad_(True)
        lo = torch.full((1, 1), -math.log(ratio))
        loss, metrics = algos.ppo_clip(lp, lo, A, mask, cfg)
        loss.backward()
        assert loss.item() == pytest.approx(want_loss, rel=1e-6)
        assert lp.grad.item() == pytest.approx(want_grad, rel=1e-6)
        assert metrics["clipfrac_dual"] == (1.0 if ratio > 3 else 0.0)
    lp = lp0.clone().requires_grad_(True)
    loss, _ = algos.ppo_clip(lp, torch.full((1, 1), -math.log(5.0)), A, mask, AlgoConfig())
    loss.backward()  # without dual clip the loss is unbounded
    assert loss.item() == pytest.approx(5.0) and lp.grad.item() == pytest.approx(5.0)
    # dual clip never touches positive advantages
    loss, _ = algos.ppo_clip(lp0, torch.full((1, 1), -math.log(5.0)), -A, mask, cfg)
    assert loss.item() == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="dual_clip_c"):
        algos.ppo_clip(lp0, lp0, A, mask, AlgoConfig(dual_clip_c=0.5))


def _away_from_boundaries(B, T, seed, bounds, gap=0.05):
    """Log ratios whose exp keeps at least ``gap`` (relative) from every clip boundary."""
    g = torch.Generator().manual_seed(seed)
    d = torch.empty(B, T, dtype=DT)
    for i in range(B):
        for t in range(T):
            while True:
                x = (torch.rand((), generator=g, dtype=DT) * 3 - 1.5).item()
                if all(abs(math.exp(x) - b) > gap for b in bounds):
                    d[i, t] = x
                    break
    return d


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_ppo_clip_gradcheck(seed, mode):
    B, T = 3, 4
    mask = torch.tensor([[1.0] * 4, [1.0] * 2 + [0.0] * 2, [1.0] * 3 + [0.0]], dtype=DT)
    cfg = AlgoConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, loss_agg_mode=mode)
    lp = -2 * torch.rand(B, T, dtype=DT, generator=torch.Generator().manual_seed(seed))
    lo = lp - _away_from_boundaries(B, T, seed, (0.8, 1.28, 3.0))
    A = torch.randn(B, T, dtype=DT, generator=torch.Generator().manual_seed(seed + 7))
    w = torch.rand(B, T, dtype=DT) + 0.5
    lp.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: algos.ppo_clip(x, lo, A, mask, cfg, is_weight=w)[0], (lp,)
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_gradcheck(seed):
    # sequence-level advantages: the token-level form then has the exact gradient of the
    # sequence-level objective, so finite differences of the loss must match autograd
    B, T = 4, 5
    mask = torch.tensor([[1.0] * k + [0.0] * (T - k) for k in (5, 3, 1, 4)], dtype=DT)
    cfg = AlgoConfig(gspo_clip_low=0.1, gspo_clip_high=0.15)
    gen = torch.Generator().manual_seed(seed)
    lp = -2 * torch.rand(B, T, dtype=DT, generator=gen)
    seq_d = _away_from_boundaries(B, 1, seed, (0.9, 1.15))  # per-seq mean log ratio
    noise = 0.3 * torch.randn(B, T, dtype=DT, generator=gen) * mask
    noise = noise - (noise.sum(1, keepdim=True) / mask.sum(1, keepdim=True)) * mask
    lo = lp - (seq_d + noise)
    A = torch.randn(B, 1, dtype=DT, generator=gen).expand(B, T)
    lp.requires_grad_(True)
    f = lambda x: algos.gspo(x, lo, A, mask, cfg)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (lp,))
    f(lp).backward()
    assert (lp.grad[mask == 0] == 0).all()


@pytest.mark.parametrize("side", ["above", "below"])
def test_cispo_gradcheck_in_clipped_region(side):
    # where the detached weight is clipped it is a constant, so CISPO is the linear function
    # -w A logp and its finite differences must match autograd
    B, T = 3, 4
    mask = torch.tensor([[1.0] * 4, [1.0] * 2 + [0.0] * 2, [1.0] * 3 + [0.0]], dtype=DT)
    gen = torch.Generator().manual_seed(3)
    lp = -2 * torch.rand(B, T, dtype=DT, generator=gen)
    shift = 1.0 if side == "above" else -1.0  # ratio e or 1/e vs bounds [0.8, 1.2]
    lo = lp - shift - 0.1 * torch.rand(B, T, dtype=DT, generator=gen)
    A = torch.randn(B, T, dtype=DT, generator=gen)
    cfg = AlgoConfig(cispo_clip_low=0.2, cispo_clip_high=0.2, loss_agg_mode="seq-mean-token-mean")
    lp.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: algos.cispo(x, lo, A, mask, cfg)[0], (lp,))


@pytest.mark.parametrize("clip_v", [0.0, 0.2])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_matches_reference_and_gradcheck(clip_v, mode):
    B, T = 4, 5
    mask = torch.tensor([[1.0] * k + [0.0] * (T - k) for k in (5, 3, 0, 4)], dtype=DT)
    gen = torch.Generator().manual_seed(5)
    vo = torch.randn(B, T, dtype=DT, generator=gen)
    R = torch.randn(B, T, dtype=DT, generator=gen)
    # v - vo away from +-0.2, and v away from the tie (v - R)^2 == (v_clip - R)^2
    d = _away_from_boundaries(B, T, 9, (math.exp(-0.2), math.exp(0.2)), gap=0.03)
    v = vo + d
    cfg = AlgoConfig(value_clip=clip_v, loss_agg_mode=mode)
    loss, metrics = value_loss(v, vo, R, mask, cfg)
    ref = ref_value_loss(v.tolist(), vo.tolist(), R.tolist(), mask.tolist(), clip_v, mode)
    assert_close(loss, ref)
    assert set(metrics) == {"vf_clipfrac", "vf_mean", "vf_explained_var"}
    assert (metrics["vf_clipfrac"] > 0) == (clip_v > 0)
    rs = [R[i, t].item() for i in range(B) for t in range(T) if mask[i, t] > 0]
    es = [R[i, t].item() - v[i, t].item() for i in range(B) for t in range(T) if mask[i, t] > 0]

    def var(xs):
        return sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)

    assert metrics["vf_explained_var"] == pytest.approx(1 - var(es) / var(rs), rel=1e-5)
    v.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: value_loss(x, vo, R, mask, cfg)[0], (v,))
    if clip_v == 0:
        value_loss(v, None, R, mask, cfg)  # values_old optional without clipping
    else:
        with pytest.raises(ValueError, match="values_old"):
            value_loss(v, None, R, mask, cfg)


def test_hand_computed_value_loss_follows_loss_agg_mode():
    # verl's compute_value_loss aggregates with the critic's loss_agg_mode (the actor's by
    # default). Squared errors: row 0 [1, 4], row 1 [9, pad], row 2 empty; 0.5 * agg.
    v = torch.tensor([[1.0, 2.0], [3.0, 50.0], [7.0, 7.0]], dtype=DT)
    R = torch.zeros(3, 2, dtype=DT)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]], dtype=DT)
    expect = {
        "token-mean": 0.5 * 14 / 3,
        "seq-mean-token-sum": 0.5 * (5 + 9) / 2,
        "seq-mean-token-mean": 0.5 * (2.5 + 9) / 2,
        "seq-mean-token-sum-norm": 0.5 * (5 + 9) / 2,  # T = 2, no division by B
    }
    for mode, want in expect.items():
        cfg = AlgoConfig(value_clip=0.0, loss_agg_mode=mode)
        assert value_loss(v, None, R, mask, cfg)[0].item() == pytest.approx(want), mode
    cfg = AlgoConfig(value_clip=0.0, loss_agg_mode="seq-mean-token-sum-norm", loss_norm_len=4)
    assert value_loss(v, None, R, mask, cfg)[0].item() == pytest.approx(0.5 * 14 / 4)


# ----------------------------------------------------------------------------- aggregation


@cases
@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_matches_reference(B, T, padding, seed, mode):
    torch.manual_seed(seed)
    mask = make_mask(B, T, padding)
    L = torch.randn(B, T, dtype=DT)
    assert_close(agg_loss(L, mask, mode), ref_agg(L.tolist(), mask.tolist(), mode))
    assert_close(
        agg_loss(L, mask, mode, num_tokens=7.0, num_seqs=5, norm_len=11),
        ref_agg(L.tolist(), mask.tolist(), mode, 7.0, 5, 11),
    )


def test_agg_loss_padding_nan_and_all_masked():
    L = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    for mode in AGG_MODES:
        assert torch.isfinite(agg_loss(L, mask, mode))
        out = agg_loss(L, torch.zeros(2, 2), mode)
        out.backward()
        assert out.item() == 0.0 and torch.isfinite(L.grad).all() and (L.grad == 0).all()
        L.grad = None
    assert agg_loss(L, mask, "token-mean").item() == pytest.approx(1.5)


def test_hand_computed_seq_means_skip_empty_rows():
    # rows: [1, 2] valid, [3, pad], and one with no valid token (as verl's agg_loss, it is not a
    # sequence of the mean: dividing by 3 rows would shrink every real row's weight)
    L = torch.tensor([[1.0, 2.0], [3.0, 100.0], [5.0, 6.0]], dtype=DT)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]], dtype=DT)
    assert agg_loss(L, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 3) / 2)
    assert agg_loss(L, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 3) / 2)
    # the caller's global count of non-empty rows replaces the local one
    got = agg_loss(L, mask, "seq-mean-token-sum", num_seqs=4).item()
    assert got == pytest.approx(6 / 4)


def test_hand_computed_seq_mean_token_sum_norm_has_no_batch_divisor():
    # verl: sum over rows of the row's token sum, divided by the constant only (T or
    # loss_norm_len), not by the number of rows
    L = torch.tensor([[1.0, 2.0, 0.5], [3.0, 100.0, 100.0]], dtype=DT)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=DT)
    assert agg_loss(L, mask, "seq-mean-token-sum-norm").item() == pytest.approx(6.5 / 3)
    out = agg_loss(L, mask, "seq-mean-token-sum-norm", norm_len=10, num_seqs=7, num_tokens=9)
    assert out.item() == pytest.approx(0.65)


def _split_equal(fn, B, n_micro=4):
    """Sum of ``fn(rows)`` over micro-batches and its grads vs ``fn(all rows)``."""
    idx = torch.arange(B)
    full_loss, full_grads = fn(idx)
    parts = [fn(chunk) for chunk in idx.chunk(n_micro)]
    micro_loss = sum(p[0] for p in parts)
    micro_grads = [sum(p[1][k] for p in parts) for k in range(len(full_grads))]
    assert_close(micro_loss, full_loss.item())
    for g_full, g_micro in zip(full_grads, micro_grads):
        assert_close(g_micro, g_full)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_micro_batch_invariance(mode, seed):
    torch.manual_seed(seed)
    B, T = 8, 6
    mask = make_mask(B, T, "with_empty")
    lp, lo, A, _, w = make_policy_inputs(B, T, "full", seed)
    v, vo, R = (torch.randn(B, T, dtype=DT) for _ in range(3))
    n_tok, n_seq = mask.sum(), int((mask.sum(1) > 0).sum())  # global normalisers
    cfg = AlgoConfig(loss_agg_mode=mode, dual_clip_c=3.0, value_clip=0.2)

    def run(make_loss):
        def fn(rows):
            x = lp.clone().requires_grad_(True)
            y = v.clone().requires_grad_(True)
            loss = make_loss(x, y, rows)
            loss.backward()
            return loss.detach(), [
                torch.zeros_like(z) if z.grad is None else z.grad for z in (x, y)
            ]

        _split_equal(fn, B)

    run(lambda x, y, r: agg_loss(x[r] * A[r], mask[r], mode, num_tokens=n_tok, num_seqs=n_seq))
    for name in POLICY_LOSSES:
        run(
            lambda x, y, r, name=name: get_policy_loss(name)(
                x[r], lo[r], A[r], mask[r], cfg, is_weight=w[r], num_tokens=n_tok, num_seqs=n_seq
            )[0]
        )
    run(
        lambda x, y, r: value_loss(
            y[r], vo[r], R[r], mask[r], cfg, num_tokens=n_tok, num_seqs=n_seq
        )[0]
    )


# ----------------------------------------------------------------------------- registries


def test_registries_and_errors():
    assert set(ADVANTAGES) >= {
        "grpo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "gae",
        "grpo_passk",
    }
    assert set(POLICY_LOSSES) >= {"ppo_clip", "gspo", "cispo"}
    assert set(KL_ESTIMATORS) >= {"k1", "k2", "k3", "abs", "k1+", "k3+"}
    assert get_advantage("grpo") is advantages.grpo and get_policy_loss("gspo") is algos.gspo
    for getter, names in [
        (get_advantage, ADVANTAGES),
        (get_policy_loss, POLICY_LOSSES),
        (get_kl, KL_ESTIMATORS),
    ]:
        with pytest.raises(ValueError) as err:
            getter("nope")
        assert "'nope'" in str(err.value)
        assert all(n in str(err.value) for n in names)
    with pytest.raises(ValueError) as err:
        agg_loss(torch.ones(1, 1), torch.ones(1, 1), "token-sum")
    assert all(m in str(err.value) for m in AGG_MODES)
    # a default config names only registered algorithms
    cfg = AlgoConfig()
    get_advantage(cfg.adv_estimator), get_policy_loss(cfg.policy_loss), get_kl(cfg.kl_estimator)


def test_register_new_entry_and_reject_name_clash():
    @algos.register_kl("k_test_abs")
    def k_abs(logp, logp_ref):
        return (logp - logp_ref).abs()

    try:
        assert get_kl("k_test_abs") is k_abs
        with pytest.raises(ValueError, match="already registered"):
            algos.register_kl("k_test_abs")(lambda a, b: a)
    finally:
        del KL_ESTIMATORS["k_test_abs"]


# ----------------------------------------------------------------------------- KL and utilities


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs", "k1+", "k3+"])
@pytest.mark.parametrize("seed", SEEDS)
def test_kl_estimators_match_reference(name, seed):
    torch.manual_seed(seed)
    lp = -3 * torch.rand(5, 6, dtype=DT)
    lr = -3 * torch.rand(5, 6, dtype=DT)
    lr[0, 0], lp[0, 1] = lp[0, 0] + 30.0, lr[0, 1] + 30.0  # extremes hit the k3 clamps
    out = get_kl(name)(lp, lr)
    assert_close(out, ref_kl(lp.tolist(), lr.tolist(), name))
    if name in ("k3", "k3+"):
        assert out[0, 0].item() == 10.0 and (out >= 0).all()


@pytest.mark.parametrize(
    "name,value,grad",
    [
        # logp = 0, logp_ref = -2 (d = logp - logp_ref = 2); gradients are d/d logp
        ("k1", 2.0, 1.0),
        ("k2", 2.0, 2.0),  # 0.5 d^2, gradient d
        ("k3", math.exp(-2) + 1, 1 - math.exp(-2)),  # e^-d + d - 1, gradient 1 - e^-d
        ("abs", 2.0, 1.0),
        ("k1+", 2.0, 2.0),  # value of k1, gradient of k2 (straight-through)
        ("k3+", math.exp(-2) + 1, 2.0),  # value of k3, gradient of k2
    ],
)
def test_hand_computed_kl_values_and_gradients(name, value, grad):
    lp = torch.zeros(1, 1, dtype=DT, requires_grad=True)
    out = get_kl(name)(lp, torch.full((1, 1), -2.0, dtype=DT))
    out.sum().backward()
    assert out.item() == pytest.approx(value) and lp.grad.item() == pytest.approx(grad)
    # d = -2: abs is 2 with gradient -1; the + variants keep k2's gradient d = -2
    lp = torch.zeros(1, 1, dtype=DT, requires_grad=True)
    out = get_kl(name)(lp, torch.full((1, 1), 2.0, dtype=DT))
    out.sum().backward()
    if name == "abs":
        assert out.item() == pytest.approx(2.0) and lp.grad.item() == pytest.approx(-1.0)
    if name.endswith("+"):
        assert lp.grad.item() == pytest.approx(-2.0)
    # a clamped k3 value keeps k2's gradient in k3+ (and has none in k3)
    lp = torch.zeros(1, 1, dtype=DT, requires_grad=True)
    out = get_kl(name)(lp, torch.full((1, 1), 30.0, dtype=DT))
    out.sum().backward()
    if name == "k3+":
        assert out.item() == 10.0 and lp.grad.item() == pytest.approx(-30.0)


def test_k3_is_unbiased_kl_estimate():
    # samples from p: E_p[k3(log p, log q)] = KL(p || q)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=DT)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=DT)
    kl = (p * (p / q).log()).sum()
    for name in ("k1", "k3"):
        est = (p * get_kl(name)(p.log(), q.log())).sum()  # exact expectation over p
        assert_close(est, kl.item())


@pytest.mark.parametrize("seed", SEEDS + [2, 3])
def test_filter_groups_matches_reference(seed):
    torch.manual_seed(seed)
    B = 12
    gid = torch.tensor([42, 3, 17, 8])[torch.randint(0, 4, (B,))]
    rewards = torch.randint(0, 2, (B,)).to(DT)
    rewards[gid == 42] = 1.0  # at least one constant group when present
    keep = filter_groups(rewards, gid)
    members = ref_groups(gid.tolist())
    r = rewards.tolist()
    ref = [
        max(r[j] for j in members[g]) - min(r[j] for j in members[g]) > 1e-6 for g in gid.tolist()
    ]
    assert keep.tolist() == ref
    metrics = filter_metrics(keep, gid)
    assert metrics["filter_kept_frac"] == pytest.approx(sum(ref) / B)
    kept_groups = {g for g, k in zip(gid.tolist(), ref) if k}
    assert metrics["filter_kept_groups_frac"] == pytest.approx(len(kept_groups) / len(members))


def test_filter_groups_tolerance_and_token_rewards():
    gid = torch.tensor([0, 0, 1, 1, 2])
    r = torch.tensor([1.0, 1.0 + 1e-9, 0.0, 0.5, 1.0], dtype=DT)
    assert filter_groups(r, gid).tolist() == [False, False, True, True, False]
    tok = torch.stack([r, torch.zeros_like(r)], dim=1)
    assert filter_groups(tok, gid).tolist() == [False, False, True, True, False]


@cases
def test_truncated_is_weights(B, T, padding, seed):
    lp, lo, _, mask, _ = make_policy_inputs(B, T, padding, seed)
    lo.requires_grad_(True)
    w = truncated_is_weights(lo, lp, mask, cap=1.3)
    assert not w.requires_grad
    ref = [
        [
            min(math.exp(lo[i, t].item() - lp[i, t].item()), 1.3) if mask[i, t] > 0 else 1.0
            for t in range(T)
        ]
        for i in range(B)
    ]
    assert_close(w, ref)
    with pytest.raises(ValueError, match="tis_cap"):
        truncated_is_weights(lo, lp, mask, cap=0.0)


@cases
@pytest.mark.parametrize("name", ["k1", "k3"])
@pytest.mark.parametrize("token_level", [False, True])
def test_kl_to_reward(B, T, padding, seed, name, token_level):
    lp, lref, _, mask, _ = make_policy_inputs(B, T, padding, seed)
    rewards = torch.randn(B, T, dtype=DT) if token_level else torch.randn(B, dtype=DT)
    out = kl_to_reward(rewards, lp.requires_grad_(True), lref, mask, 0.1, name)
    assert not out.requires_grad
    m = mask.tolist()
    tok = ref_token_rewards(rewards.tolist(), m)
    kl = ref_kl(lp.tolist(), lref.tolist(), name)
    ref = [[tok[i][t] - 0.1 * kl[i][t] if m[i][t] > 0 else 0.0 for t in range(T)] for i in range(B)]
    assert_close(out, ref)
    with pytest.raises(ValueError, match=r"'kl'; valid names: abs, k1, k1\+, k2, k3, k3\+"):
        kl_to_reward(rewards, lp, lref, mask, 0.1, "kl")
