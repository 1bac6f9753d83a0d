"""Tests for trainer/algos.py: every loss and KL estimator against a plain Python reference loop,
hand-computed cases (the verl semantics, and each deliberate difference), gradients, registries,
micro-batch invariance. Estimators: test_advantages.py (it repeats the grid and shared helpers)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from perceptrl.registry import ADVANTAGES, AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES, UnknownName
from perceptrl.trainer import advantages, algos
from perceptrl.trainer.algos import (
    agg_loss,
    filter_groups,
    filter_metrics,
    kl_to_reward,
    value_loss,
)
from perceptrl.trainer.config import AlgoConfig, ConfigError
from perceptrl.wiring import load_config

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


# ----------------------------------------------------------------------------- policy losses


def _cfgs():
    return {
        "ppo_clip": [AlgoConfig(dual_clip_c=0.0), AlgoConfig(clip_high=0.28, dual_clip_c=3.0)],
        "gspo": [AlgoConfig(), AlgoConfig(gspo_clip_low=0.05, gspo_clip_high=0.1)],
        "cispo": [
            AlgoConfig(cispo_clip_high=0.3),
            AlgoConfig(cispo_clip_low=0.2, cispo_clip_high=0.1),
        ],
    }


@cases
@pytest.mark.parametrize("mode", AGG_MODES.names())
@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
def test_policy_losses_match_reference(B, T, padding, seed, mode, name):
    lp, lo, A, mask, w = make_policy_inputs(B, T, padding, seed)
    L, Lo, Aa, m, W = lp.tolist(), lo.tolist(), A.tolist(), mask.tolist(), w.tolist()
    for cfg in _cfgs()[name]:
        cfg = replace(cfg, loss_agg_mode=mode)
        for weight in (None, W):
            loss, metrics = POLICY_LOSSES.get(name)(
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
    off = AlgoConfig(dual_clip_c=0.0)
    loss, _ = algos.ppo_clip(lp, torch.full((1, 1), -math.log(5.0)), A, mask, off)
    loss.backward()  # without dual clip the loss is unbounded
    assert loss.item() == pytest.approx(5.0) and lp.grad.item() == pytest.approx(5.0)
    # dual clip never touches positive advantages
    loss, _ = algos.ppo_clip(lp0, torch.full((1, 1), -math.log(5.0)), -A, mask, cfg)
    assert loss.item() == pytest.approx(-1.2)
    with pytest.raises(ConfigError, match="algo.dual_clip_c=0.5.*> 1"):  # refused at load
        load_config(None, ["algo.dual_clip_c=0.5"])


def test_dual_clip_is_on_by_default_as_verl():
    # verl's vanilla loss, clip_ratio_c 3: ratios [4, 4, 0.5], advantages [-1, 1, -1] give
    # [3 (dual-clipped from 4), -1.2, 0.8]
    ratio = torch.tensor([[4.0, 4.0, 0.5]])
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    loss, m = algos.ppo_clip(ratio.log(), torch.zeros(1, 3), adv, torch.ones(1, 3), AlgoConfig())
    assert loss.item() == pytest.approx(2.6 / 3, abs=1e-6)
    assert m["clipfrac_dual"] == pytest.approx(1 / 3)
    # masked: ratios [[5, 0.7], [1, pad]], advantages [[-2, 0.5], [-2, pad]]
    ratio, mask = torch.tensor([[5.0, 0.7], [1.0, 9.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([[-2.0, 0.5], [-2.0, 7.0]])
    for c, want in ((3.0, 2.55), (10.0, 3.883333)):
        cfg = AlgoConfig(dual_clip_c=c)
        loss, _ = algos.ppo_clip(ratio.log(), torch.zeros(2, 2), adv, mask, cfg)
        assert loss.item() == pytest.approx(want, abs=1e-5)


def test_gspo_averages_unclamped_log_ratios_as_verl():
    # token log-ratios [30, -10]: verl averages them as they are (20, clamped to 10 after the
    # mean: ratio e^10); clamping each to +-20 first would give a mean of 5
    lp = torch.tensor([[30.0, -10.0]], dtype=DT)
    loss, _ = algos.gspo(lp, torch.zeros(1, 2, dtype=DT), -torch.ones(1, 2, dtype=DT),
                         torch.ones(1, 2, dtype=DT), AlgoConfig())  # fmt: skip
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-9)
    # the paper's clip range around a clipped ratio: A = +1, log-ratios [0.3, -0.1, 0.1]
    lp = torch.tensor([[0.3, -0.1, 0.1]], dtype=DT)
    loss, m = algos.gspo(lp, torch.zeros(1, 3, dtype=DT), torch.ones(1, 3, dtype=DT),
                         torch.ones(1, 3, dtype=DT), AlgoConfig())  # fmt: skip
    assert loss.item() == pytest.approx(-1.0004, abs=1e-7) and m["clipfrac"] == 1.0


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
@pytest.mark.parametrize("mode", AGG_MODES.names())
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
@pytest.mark.parametrize("mode", AGG_MODES.names())
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
@pytest.mark.parametrize("mode", AGG_MODES.names())
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
    for mode in AGG_MODES.names():
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


@pytest.mark.parametrize("mode", AGG_MODES.names())
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
            lambda x, y, r, name=name: POLICY_LOSSES.get(name)(
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
    assert set(AGG_MODES) == {
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    }
    assert ADVANTAGES.get("grpo") is advantages.grpo and POLICY_LOSSES.get("gspo") is algos.gspo
    for registry in (ADVANTAGES, POLICY_LOSSES, KL_ESTIMATORS):
        with pytest.raises(UnknownName) as err:
            registry.get("nope")
        assert "'nope'" in str(err.value)
        assert all(n in str(err.value) for n in registry)
    with pytest.raises(UnknownName) as err:
        agg_loss(torch.ones(1, 1), torch.ones(1, 1), "token-sum")
    assert all(m in str(err.value) for m in AGG_MODES)
    # a default config names only registered algorithms
    cfg = AlgoConfig()
    ADVANTAGES.get(cfg.adv_estimator), POLICY_LOSSES.get(cfg.policy_loss)
    KL_ESTIMATORS.get(cfg.kl_estimator), AGG_MODES.get(cfg.loss_agg_mode)


def test_estimators_declare_what_they_need():
    """The declarations the loop and the VLA side read: what each estimator is given besides
    rewards, mask and group ids, and which one collects per-step PPO experience."""
    needs = {name: ADVANTAGES.meta(name)["needs"] for name in ADVANTAGES}
    assert needs["gae"] == ("values", "bootstrap_value")
    assert needs["treepo"] == needs["treerl"] == ("segments",)
    assert needs["prime"] == ("step_rewards",)
    assert all(needs[n] == () for n in ("grpo", "rloo", "reinforce_pp", "grpo_passk"))
    assert [n for n in ADVANTAGES if ADVANTAGES.meta(n)["per_step"]] == ["gae"]


def test_register_new_entry_and_reject_name_clash():
    @KL_ESTIMATORS.register("k_test_abs")
    def k_abs(logp, logp_ref):
        return (logp - logp_ref).abs()

    try:
        assert KL_ESTIMATORS.get("k_test_abs") is k_abs
        with pytest.raises(ValueError, match="already registered"):
            KL_ESTIMATORS.register("k_test_abs")(lambda a, b: a)
    finally:
        KL_ESTIMATORS.unregister("k_test_abs")


# ----------------------------------------------------------------------------- KL and utilities


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs", "k1+", "k3+"])
@pytest.mark.parametrize("seed", SEEDS)
def test_kl_estimators_match_reference(name, seed):
    torch.manual_seed(seed)
    lp = -3 * torch.rand(5, 6, dtype=DT)
    lr = -3 * torch.rand(5, 6, dtype=DT)
    lr[0, 0], lp[0, 1] = lp[0, 0] + 30.0, lr[0, 1] + 30.0  # extremes hit the k3 clamps
    out = KL_ESTIMATORS.get(name)(lp, lr)
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
    out = KL_ESTIMATORS.get(name)(lp, torch.full((1, 1), -2.0, dtype=DT))
    out.sum().backward()
    assert out.item() == pytest.approx(value) and lp.grad.item() == pytest.approx(grad)
    # d = -2: abs is 2 with gradient -1; the + variants keep k2's gradient d = -2
    lp = torch.zeros(1, 1, dtype=DT, requires_grad=True)
    out = KL_ESTIMATORS.get(name)(lp, torch.full((1, 1), 2.0, dtype=DT))
    out.sum().backward()
    if name == "abs":
        assert out.item() == pytest.approx(2.0) and lp.grad.item() == pytest.approx(-1.0)
    if name.endswith("+"):
        assert lp.grad.item() == pytest.approx(-2.0)
    # a clamped k3 value keeps k2's gradient in k3+ (and has none in k3)
    lp = torch.zeros(1, 1, dtype=DT, requires_grad=True)
    out = KL_ESTIMATORS.get(name)(lp, torch.full((1, 1), 30.0, dtype=DT))
    out.sum().backward()
    if name == "k3+":
        assert out.item() == 10.0 and lp.grad.item() == pytest.approx(-30.0)


def test_k3_is_unbiased_kl_estimate():
    # samples from p: E_p[k3(log p, log q)] = KL(p || q)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=DT)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=DT)
    kl = (p * (p / q).log()).sum()
    for name in ("k1", "k3"):
        est = (p * KL_ESTIMATORS.get(name)(p.log(), q.log())).sum()  # exact expectation over p
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
    with pytest.raises(ValueError, match=r"'kl'.*valid: abs, k1, k1\+, k2, k3, k3\+"):
        kl_to_reward(rewards, lp, lref, mask, 0.1, "kl")
