"""Tree and process-reward estimators against cases computed by hand from the original code's
rule (TreePO's ``compute_tree_reinforce_plus_plus_baseline_outcome_advantage``, TreeRL's
``tree_node.py`` / ``parallel_mcts.py``, verl's ``recipe/prime``; commits in the estimators'
docstrings): several tree shapes, singleton groups, uniform subgroups, masked tokens, and their
flat limits."""

from __future__ import annotations

import math
import random

import pytest
import torch

from perceptrl.registry import ADVANTAGES
from perceptrl.trainer.advantages import (
    AdvantageInputs,
    adv_metrics,
    broadcast_rows,
    group_baseline,
    group_index,
    masked_whiten,
    seq_rewards,
)
from perceptrl.trainer.config import AlgoConfig
from perceptrl.trainer.tree_advantages import tree_index

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


# ----------------------------------------------------------------------------- vectorised = per-row
# The former per-row implementation of treepo and treerl (trainer/tree_advantages.py before its
# vectorisation), kept unchanged as an oracle: each row's path rebuilt as a list of tuple keys,
# node statistics in dicts, Python loops over rows. The estimators must match it on random trees.


def _ref_tree_paths(segments, mask, inv):
    out = []
    for b in range(mask.shape[0]):
        g = int(inv[b])
        if segments is None:
            out.append([(g,), (g, "row", b)])
            continue
        seq = segments[b][(mask[b] > 0) & (segments[b] > 0)].tolist()
        path = [(g,)]
        for n in seq:
            if path[-1] != (g, n):
                path.append((g, n))
        out.append(path if len(path) > 1 else [(g,), (g, "row", b)])
    return out


def _ref_leaf_rewards(paths, r):
    below = {}
    for path, rb in zip(paths, r):
        for node in path:
            below.setdefault(node, []).append(rb)
    return below


def _ref_mean(xs):
    return sum(xs) / len(xs)


def _reference_treepo(inp, cfg):
    mask = inp.mask
    r = seq_rewards(inp.rewards, mask)
    inv, _ = group_index(inp.group_id)
    paths = _ref_tree_paths(inp.segments, mask, inv)
    below = _ref_leaf_rewards(paths, r.tolist())
    deepest = max(len(p) for p in paths) - 1
    score = torch.zeros_like(r)
    for b, path in enumerate(paths):
        rb, root = float(r[b]), below[path[0]]
        entries = [(rb - (_ref_mean(root) if len(root) > 1 else 0.0), len(root))]
        for node in path[1:deepest]:
            sub = below[node]
            uniform = max(sub) == min(sub)
            if len(sub) > 1 and not (cfg.treepo_drop_uniform_subgroups and uniform):
                entries.append((rb - _ref_mean(sub), len(sub)))
        if cfg.treepo_weighting == "average":
            score[b] = sum(a for a, _ in entries) / len(entries)
        else:
            score[b] = sum(a * n for a, n in entries) / sum(n for _, n in entries)
    adv = masked_whiten(broadcast_rows(score, mask), mask)
    depth = sum(len(p) - 1 for p in paths) / max(len(paths), 1)
    _, _, _, group_std = group_baseline(r, inp.group_id)
    zero = (group_std <= cfg.eps).float().mean()
    return adv, adv, adv_metrics(adv, mask, tree_depth=depth, group_zero_std_frac=zero)


def _ref_node_values(paths, r, groups, scale):
    loo = []
    for path, rb in zip(paths, r.tolist()):
        k, total = len(groups[path[0]]), sum(groups[path[0]])
        loo.append(rb - (total - rb) / (k - 1) if k > 1 else 0.0)
    value = {}
    for node, rs in _ref_leaf_rewards(paths, loo).items():
        div = {"sqrt": len(rs) ** 0.5, "count": len(rs), "none": 1.0}[scale]
        value[node] = 0.0 if len(node) == 1 else _ref_mean(rs) / div
    return value


def _ref_segment_credit(values, mode):
    local = [v - p for p, v in zip(values, values[1:])]
    if mode == "ancestors":
        return [sum(v - a for a in values[: i + 1]) / (i + 1) for i, v in enumerate(values[1:])]
    if mode == "value":
        return values[1:]
    for i in range(1, len(local)):
        if abs(local[i]) < 1e-8:
            local[i] = local[i - 1]
    if mode == "local":
        return local
    return [g + v for g, v in zip(local, values[1:])]


def _reference_treerl(inp, cfg):
    mask, segments = inp.mask, inp.segments
    r = seq_rewards(inp.rewards, mask)
    inv, _ = group_index(inp.group_id)
    paths = _ref_tree_paths(segments, mask, inv)
    groups = _ref_leaf_rewards([p[:1] for p in paths], r.tolist())
    value = _ref_node_values(paths, r, groups, cfg.treerl_value_scale)
    adv = torch.zeros_like(mask, dtype=r.dtype)
    for b, path in enumerate(paths):
        if len(groups[path[0]]) < 2:
            continue
        credit = _ref_segment_credit([value[n] for n in path], cfg.treerl_credit)
        if path[1][1] == "row":
            adv[b] = credit[0]
            continue
        for node, c in zip(path[1:], credit):
            adv[b][segments[b] == node[1]] = c
    adv = torch.where(mask > 0, adv, 0.0)
    return adv, adv, adv_metrics(adv, mask)


