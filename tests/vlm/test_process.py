"""Process rewards: rule-based step checks land on the tokens that end the steps, the implicit
PRM learns the outcome labels from its per-token log-ratios, the monitor flags a process reward
that rises while the outcome falls, and the count_sum and count_size generators know their
sub-counts."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from perceptrl.registry import STEP_REWARDS
from perceptrl.rewards import RewardContext
from perceptrl.rewards.process import Step, step_values
from perceptrl.vlm.policy import VLMPolicy
from perceptrl.vlm.process import ImplicitPRM, ProcessMonitor, RuleSteps

SAMPLE = {"id": "s", "answer": "3", "meta": {"steps": {"red": 2, "blue": 1}}}
NO_CTX = RewardContext()


def test_step_values_scores_first_claims_of_known_labels():
    texts = [
        "<think>red: 2. blue: 1.</think><answer>3</answer>",
        "<think>red: 3. red: 2. green: 5. Blue objects = 1</think><answer>4</answer>",
        "<think>nothing here</think><answer>red: 2</answer>",
    ]
    out = step_values(texts, [SAMPLE] * 3, NO_CTX)
    assert out[0] == [Step(texts[0].index("2") + 1, 0.5), Step(texts[0].index("1") + 1, 0.5)]
    # red's first claim (3) is wrong, a repeat earns nothing, green is not asked, blue is right
    assert [s.score for s in out[1]] == [0.0, 0.5]
    assert out[2] == []  # claims after <answer> are not steps
    assert step_values(texts[:1], [{"meta": {}}], NO_CTX) == [[]]
    with pytest.raises(ValueError, match="unknown step reward 'stepvalues'"):
        STEP_REWARDS.get("stepvalues")


@pytest.fixture(scope="module")
def pol(tiny_dirs) -> VLMPolicy:
    return VLMPolicy.from_pretrained(tiny_dirs["qwen2_5_vl"])


def test_steps_land_on_the_tokens_that_end_them(pol, samples):
    texts = ["<think>red: 2. blue: 7.</think><answer>9</answer>", "<think>blue: 1</think>"]
    batch = pol.completions_batch(samples[:2], texts)
    for b in batch.meta:
        b["sample"] = SAMPLE
    tok = pol.processor.tokenizer
    steps, stats = RuleSteps("step_values", tok)(batch, torch.ones(2))
    claims = step_values(texts, [SAMPLE] * 2, NO_CTX)
    for row in range(len(texts)):
        ids = batch.tokens[row, : int(batch.mask[row].sum())].tolist()
        at = [t for t in range(len(ids)) if any(
            len(tok.decode(ids[: t + 1], skip_special_tokens=True)) >= c.end
            > len(tok.decode(ids[:t], skip_special_tokens=True)) for c in claims[row] if c.score)]  # fmt: skip
        assert steps[row].nonzero().squeeze(1).tolist() == at  # the token holding the number
    assert steps[0].tolist().count(0.5) == 1 and steps[0].sum() == 0.5  # red right, blue wrong
    assert steps[1].sum() == 0.5 and stats["process_steps"] == 1.5


def test_implicit_prm_learns_the_outcome_labels(pol, samples):
    """Two right and two wrong completions: a few PRM steps make the sign of its summed
    per-token log-ratio the label (PRIME's classifier), and the rewards are that ratio."""
    torch.manual_seed(0)
    texts = ["<answer>1</answer>", "<answer>7</answer>", "<answer>1</answer>", "<answer>7</answer>"]
    batch = pol.completions_batch(samples[:4], texts)
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    prm = ImplicitPRM(pol, beta=0.5, lr=3e-3, micro_batch_size=2)
    first, _ = prm(batch, labels)
    assert torch.allclose(first, torch.zeros_like(first), atol=1e-6)  # PRM == reference at first
    for _ in range(15):
        rewards, stats = prm(batch, labels)
    score = rewards.sum(1)
    assert stats["prm_accuracy"] == 1.0
    assert (score[labels == 1] > 0).all() and (score[labels == 0] < 0).all()
    assert (rewards * (1 - batch.mask)).abs().max() == 0  # nothing on padding
    assert not any(p.requires_grad for p in prm.ref.parameters())
    state = prm.state_dict()
    fresh = ImplicitPRM(pol, beta=0.5, lr=3e-3, micro_batch_size=2)
    fresh.load_state_dict(state)
    again, _ = fresh(batch, labels)
    torch.testing.assert_close(again, prm(batch, labels)[0], atol=1e-5, rtol=0)


def test_monitor_flags_a_rising_process_reward_with_a_falling_outcome(caplog):
    mon = ProcessMonitor(window=6, margin=0.05)
    flags = [mon(0.1 * i, 0.5, i) for i in range(6)]  # process up, outcome flat
    assert flags == [0.0] * 6
    noisy = [mon(0.6, 0.5 + (0.1 if i % 2 else -0.1), 6 + i) for i in range(6)]  # swings only
    assert noisy == [0.0] * 6
    with caplog.at_level(logging.WARNING, logger="perceptrl.vlm.process"):
        flags = [mon(0.7 + 0.1 * i, 0.5 - 0.05 * i, 12 + i) for i in range(7)]
    assert flags[-1] == 1.0
    assert sum("may be hacked" in r.message for r in caplog.records) == 1  # once per window


@pytest.mark.parametrize("family, attr", [("count_sum", "color"), ("count_size", "size")])
def test_multi_step_counts_know_their_sub_counts(family, attr):
    from perceptrl.datasets.clevr import make_sample, reasoning_trace

    for i in range(6):
        s, _ = make_sample("train", i, family, seed=3)
        steps = s["meta"]["steps"]
        values = [o[attr] for o in s["meta"]["objects"]]
        assert len(steps) == 2 and all(values.count(c) == n for c, n in steps.items())
        assert s["answer"] == str(sum(steps.values()))
        if family == "count_size":  # every object is in one of the two steps
            assert sum(steps.values()) == len(values) and list(steps) == ["small", "large"]
        trace = reasoning_trace(s)
        assert [x.score for x in step_values([trace], [s], NO_CTX)[0]] == [0.5, 0.5]
        for c in steps:  # each group's objects are listed before its sub-count
            listed = trace.split(f"{c.capitalize()} objects from left to right: ")[1].split(".")[0]
            assert len(re.findall(rf"\b{c}\b", listed)) == steps[c]
            assert (listed == "none") == (steps[c] == 0)
            assert f"{c}: {steps[c]}." in trace


def test_a_step_reward_that_raises_scores_zero_and_is_counted(pol, samples, caplog):
    @STEP_REWARDS.register("test_raises")
    def raises(completions, samples, ctx):
        raise RuntimeError("judge worker died")

    batch = pol.completions_batch(samples[:2], ["<think>red: 2</think>", "x"])
    with caplog.at_level(logging.WARNING, logger="perceptrl.vlm.process"):
        steps, stats = RuleSteps("test_raises", pol.processor.tokenizer)(batch, torch.ones(2))
    assert steps.abs().sum() == 0 and stats["process_errors"] == 1.0
    assert "judge worker died" in caplog.text
