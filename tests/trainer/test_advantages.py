"""Tests for trainer/advantages.py: every advantage estimator against a plain Python reference
loop, hand-computed cases (the verl semantics, and each deliberate difference), masked whitening,
token-level rewards and the estimator registry's contract (detached, zero on padding).

The policy losses and aggregation are tested in test_losses.py, the KL estimators and the rest
of trainer/algos.py in test_algos.py; the case grid and the helpers the three share are in
algo_refs.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from perceptrl.registry import ADVANTAGES
from perceptrl.trainer import advantages
from perceptrl.trainer.advantages import AdvantageInputs
from perceptrl.trainer.config import AlgoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algo_refs import (  # noqa: E402
    DT,
    SEEDS,
    assert_close,
    cases,
    make_mask,
    ref_groups,
    ref_token_rewards,
)

# ----------------------------------------------------------------------------- input makers


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


# ----------------------------------------------------------------------------- references
# Plain Python over lists: no tensors, no vectorisation.


def ref_seq_reward(r, m):
    if isinstance(r[0], list):
        return [sum(r[i][t] for t in range(len(m[i])) if m[i][t] > 0) for i in range(len(m))]
    return list(r)


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


# ----------------------------------------------------------------------------- estimators


@cases
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference(B, T, padding, seed, norm):
    rewards, mask, gid = make_inputs(B, T, padding, seed)
    cfg = AlgoConfig(norm_by_std=norm)
    adv, ret, metrics = ADVANTAGES.get("grpo")(AdvantageInputs(rewards, mask, gid), cfg)
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
    adv, _, _ = advantages.grpo(AdvantageInputs(tok, mask, gid), AlgoConfig())
    assert_close(adv, ref_grpo(tok.tolist(), mask.tolist(), gid.tolist(), True, 1e-6))


@cases
def test_rloo_matches_reference(B, T, padding, seed):
    rewards, mask, gid = make_inputs(B, T, padding, seed)
    adv, _, _ = ADVANTAGES.get("rloo")(AdvantageInputs(rewards, mask, gid), AlgoConfig())
    assert_close(adv, ref_rloo(rewards.tolist(), mask.tolist(), gid.tolist()))


@cases
@pytest.mark.parametrize("token_level", [False, True])
def test_reinforce_pp_matches_reference(B, T, padding, seed, token_level):
    rewards, mask, gid = make_inputs(B, T, padding, seed)
    if token_level:
        rewards = torch.randn(B, T, dtype=DT)
    cfg = AlgoConfig(gamma=0.9)
    adv, ret, _ = ADVANTAGES.get("reinforce_pp")(AdvantageInputs(rewards, mask, gid), cfg)
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
    assert_close(advantages.masked_whiten(x, mask), [[-2 / s, 0.0, 0.0], [2 / s, 0.0, 0.0]])
    # the epsilon is added to the variance, not to the std: with eps = 5, 1 / sqrt(9) = 1/3
    assert_close(advantages.masked_whiten(x, mask, 5.0), [[-2 / 3, 0.0, 0.0], [2 / 3, 0.0, 0.0]])
    # a constant batch or a single valid value whitens to 0 (verl raises on a single value)
    assert_close(
        advantages.masked_whiten(x, torch.tensor([[1.0, 0, 0], [0, 0, 0]])), [[0.0] * 3] * 2
    )
    assert_close(advantages.masked_whiten(x, torch.zeros(2, 3)), [[0.0] * 3] * 2)
    # all_reduce sums the statistics over data-parallel ranks: two ranks holding the same rows
    # whiten like the batch of both copies
    both = advantages.masked_whiten(torch.cat([x, x]), torch.cat([mask, mask]))
    assert_close(advantages.masked_whiten(x, mask, all_reduce=lambda t: 2 * t), both[:2])


@pytest.mark.parametrize("seed", SEEDS + [2, 3])
@pytest.mark.parametrize("token_level", [False, True])
def test_reinforce_pp_mask_holes(seed, token_level):
    # interior zeros (e.g. tool output inside a multi-turn completion) do not cut the return
    torch.manual_seed(seed)
    mask = (torch.rand(6, 8) < 0.6).to(DT)
    rewards = torch.randn(6, 8, dtype=DT) if token_level else torch.randn(6, dtype=DT)
    cfg = AlgoConfig(gamma=0.8)
    adv, ret, _ = advantages.reinforce_pp(AdvantageInputs(rewards, mask, torch.zeros(6)), cfg)
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
    adv, ret, _ = advantages.reinforce_pp(
        AdvantageInputs(r, mask, torch.zeros(1)), AlgoConfig(gamma=0.5)
    )
    assert_close(ret, [[1.0, 2.0, 0.0, 2.0, 0.0]])
    # whitened over the 3 valid returns {1, 2, 2}: mean 5/3, unbiased var 1/3
    z = 1 / math.sqrt(1 / 3 + 1e-8)
    assert_close(adv, [[-2 / 3 * z, 1 / 3 * z, 0.0, 1 / 3 * z, 0.0]])
    # a [B] outcome reward sits at the last policy token and reaches the first turn
    one = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    _, ret, _ = advantages.reinforce_pp(
        AdvantageInputs(torch.tensor([1.0]), one, torch.zeros(1)), AlgoConfig(gamma=0.5)
    )
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.0, 1.0, 0.0]]))


@cases
def test_reinforce_pp_baseline_matches_reference(B, T, padding, seed):
    rewards, mask, gid = make_inputs(B, T, padding, seed)
    cfg = AlgoConfig()
    adv, _, _ = ADVANTAGES.get("reinforce_pp_baseline")(AdvantageInputs(rewards, mask, gid), cfg)
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
    adv, ret, _ = ADVANTAGES.get("gae")(
        AdvantageInputs(rewards, mask, gid, values=values_junk, bootstrap_value=boot), cfg
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
        AdvantageInputs(rewards, mask, torch.zeros(B), values=junk, bootstrap_value=boot), cfg
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
    adv, _, _ = ADVANTAGES.get("grpo_passk")(
        AdvantageInputs(rewards, mask, gid), AlgoConfig(passk_k=k)
    )
    assert_close(adv, ref_passk(rewards.tolist(), mask.tolist(), gid.tolist(), k))


def test_grpo_passk_success_threshold():
    # success means reward >= 0.5; a group of {0.5, 0.49} is mixed, {0.2, 0.49} is not
    r = torch.tensor([0.5, 0.49, 0.2, 0.49])
    adv, _, _ = advantages.grpo_passk(
        AdvantageInputs(r, torch.ones(4, 1), torch.tensor([0, 0, 1, 1])), AlgoConfig(passk_k=2)
    )
    assert adv.abs().max().item() == 0.0  # k = N = 2: the one 2-subset passes -> no signal
    adv, _, _ = advantages.grpo_passk(
        AdvantageInputs(r, torch.ones(4, 1), torch.tensor([0, 0, 1, 1])), AlgoConfig(passk_k=1)
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_grpo_passk_k1_is_grpo_with_population_std_and_sums_to_zero():
    torch.manual_seed(0)
    r = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1], dtype=DT)
    gid = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    mask = torch.ones(8, 1, dtype=DT)
    adv, _, _ = advantages.grpo_passk(AdvantageInputs(r, mask, gid), AlgoConfig(passk_k=1))
    for g in (0, 1):
        x = r[gid == g]
        expect = (x - x.mean()) / x.std(unbiased=False)
        assert_close(adv[gid == g, 0], expect)
    adv2, _, _ = advantages.grpo_passk(AdvantageInputs(r, mask, gid), AlgoConfig(passk_k=2))
    for g in (0, 1):
        assert abs(adv2[gid == g].sum().item()) < 1e-12
    # k = group size: every mixed group passes for sure -> no signal
    adv_n, _, _ = advantages.grpo_passk(AdvantageInputs(r, mask, gid), AlgoConfig(passk_k=5))
    assert adv_n[gid == 0].abs().max().item() == 0.0
    # the default k (0) is half the group size, which does give mixed groups a signal
    adv_0, _, _ = advantages.grpo_passk(AdvantageInputs(r, mask, gid), AlgoConfig(passk_k=0))
    assert adv_0[gid == 0].abs().min().item() > 0.0


def test_hand_computed_grpo_drgrpo_rloo():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    gid = torch.zeros(4, dtype=torch.long)
    a = 0.5 / math.sqrt(1 / 3)  # 0.8660...
    adv, _, _ = advantages.grpo(AdvantageInputs(r, mask, gid), AlgoConfig())
    torch.testing.assert_close(
        adv, torch.tensor([[a, a], [-a, 0], [-a, -a], [a, a]]), atol=1e-5, rtol=1e-5
    )
    assert abs(a - 0.8660254) < 1e-6
    adv, _, _ = advantages.grpo(AdvantageInputs(r, mask, gid), AlgoConfig(norm_by_std=False))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5], [-0.5, 0], [-0.5, -0.5], [0.5, 0.5]]))
    adv, _, _ = advantages.rloo(AdvantageInputs(r, mask, gid), AlgoConfig())
    b = 2 / 3  # 1 - mean(0, 0, 1)
    torch.testing.assert_close(adv, torch.tensor([[b, b], [-b, 0], [-b, -b], [b, b]]))


def test_token_rewards():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = advantages.token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0] * 3]))
    per_step = torch.full((3, 3), float("nan"))  # padding holds junk that must not leak
    per_step[0, :2], per_step[1, 0] = torch.tensor([1.0, 2.0]), 5.0
    out = advantages.token_rewards(per_step, mask)
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0, 0.0], [5.0, 0, 0], [0.0] * 3]))
    with pytest.raises(ValueError, match="must match mask"):
        advantages.token_rewards(torch.ones(3, 2), mask)
    with pytest.raises(ValueError, match=r"\[B\] or \[B, T\]"):
        advantages.token_rewards(torch.ones(2), mask)


def test_hand_computed_singleton_groups_keep_their_reward():
    # a group of one has no baseline: verl uses mean 0 and std 1, so the row keeps its reward
    r = torch.tensor([3.0, 1.0, 2.0], dtype=DT)
    mask = torch.ones(3, 2, dtype=DT)
    gid = torch.tensor([0, 1, 1])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # the pair {1, 2}: mean 1.5, unbiased std sqrt(.5)
    adv, _, _ = advantages.grpo(AdvantageInputs(r, mask, gid), AlgoConfig(eps=1e-6))
    assert_close(adv[:, 0], [3.0 / (1 + 1e-6), -a, a])
    adv, _, _ = advantages.grpo(AdvantageInputs(r, mask, gid), AlgoConfig(norm_by_std=False))
    assert_close(adv[:, 0], [3.0, -0.5, 0.5])
    adv, _, _ = advantages.rloo(AdvantageInputs(r, mask, gid), AlgoConfig())
    assert_close(adv[:, 0], [3.0, -1.0, 1.0])
    # reinforce_pp_baseline: centred [3, -.5, .5] on 2 tokens each, whitened over 6 tokens:
    # mean 1, deviations [2, -1.5, -.5], unbiased var (2 * (4 + 2.25 + .25)) / 5 = 2.6
    adv, _, _ = advantages.reinforce_pp_baseline(AdvantageInputs(r, mask, gid), AlgoConfig())
    assert_close(adv, [[x / math.sqrt(2.6 + 1e-8)] * 2 for x in (2.0, -1.5, -0.5)])
    # pass@k has no defined value for a group of one (k must be below the group size): 0
    adv, _, _ = advantages.grpo_passk(AdvantageInputs(r, mask, gid), AlgoConfig())
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
    adv, ret, _ = advantages.gae(AdvantageInputs(r, mask, gid, values=v), cfg)
    torch.testing.assert_close(adv, torch.tensor([[1.9112, 0.71, 0.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[2.4112, 1.71, 2.0, 0.0]]))
    # truncated, bootstrap 2: d2 = 2 + 1.8 - 1.5 = 2.3; A1 = .35 + .72*2.3 = 2.006;
    # A0 = 1.4 + .72*2.006 = 2.84432
    adv, _, _ = advantages.gae(
        AdvantageInputs(r, mask, gid, values=v, bootstrap_value=torch.tensor([2.0])), cfg
    )
    torch.testing.assert_close(adv, torch.tensor([[2.84432, 2.006, 2.3, 0.0]]))
    # scalar reward 2 at the last valid step: d0 = .9 - .5 = .4; A0 = .4 + .72*.71 = .9112
    adv, _, _ = advantages.gae(AdvantageInputs(torch.tensor([2.0]), mask, gid, values=v), cfg)
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
    adv, ret, _ = advantages.gae(AdvantageInputs(r, mask, gid, values=v), cfg)
    torch.testing.assert_close(adv, torch.tensor([[0.31, 0.0, 0.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.81, 0.0, 1.0, 0.0]]))
    # truncated, bootstrap 2: d2 = 1 + 1.8 - .5 = 2.3; A0 = -.05 + .72 * 2.3 = 1.606
    adv, _, _ = advantages.gae(
        AdvantageInputs(r, mask, gid, values=v, bootstrap_value=torch.tensor([2.0])), cfg
    )
    torch.testing.assert_close(adv, torch.tensor([[1.606, 0.0, 2.3, 0.0]]))


def test_gae_needs_values():
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    with pytest.raises(ValueError, match="values"):
        advantages.gae(
            AdvantageInputs(torch.ones(1), mask, torch.zeros(1, dtype=torch.long)), AlgoConfig()
        )


def test_advantages_detached_and_zero_on_padding():
    rewards = torch.randn(6, requires_grad=True)
    values = torch.randn(6, 4, requires_grad=True)
    mask = torch.tensor([[1.0] * k + [0.0] * (4 - k) for k in (4, 3, 2, 1, 4, 0)])
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    for name in ADVANTAGES:
        inp = AdvantageInputs(rewards, mask, gid, values=values)
        adv, ret, _ = ADVANTAGES.get(name)(inp, AlgoConfig())
        assert not adv.requires_grad and not ret.requires_grad, name
        assert adv[mask == 0].abs().max().item() == 0.0, name
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
