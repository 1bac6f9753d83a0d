"""Tree and process-reward estimators against cases computed by hand from the original code's
rule (TreePO's ``compute_tree_reinforce_plus_plus_baseline_outcome_advantage``, TreeRL's
``tree_node.py`` / ``parallel_mcts.py``, verl's ``recipe/prime``; commits in the estimators'
docstrings): several tree shapes, singleton groups, uniform subgroups, masked tokens, and their
flat limits."""

from __future__ import annotations

import math

import pytest
import torch

from perceptrl.registry import ADVANTAGES
from perceptrl.trainer.advantages import AdvantageInputs, masked_whiten
from perceptrl.trainer.config import AlgoConfig

# One prompt, branches [2, 2]: nodes 1 and 2 below the root, 3 and 4 below 1, 5 and 6 below 2;
# one token per node (TreePO's uids A#1-0#2-0 ... A#1-1#2-3).
FULL_SEGMENTS = torch.tensor([[1, 3], [1, 4], [2, 5], [2, 6]])
FULL_REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0])

# An uneven tree with a leaf that stopped early and a uniform subgroup (TreePO uids
# C#1-0, C#1-1#2-0#3-0, C#1-1#2-0#3-1, C#1-1#2-1#3-2, C#1-2#2-2).
UNEVEN_SEGMENTS = torch.tensor([[1, 0, 0], [2, 4, 6], [2, 4, 7], [2, 5, 8], [3, 9, 9]])
UNEVEN_MASK = torch.tensor([[1.0, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
UNEVEN_REWARDS = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])


def run(name, rewards, mask, group, cfg=None, **kw):
    adv, ret, metrics = ADVANTAGES.get(name)(
        AdvantageInputs(rewards, mask, group, **kw), cfg or AlgoConfig()
    )
    return adv, ret, metrics


def close(got, want):
    torch.testing.assert_close(got, torch.as_tensor(want, dtype=got.dtype), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- TreePO


@pytest.mark.parametrize(
    "weighting, drop, want",
    [  # TreePO's released script: average, no subgroup filtering
        ("average", False, [0.935414, -1.559024, 0.311805, 0.311805]),
        ("group_size", False, [0.797724, -1.595448, 0.398862, 0.398862]),
        ("average", True, [0.730436, -1.606959, 0.438262, 0.438262]),
        ("group_size", True, [0.664839, -1.614608, 0.474885, 0.474885]),
    ],
)
def test_treepo_full_tree(weighting, drop, want):
    # entries: root (mean 0.75) and the depth-1 node (mean 0.5, or 1 with equal rewards);
    # average -> [0.375, -0.625, 0.125, 0.125], whitened over the batch's 8 tokens
    cfg = AlgoConfig(treepo_weighting=weighting, treepo_drop_uniform_subgroups=drop)
    adv, ret, m = run("treepo", FULL_REWARDS, torch.ones(4, 2), torch.zeros(4), cfg,
                      segments=FULL_SEGMENTS)  # fmt: skip
    close(adv, torch.tensor(want)[:, None].expand(4, 2))
    assert torch.equal(adv, ret) and m["tree_depth"] == 2.0


def test_treepo_a_singleton_prompt_keeps_its_reward_before_whitening():
    # a second prompt with one leaf (reward 1): its score is 1, whitened with the batch
    seg = torch.cat([FULL_SEGMENTS, torch.tensor([[7, 7]])])
    r = torch.cat([FULL_REWARDS, torch.tensor([1.0])])
    adv, _, _ = run("treepo", r, torch.ones(5, 2), torch.tensor([0, 0, 0, 0, 1]), segments=seg)
    close(adv[:, 0], [0.318036, -1.499312, -0.136301, -0.136301, 1.453878])


@pytest.mark.parametrize(
    "weighting, drop, scores",
    [
        ("average", False, [-0.6, 0.244444, 0.244444, -0.633333, 0.4]),
        ("average", True, [-0.6, 0.366667, 0.366667, -0.633333, 0.4]),
        ("group_size", False, [-0.6, 0.3, 0.3, -0.625, 0.4]),
        ("group_size", True, [-0.6, 0.375, 0.375, -0.625, 0.4]),
    ],
)
def test_treepo_uneven_tree(weighting, drop, scores):
    # root mean 0.6; node 2's three leaves mean 2/3; node 4's two leaves are uniform (mean 1);
    # one-leaf subgroups are skipped, the leaves' own nodes are never a subgroup
    cfg = AlgoConfig(treepo_weighting=weighting, treepo_drop_uniform_subgroups=drop)
    adv, _, _ = run("treepo", UNEVEN_REWARDS, UNEVEN_MASK, torch.zeros(5), cfg,
                    segments=UNEVEN_SEGMENTS)  # fmt: skip
    want = masked_whiten(torch.tensor(scores)[:, None] * UNEVEN_MASK, UNEVEN_MASK)
    close(adv, want)
    assert torch.all(adv[UNEVEN_MASK == 0] == 0)


# ----------------------------------------------------------------------------- TreeRL


def test_treerl_full_tree():
    # leave-one-out rewards [1/3, -1, 1/3, 1/3]; V(1) = -1/3 / sqrt 2, V(2) = 1/3 / sqrt 2
    adv, _, _ = run("treerl", FULL_REWARDS, torch.ones(4, 2), torch.zeros(4),
                    segments=FULL_SEGMENTS)  # fmt: skip
    a, b = -math.sqrt(2) / 3, math.sqrt(2) / 3
    close(adv, [[a, 0.902369], [a, -1.764298], [b, 0.430964], [b, 0.430964]])


def test_treerl_uneven_tree():
    # root -> A(1), c(2); A -> B(3), a1(4); B -> b1(5), b2(6); rewards a1 0, b1 1, b2 1, c 0
    seg = torch.tensor([[2, 0, 0], [1, 4, 0], [1, 3, 5], [1, 3, 6]])
    mask = (seg > 0).float()
    adv, _, _ = run("treerl", torch.tensor([0.0, 0, 1, 1]), mask, torch.zeros(4), segments=seg)
    close(adv, [[-4 / 3, 0, 0], [0.2566, -1.461633, 0], [0.2566, 0.814509, 0.861929],
                [0.2566, 0.814509, 0.861929]])  # fmt: skip


CHAIN = torch.tensor([[1, 2, 3], [1, 2, 4], [5, 6, 0]])  # node 1 has one child (2)
CHAIN_MASK = (CHAIN > 0).float()
CHAIN_REWARDS = torch.tensor([1.0, 0.0, 0.0])
V_A = 0.25 / math.sqrt(2)  # leave-one-out rewards 1, -0.5, -0.5


@pytest.mark.parametrize(
    "credit, want",
    [  # a zero local gain (node 2 below node 1, node 6 below 5) takes the previous segment's
        ("state_value", [[2 * V_A, 2 * V_A, 2 - V_A], [2 * V_A, 2 * V_A, -1 - V_A], [-1, -1, 0]]),
        ("local", [[V_A, V_A, 1 - V_A], [V_A, V_A, -0.5 - V_A], [-0.5, -0.5, 0]]),
        ("value", [[V_A, V_A, 1], [V_A, V_A, -0.5], [-0.5, -0.5, 0]]),
        ("ancestors", [[V_A, V_A / 2, (3 - 2 * V_A) / 3], [V_A, V_A / 2, (-1.5 - 2 * V_A) / 3],
                       [-0.5, -0.25, 0]]),
    ],
)  # fmt: skip
def test_treerl_credit_modes(credit, want):
    adv, _, _ = run("treerl", CHAIN_REWARDS, CHAIN_MASK, torch.zeros(3),
                    AlgoConfig(treerl_credit=credit), segments=CHAIN)  # fmt: skip
    close(adv, want)


def test_treerl_value_scales():
    for scale, div in (("count", 2.0), ("none", 1.0)):
        adv, _, _ = run(
            "treerl",
            CHAIN_REWARDS,
            CHAIN_MASK,
            torch.zeros(3),
            AlgoConfig(treerl_credit="value", treerl_value_scale=scale),
            segments=CHAIN,
        )
        close(adv[0, :2], [0.25 / div, 0.25 / div])  # fmt: skip


def test_treerl_a_group_of_one_gets_nothing():
    adv, _, _ = run("treerl", torch.tensor([1.0]), torch.ones(1, 2), torch.zeros(1),
                    segments=torch.tensor([[1, 2]]))  # fmt: skip
    assert torch.all(adv == 0)


def test_trees_of_two_groups_do_not_mix():
    """Node ids restart in every group: group 1's node 1 is not group 0's. TreeRL has no batch
    statistic, so each group is its own problem."""
    seg = torch.cat([FULL_SEGMENTS, FULL_SEGMENTS])
    r = torch.cat([FULL_REWARDS, 1 - FULL_REWARDS])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    both, _, _ = run("treerl", r, torch.ones(8, 2), group, segments=seg)
    first, _, _ = run("treerl", FULL_REWARDS, torch.ones(4, 2), torch.zeros(4),
                      segments=FULL_SEGMENTS)  # fmt: skip
    second, _, _ = run("treerl", 1 - FULL_REWARDS, torch.ones(4, 2), torch.zeros(4),
                       segments=FULL_SEGMENTS)  # fmt: skip
    close(both, torch.cat([first, second]))


# ----------------------------------------------------------------------------- flat limits


@pytest.mark.parametrize("seed", [0, 1])
def test_flat_limits(seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 2, (12,), generator=g).float()
    r[0] = 1 - r[1]  # no batch of equal rewards
    mask = torch.ones(12, 5)
    mask[::3, 3:] = 0
    group = torch.arange(3).repeat_interleave(4)
    tree, _, _ = run("treepo", r, mask, group)
    base, _, _ = ADVANTAGES.get("reinforce_pp_baseline")(
        AdvantageInputs(r, mask, group), AlgoConfig()
    )
    close(tree, base)
    rl, _, _ = run("treerl", r, mask, group)
    mean = r.view(3, 4).mean(1).repeat_interleave(4)
    close(rl, (2 * 4 / 3 * (r - mean))[:, None] * mask)
    pr, _, _ = run("prime", r, mask, group)
    loo, _, _ = ADVANTAGES.get("rloo")(AdvantageInputs(r, mask, group), AlgoConfig())
    close(pr, masked_whiten(loo, mask))


# ----------------------------------------------------------------------------- PRIME


def test_prime_outcome_only():
    # lengths [3, 2, 3, 1], outcomes [1, 0, 1, 0]: leave-one-out +-2/3 on every valid token,
    # whitened over the 9 valid tokens (mean 2/9, std 2/3)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    adv, ret, _ = run("prime", torch.tensor([1.0, 0, 1, 0]), mask, torch.zeros(4))
    close(adv, [[2 / 3] * 3, [-4 / 3, -4 / 3, 0], [2 / 3] * 3, [-4 / 3, 0, 0]])
    close(ret, [[2 / 3] * 3, [-2 / 3, -2 / 3, 0], [2 / 3] * 3, [-2 / 3, 0, 0]])


def test_prime_process_and_outcome_with_the_released_coefficients():
    # group of two; process rewards [0.1, -0.2, 0] and [0.3, 0] (row means -1/30 and 0.15):
    # each token 2 p - (sum of row means); outcome +-1; times 5 each; returns-to-go, whitened
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    steps = torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 0.7]])  # 0.7 sits on padding
    cfg = AlgoConfig(outcome_coef=5.0, process_coef=5.0)
    adv, ret, m = run("prime", torch.tensor([1.0, 0.0]), mask, torch.zeros(2), cfg,
                      step_rewards=steps)  # fmt: skip
    close(ret, [[2.25, 1.833333, 4.416667], [-3.166667, -5.583333, 0]])
    close(adv, [[0.553296, 0.453061, 1.074517], [-0.749756, -1.331118, 0]])
    assert m["outcome_mean"] == pytest.approx((3 - 2) / 5, abs=1e-6)  # before its coefficient


def test_prime_without_whitening_returns_the_returns():
    mask = torch.ones(2, 2)
    cfg = AlgoConfig(prime_whiten=False, process_coef=0.5)
    steps = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    adv, ret, _ = run("prime", torch.tensor([1.0, 0.0]), mask, torch.zeros(2), cfg,
                      step_rewards=steps)  # fmt: skip
    # process: 2 p - (0.5 + 0) -> [[1.5, -0.5], [-0.5, -0.5]]; outcome +-1 on the last token
    close(adv, [[1 + 0.5 * (1.5 - 0.5), 1 - 0.25], [-1 - 0.5, -1 - 0.25]])
    assert torch.equal(adv, ret)
