"""Tests for trainer/algos.py beyond the losses (test_losses.py): the registries and their
errors, the KL estimators against a plain Python reference loop (algo_refs.py) and by hand,
group filtering (DAPO's dynamic sampling) and KL in the reward."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from perceptrl.registry import ADVANTAGES, AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES, UnknownName
from perceptrl.trainer import advantages, algos
from perceptrl.trainer.algos import (
    agg_loss,
    filter_groups,
    filter_metrics,
    kl_to_reward,
)
from perceptrl.trainer.config import AlgoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algo_refs import (  # noqa: E402
    DT,
    SEEDS,
    assert_close,
    cases,
    make_policy_inputs,
    ref_groups,
    ref_kl,
    ref_token_rewards,
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
