"""Shared by the tests of trainer/advantages.py and trainer/algos.py (test_advantages.py,
test_losses.py, test_algos.py): the grid of batch shapes and paddings, input makers, and the
plain Python reference loops (lists, no tensors, no vectorisation) that every estimator, loss,
aggregation and KL estimator is checked against. Imported by path (the test modules put this
folder on sys.path), as test modules cannot import each other."""

from __future__ import annotations

import math

import pytest
import torch

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
