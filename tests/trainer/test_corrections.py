"""Rollout corrections (trainer/corrections.py): hand-computed cases, the on-policy identity,
and the loop applying them (weights into the loss, rejected tokens out of its mask)."""

from __future__ import annotations

import math

import pytest
import torch

from perceptrl.registry import CORRECTIONS, POLICY_LOSSES, UnknownName
from perceptrl.trainer.config import AlgoConfig, ConfigError
from perceptrl.trainer.corrections import apply_correction
from perceptrl.wiring import load_config

LN = math.log
# ratios pi_prox / pi_behav of 2 rows x 3 tokens; row 1's last token is padding
RATIOS = [[1.0, 3.0, 0.25], [1.5, 0.8, 9.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def logps():
    """(logp_old, logp_rollout) with the ratios above."""
    logp_rollout = torch.full((2, 3), -1.0)
    logp_old = logp_rollout + torch.tensor([[LN(r) for r in row] for row in RATIOS])
    return logp_old, logp_rollout


def run(name, cap=2.0, low=0.5):
    lo, lr = logps()
    return CORRECTIONS.get(name)(lo, lr, MASK, AlgoConfig(tis_cap=cap, correction_low=low))


def test_token_tis_caps_each_ratio():
    w, keep = run("tis", low=0.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.25], [1.5, 0.8, 1.0]]))
    assert keep.tolist() == [[True, True, True], [True, True, False]]


def test_seq_tis_weighs_a_row_by_its_capped_product():
    w, _ = run("seq_tis", cap=5.0)
    # row 0: 1 * 3 * 0.25 = 0.75; row 1: 1.5 * 0.8 = 1.2 (the padding's 9 does not count)
    torch.testing.assert_close(w, torch.tensor([[0.75] * 3, [1.2, 1.2, 1.0]]))
    w, _ = run("seq_tis", cap=1.1)
    torch.testing.assert_close(w[1, :2], torch.tensor([1.1, 1.1]))


def test_masks_drop_tokens_or_rows_past_the_threshold():
    _, keep = run("token_mask", low=0.0)  # ratio 3 > 2 leaves
    assert keep.tolist() == [[True, False, True], [True, True, False]]
    _, keep = run("seq_mask", cap=1.0, low=0.0)  # row 1's product 1.2 > 1
    assert keep.tolist() == [[True, True, True], [False, False, False]]


def test_decoupled_silences_what_lies_past_the_bounds():
    w, keep = run("decoupled", low=0.0)  # ratio 3 > 2 weighs 0 and stays in the count
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 0.25], [1.5, 0.8, 1.0]]))
    assert keep.tolist() == [[True, True, True], [True, True, False]]
    w, _ = run("decoupled", low=0.5)  # and 0.25 < 0.5 too
    torch.testing.assert_close(w[0], torch.tensor([1.0, 0.0, 0.0]))
    # geometric means: row 0 0.75^(1/3), row 1 1.2^(1/2); a cap of 1.05 silences row 1
    w, keep = run("decoupled_seq", cap=1.05, low=0.0)
    torch.testing.assert_close(w, torch.tensor([[0.75 ** (1 / 3)] * 3, [0.0, 0.0, 1.0]]))
    assert keep.tolist() == [[True, True, True], [True, True, False]]


def test_tis_truncates_into_a_lower_bound_when_one_is_set():
    w, _ = run("tis", low=0.5)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.5], [1.5, 0.8, 1.0]]))


# AReaL's decoupled PPO loss on one row of 4 tokens (the last masked): behaviour, proximal and
# current log-probs, advantages; eps_clip 0.2, no dual clip (AReaL's c_clip is None by default)
AREAL = dict(
    beh=[[-1.0, -2.0, -0.5, -1.0]], prox=[[-1.0, -0.2, -0.7, -1.0]],
    new=[[-0.9, -0.2, -1.0, -0.5]], adv=[[1.0, 1.0, -1.0, 1.0]], mask=[[1.0, 1.0, 1.0, 0.0]],
)  # fmt: skip


@pytest.mark.parametrize(
    "name, low, want",
    [  # AReaL token_mask (its default) at cap 5: the token with weight e^1.8 > 5 weighs 0 and
        # still counts in the mean of 3; token_truncate (tis): it weighs 5
        ("decoupled", 0.0, -0.150062),
        ("tis", 0.0, -1.816729),
        ("decoupled", 0.9, -0.368390),  # AReaL's lower bound rejects e^-0.2 as well
        ("tis", 0.9, -1.795057),  # clamp: e^-0.2 weighs 0.9
    ],
)
def test_areal_decoupled_ppo_loss(name, low, want):
    t = {k: torch.tensor(v) for k, v in AREAL.items()}
    cfg = AlgoConfig(tis_cap=5.0, correction_low=low, dual_clip_c=0.0)
    w, mask, _ = apply_correction(name, t["prox"], t["beh"], t["mask"], cfg)
    loss, _ = POLICY_LOSSES.get("ppo_clip")(t["new"], t["prox"], t["adv"], mask, cfg, is_weight=w)
    assert loss.item() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("cap, want", [(5.0, -0.325479), (2.0, 1.009846)])