def _random_group(rng, n_leaves_max):
    """One random tree: [(path of node ids, tokens per node)] per leaf, ids shuffled."""
    depth = rng.randint(1, 3)
    leaves, next_id = [], [0]

    def grow(path, d):
        if d == depth or (d > 0 and rng.random() < 0.2):
            leaves.append(path)  # d < depth: a row that ended before the last depth
            return
        for _ in range(rng.choice([1, 1, 2, 2, 3])):
            if len(leaves) >= n_leaves_max:
                return
            next_id[0] += 1
            grow([*path, next_id[0]], d + 1)

    grow([], 0)
    if n_leaves_max > 1 and rng.random() < 0.3:
        leaves.append(rng.choice(leaves))  # two rows on one path: their leaf is a subgroup
    ids = list(range(1, next_id[0] + 1))
    rng.shuffle(ids)  # numbering order is not depth order
    sizes = {n: rng.randint(1, 3) for n in range(1, next_id[0] + 1)}
    return [[(ids[n - 1], sizes[n]) for n in path] for path in leaves if path]


def _random_tree_batch(seed):
    """Several groups of random trees (one of them a single leaf), rows shuffled, masked holes,
    binary or graded rewards (so some subgroups are uniform), per-row or per-token rewards."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows, groups = [], []
    for g in range(rng.randint(1, 5)):
        tree = _random_group(rng, 1 if g == 0 else 8)
        rows += tree
        groups += [rng.randint(0, 3) * 10 + g] * len(tree)  # sparse, unordered group ids
    order = list(range(len(rows)))
    rng.shuffle(order)
    T = max(sum(k for _, k in rows[i]) for i in order) + rng.randint(0, 2)
    seg, mask = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(len(rows), T)
    for b, i in enumerate(order):
        toks = [n for n, k in rows[i] for _ in range(k)]
        seg[b, : len(toks)] = torch.tensor(toks)
        mask[b, : len(toks)] = (torch.rand(len(toks), generator=gen) > 0.15).float()  # holes
    if rng.random() < 0.2:
        mask[rng.randrange(len(rows))] = 0  # a row with no valid token
    values = [0.0, 1.0] if rng.random() < 0.6 else [0.0, 0.25, 0.5, 1.0]
    r = torch.tensor([rng.choice(values) for _ in order])
    if rng.random() < 0.3:  # per-token rewards, summed over valid tokens
        r = r[:, None] * torch.rand(len(rows), T, generator=gen)
    group = torch.tensor([groups[i] for i in order])
    return AdvantageInputs(r, mask, group, segments=seg)


def _random_flat_batch(seed):
    """No segments: four groups (one of them of one row), rows shuffled, masked holes."""
    g = torch.Generator().manual_seed(seed)
    sizes = [1] + torch.randint(1, 6, (3,), generator=g).tolist()  # a group of one
    group = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))
    B = len(group)
    r = torch.randint(0, 2, (B,), generator=g).float()
    mask = (torch.rand(B, 4, generator=g) > 0.2).float()
    return AdvantageInputs(r, mask, group[torch.randperm(B, generator=g)])


OPTIONS = {
    "treepo": [{"treepo_weighting": w, "treepo_drop_uniform_subgroups": d}
               for w in ("average", "group_size") for d in (False, True)],
    "treerl": [{"treerl_value_scale": s, "treerl_credit": c}
               for s in ("sqrt", "count", "none")
               for c in ("state_value", "local", "value", "ancestors")],
}  # fmt: skip
REFERENCE = {"treepo": _reference_treepo, "treerl": _reference_treerl}


def test_tree_index_reads_each_rows_path():
    # UNEVEN: row 0 stops at depth 1; a masked token inside a node does not split it
    mask = UNEVEN_MASK.clone()
    mask[1, 1] = 0  # row 1 loses node 4: its path is 2, 6
    tree = tree_index(UNEVEN_SEGMENTS, mask, torch.zeros(5, dtype=torch.long))
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])  # dense index = id - 1 here (sorted keys)
    want = [[1, -1, -1], [2, 6, -1], [2, 4, 7], [2, 5, 8], [3, 9, -1]]
    path = torch.where(tree.path >= 0, ids[tree.path.clamp(min=0)], -1)
    assert path.tolist() == want and tree.n_nodes == 9
    assert tree.length.tolist() == [1, 2, 3, 3, 2]
    assert tree.token_depth.tolist() == [[0, -1, -1], [0, -1, 1], [0, 1, 2], [0, 1, 2], [0, 1, 1]]
    flat = tree_index(None, torch.ones(3, 2), torch.tensor([0, 0, 1]))  # one node per row
    assert flat.path.tolist() == [[2], [1], [0]] and flat.token_depth.eq(0).all()


@pytest.mark.parametrize("name", ["treepo", "treerl"])
@pytest.mark.parametrize("flat", [False, True], ids=["tree", "flat"])
def test_vectorised_estimators_match_the_per_row_reference(name, flat):
    for seed in range(40 if not flat else 10):
        inp = _random_flat_batch(seed) if flat else _random_tree_batch(seed)
        for options in OPTIONS[name]:
            cfg = AlgoConfig(**options)
            adv, ret, metrics = ADVANTAGES.get(name)(inp, cfg)
            want_adv, want_ret, want_metrics = REFERENCE[name](inp, cfg)
            where = f"seed {seed}, {options}"
            torch.testing.assert_close(adv, want_adv, atol=1e-6, rtol=0, msg=where)
            torch.testing.assert_close(ret, want_ret, atol=1e-6, rtol=0, msg=where)
            assert metrics.keys() == want_metrics.keys(), where
            for key, value in want_metrics.items():
                assert metrics[key] == pytest.approx(value, abs=1e-6), (where, key)
