"""Tests for the policy losses, the value loss and loss aggregation of trainer/algos.py: each
against a plain Python reference loop (algo_refs.py), hand-computed cases (the verl semantics,
and each deliberate difference), gradients (gradcheck) and micro-batch invariance. KL estimators,
group filtering and the registries: test_algos.py; estimators: test_advantages.py."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from perceptrl.registry import AGG_MODES, POLICY_LOSSES
from perceptrl.trainer import algos
from perceptrl.trainer.algos import (
    agg_loss,
    value_loss,
)
from perceptrl.trainer.config import AlgoConfig, ConfigError
from perceptrl.wiring import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algo_refs import (  # noqa: E402
    DT,
    assert_close,
    cases,
    clip,
    make_mask,
    make_policy_inputs,
    ref_agg,
    ref_cispo_mat,
    ref_cispo_weights,
    ref_gspo_loss,
    ref_ppo_mat,
    ref_value_loss,
)

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