def test_areal_sequence_weight(cap, want):
    # two rows of two tokens; behaviour weights e^0.8 (row 0) and e^-0.1 (row 1) per row
    beh = torch.full((2, 2), -1.0)
    prox = torch.tensor([[0.0, -0.4], [-1.2, -1.0]])
    new = torch.tensor([[0.2, -0.4], [-1.5, -0.8]])
    adv = torch.tensor([[2.0, 0.0], [-1.0, -3.0]])
    cfg = AlgoConfig(tis_cap=cap, dual_clip_c=0.0)
    w, mask, _ = apply_correction("decoupled_seq", prox, beh, torch.ones(2, 2), cfg)
    loss, _ = POLICY_LOSSES.get("ppo_clip")(new, prox, adv, mask, cfg, is_weight=w)
    assert loss.item() == pytest.approx(want, abs=1e-5)


def test_two_sided_masks():
    _, keep = run("icepop")  # [0.5, 2]: 3 and 0.25 leave
    assert keep.tolist() == [[True, False, False], [True, True, False]]
    # geometric means: row 0 (0.75)^(1/3) = 0.909, row 1 (1.2)^(1/2) = 1.095
    _, keep = run("geo_mask", cap=1.05, low=0.5)
    assert keep.tolist() == [[True, True, True], [False, False, False]]
    _, keep = run("geo_mask", cap=2.0, low=0.95)
    assert keep.tolist() == [[False, False, False], [True, True, False]]


@pytest.mark.parametrize("name", CORRECTIONS.names())
def test_on_policy_every_correction_is_the_identity(name):
    lo, _ = logps()
    cfg = AlgoConfig(tis_cap=2.0)
    w, new_mask, m = apply_correction(name, lo, lo.clone(), MASK, cfg)
    assert torch.equal(w, torch.ones_like(w)) and torch.equal(new_mask, MASK)
    assert m == {"correction/weight_mean": 1.0, "correction/masked_frac": 0.0}


def test_apply_checks_its_thresholds_and_reports():
    lo, lr = logps()
    with pytest.raises(ValueError, match="tis_cap > 0"):
        apply_correction("tis", lo, lr, MASK, AlgoConfig(tis_cap=0.0))
    with pytest.raises(ConfigError, match=r"algo.correction_low=3.0 \(lower bound 3.0 of tis\)"):
        load_config(None, ["algo.tis_cap=2.0", "algo.correction_low=3.0"])  # refused at load
    with pytest.raises(ConfigError, match=r"lower bound 0.5 of icepop\) must be in \[0, algo"):
        load_config(None, ["algo.tis_cap=0.4", "algo.rollout_correction=icepop"])
    with pytest.raises(UnknownName, match="valid: decoupled, decoupled_seq, geo_mask"):
        CORRECTIONS.get("is")
    _, new_mask, m = apply_correction("icepop", lo, lr, MASK, AlgoConfig(tis_cap=2.0))
    assert new_mask.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert m["correction/masked_frac"] == pytest.approx(2 / 5)


@pytest.mark.parametrize("name", ["icepop", "tis"])
def test_the_loop_applies_the_correction_to_the_loss(toy, tmp_path, name):
    """One step with behaviour log-probs: rejected tokens leave the loss mask (icepop), the
    capped weights reach the policy loss (tis)."""
    from perceptrl.trainer.engine import build_engine
    from perceptrl.trainer.loop import Trainer

    Policy, Source, config = toy
    cfg = config(steps=1)
    cfg.algo.tis_cap, cfg.algo.rollout_correction = 2.0, name
    torch.manual_seed(0)
    policy = Policy()
    trainer = Trainer(
        cfg, policy, Source(ragged=False), tmp_path, engine=build_engine(policy, cfg.train)
    )
    batch, _ = trainer.source.collect(trainer.policy, 0)
    trainer._score_old(batch)
    batch.logp_rollout = batch.logp_old - torch.where(
        torch.rand_like(batch.mask) < 0.3, 2.0, 0.0
    )  # ratio e^2 > 2 on ~30% of the tokens
    trainer._advantages(batch)
    m = trainer._correct(batch)
    far = batch.logp_old - batch.logp_rollout > LN(2.0)
    if name == "icepop":
        assert (batch.mask[far] == 0).all() and (batch.mask[~far] == 1).all()
        assert m["correction/masked_frac"] == pytest.approx(float(far.float().mean()))
        assert torch.equal(batch.is_weight, torch.ones_like(batch.mask))
        return
    assert batch.mask.eq(1).all() and batch.is_weight[far].eq(2.0).all()
    assert batch.is_weight[~far].eq(1.0).all()
    n = batch.mask.sum()
    loss, _ = trainer._loss(batch, n, len(batch))
    logp = trainer.policy.evaluate(batch).logp
    ref, _ = POLICY_LOSSES.get("ppo_clip")(
        logp, batch.logp_old, batch.advantages, batch.mask, cfg.algo,
        is_weight=batch.is_weight, num_tokens=n, num_seqs=len(batch),
    )  # fmt: skip
    unweighted, _ = POLICY_LOSSES.get("ppo_clip")(
        logp, batch.logp_old, batch.advantages, batch.mask, cfg.algo, num_tokens=n
    )
    torch.testing.assert_close(loss, ref)
    assert not torch.allclose(loss, unweighted)


def test_every_correction_reads_a_lower_bound_when_one_is_set():
    # ratios 0.25 (row 0) and the product 0.75 (row 0's sequence) fall below 0.9
    _, keep = run("token_mask", low=0.9)
    assert keep.tolist() == [
        [True, False, False],
        [True, False, False],
    ]  # 3 > 2, 0.25 and 0.8 < 0.9
    _, keep = run("seq_mask", cap=5.0, low=0.9)
    assert keep.tolist() == [[False] * 3, [True, True, False]]
    w, _ = run("seq_tis", cap=5.0, low=0.9)
    torch.testing.assert_close(w[0], torch.tensor([0.9] * 3))
