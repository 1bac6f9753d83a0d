"""Tree and process-reward estimators against small trees computed by hand (treepo, treerl,
prime), and their flat limits (a flat group is GRPO for treepo, RLOO for prime)."""

from __future__ import annotations

import math

import pytest
import torch

from perceptrl.registry import ADVANTAGES
from perceptrl.trainer.advantages import AdvantageInputs
from perceptrl.trainer.config import AlgoConfig

EPS = 1e-6

# One prompt, branches [2, 2]: segments 1 and 2 below the root, 3 and 4 below 1, 5 and 6
# below 2; two tokens per segment.
FULL_SEGMENTS = torch.tensor([[1, 1, 3, 3], [1, 1, 4, 4], [2, 2, 5, 5], [2, 2, 6, 6]])
FULL_REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0])

# Branch 1 stopped after its first segment (a leaf of depth one); its share of the leaves went
# to branch 2, which forked into 3, 4 and 5.
EARLY_SEGMENTS = torch.tensor([[1, 1, 0, 0], [2, 2, 3, 3], [2, 2, 4, 4], [2, 2, 5, 5]])
EARLY_MASK = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
EARLY_REWARDS = torch.tensor([0.0, 1.0, 1.0, 0.0])


def run(name, rewards, mask, group, cfg=None, **kw):
    adv, ret, metrics = ADVANTAGES.get(name)(
        AdvantageInputs(rewards, mask, group, **kw), cfg or AlgoConfig(eps=EPS)
    )
    assert torch.equal(adv, ret)
    return adv, metrics


def test_treepo_full_tree():
    # group mean 0.75, std 0.5; subtree 1 mean 0.5, subtree 2 mean 1; one-leaf subtrees skipped
    adv, m = run("treepo", FULL_REWARDS, torch.ones(4, 4), torch.zeros(4), segments=FULL_SEGMENTS)
    scores = [(0.25 + 0.5) / 2, (-0.75 - 0.5) / 2, (0.25 + 0.0) / 2, (0.25 + 0.0) / 2]
    want = torch.tensor(scores)[:, None].expand(4, 4) / (0.5 + EPS)
    torch.testing.assert_close(adv, want)
    assert m["tree_depth"] == 2.0


def test_treepo_early_stopped_branch():
    # root mean 0.5, std sqrt(1/3); subtree 2 (three leaves) mean 2/3; branch 1 is a one-leaf
    # subtree, so its leaf is only compared with the group
    adv, _ = run("treepo", EARLY_REWARDS, EARLY_MASK, torch.zeros(4), segments=EARLY_SEGMENTS)
    std = math.sqrt(1 / 3)
    scores = [-0.5, (0.5 + 1 / 3) / 2, (0.5 + 1 / 3) / 2, (-0.5 - 2 / 3) / 2]
    want = torch.tensor(scores)[:, None] / (std + EPS) * EARLY_MASK
    torch.testing.assert_close(adv, want)


def test_treerl_full_tree():
    # V(root) 0.75, V(1) 0.5, V(2) 1, leaves their rewards; L(1) = L(2) = 2
    adv, _ = run("treerl", FULL_REWARDS, torch.ones(4, 4), torch.zeros(4), segments=FULL_SEGMENTS)
    s1, s2 = (-0.25 - 0.25) / math.sqrt(2), (0.25 + 0.25) / math.sqrt(2)
    leaf = {3: 0.25 + 0.5, 4: -0.75 - 0.5, 5: 0.25 + 0.0, 6: 0.25 + 0.0}
    want = torch.tensor(
        [[s1, s1, leaf[3], leaf[3]], [s1, s1, leaf[4], leaf[4]],
         [s2, s2, leaf[5], leaf[5]], [s2, s2, leaf[6], leaf[6]]]
    )  # fmt: skip
    torch.testing.assert_close(adv, want)


def test_treerl_early_stopped_branch():
    # V(root) 0.5; node 1 is a leaf (reward 0); V(2) = 2/3 over three leaves
    adv, _ = run("treerl", EARLY_REWARDS, EARLY_MASK, torch.zeros(4), segments=EARLY_SEGMENTS)
    n1 = (0 - 0.5) + (0 - 0.5)
    n2 = ((2 / 3 - 0.5) + (2 / 3 - 0.5)) / math.sqrt(3)
    leaf = {3: (1 - 0.5) + (1 - 2 / 3), 4: (1 - 0.5) + (1 - 2 / 3), 5: (0 - 0.5) + (0 - 2 / 3)}
    want = torch.tensor(
        [[n1, n1, 0, 0], [n2, n2, leaf[3], leaf[3]],
         [n2, n2, leaf[4], leaf[4]], [n2, n2, leaf[5], leaf[5]]]
    )  # fmt: skip
    torch.testing.assert_close(adv, want)


def test_trees_of_two_groups_do_not_mix():
    """Node ids restart in every group: group 1's node 1 is not group 0's."""
    seg = torch.cat([FULL_SEGMENTS, FULL_SEGMENTS])
    r = torch.cat([FULL_REWARDS, 1 - FULL_REWARDS])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    for name in ("treepo", "treerl"):
        both, _ = run(name, r, torch.ones(8, 4), group, segments=seg)
        first, _ = run(name, FULL_REWARDS, torch.ones(4, 4), torch.zeros(4), segments=FULL_SEGMENTS)
        second, _ = run(name, 1 - FULL_REWARDS, torch.ones(4, 4), torch.zeros(4),
                        segments=FULL_SEGMENTS)  # fmt: skip
        torch.testing.assert_close(both, torch.cat([first, second]))


@pytest.mark.parametrize("seed", [0, 1])
def test_flat_limits(seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 2, (12,), generator=g).float()
    mask = torch.ones(12, 5)
    mask[::3, 3:] = 0
    group = torch.arange(3).repeat_interleave(4)
    cfg = AlgoConfig(eps=EPS)
    tree, _ = run("treepo", r, mask, group, cfg)
    grpo, _, _ = ADVANTAGES.get("grpo")(AdvantageInputs(r, mask, group), cfg)
    torch.testing.assert_close(tree, grpo)
    rl, _ = run("treerl", r, mask, group, cfg)
    mean = r.view(3, 4).mean(1).repeat_interleave(4)
    torch.testing.assert_close(rl, (2 * (r - mean))[:, None] * mask)
    pr, _ = run("prime", r, mask, group, cfg)
    rloo, _, _ = ADVANTAGES.get("rloo")(AdvantageInputs(r, mask, group), cfg)
    torch.testing.assert_close(pr, rloo)


def test_prime_sums_outcome_and_process_rloo():
    outcome = torch.tensor([1.0, 0.0, 0.0])
    steps = torch.tensor([[0.0, 1, 1], [1, 0, 0], [0, 0, 0]])
    # outcome RLOO: 1.5 * (r - 1/3); process: returns-to-go minus the mean of the other rows'
    # totals (2, 1, 0 -> baselines 0.5, 1, 1.5)
    want_out = torch.tensor([1.0, -0.5, -0.5])[:, None]
    want_proc = torch.tensor([[2.0, 2, 1], [1, 0, 0], [0, 0, 0]]) - torch.tensor(
        [[0.5], [1], [1.5]]
    )
    cfg = AlgoConfig(eps=EPS, process_coef=0.5)
    adv, m = run("prime", outcome, torch.ones(3, 3), torch.zeros(3), cfg, step_rewards=steps)
    torch.testing.assert_close(adv, want_out + 0.5 * want_proc)
    assert m["process_mean"] == pytest.approx(float(want_proc.mean()))
