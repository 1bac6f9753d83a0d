"""Advantage estimators for tree rollouts: TreePO's subgroup baselines and TreeRL's segment credit.

A tree rollout's rows are its leaves; ``segments`` [B, T] names the tree node of every token (0 on
padding), so a row's path from its group's root is the sequence of distinct nodes of its tokens
(a flat row, without segments, is one node below the root: its own row). Both estimators
register in ``perceptrl.registry.ADVANTAGES`` with ``needs=("segments",)`` and follow the code
their names come from, at the settings of its released training script; the options offer the
original's other settings. Where perceptrl differs, the docstring says how and why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..registry import ADVANTAGES
from .advantages import (
    AdvantageInputs,
    adv_metrics,
    broadcast_rows,
    group_baseline,
    group_index,
    masked_whiten,
    seq_rewards,
)

if TYPE_CHECKING:
    from .config import AlgoConfig

_ZERO = 1e-8  # TreeRL: a local value below this is "no change" and takes its parent's


def tree_paths(segments: Tensor | None, mask: Tensor, inv: Tensor) -> list[list[tuple]]:
    """Each row's path from its group's root: ``[(group,), (group, node_1), ...]`` in sampling
    order (a flat row is one node below the root: ``(group, "row", b)``). Keys are hashable."""
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


def _leaf_rewards(paths: list[list[tuple]], r: list[float]) -> dict[tuple, list[float]]:
    """The rewards of the leaves (rows) below every node."""
    below: dict[tuple, list[float]] = {}
    for path, rb in zip(paths, r):
        for node in path:
            below.setdefault(node, []).append(rb)
    return below


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


# ----------------------------------------------------------------------------- TreePO


@ADVANTAGES.register("treepo", needs=("segments",))
def treepo(inp: AdvantageInputs, cfg: AlgoConfig):
    """TreePO's tree advantage (Li et al. 2025), as ``tree_reinforce_plus_plus_baseline`` in
    multimodal-art-projection/TreePO (``verl/trainer/ppo/core_algos.py``,
    ``compute_tree_reinforce_plus_plus_baseline_outcome_advantage``, at f055523) with its
    released script's settings (``recipe/treepo/run_treepo_train.sh``).

    A leaf's entries are ``r - mean(S)`` for the subgroups ``S`` it belongs to, depth by depth:
    the whole group at depth 0 (always; a group of one takes mean 0, so its leaf keeps its
    reward), then the leaves below each node on its path with at least two leaves
    (``algo.treepo_drop_uniform_subgroups``, TreePO's ``remove_no_std_subgroup``, also skips
    those whose rewards are all equal; never depth 0). Depths run to the deepest leaf of the
    batch, exclusive, as TreePO's loop. The score is the plain mean of the entries
    (``algo.treepo_weighting=average``, the released script's) or their mean weighted by subgroup
    size (``group_size``, TreePO's code default); a node with one child repeats its leaves'
    subgroup, which then counts twice, as in TreePO. The score is broadcast over the row's
    valid tokens and whitened over every valid token of the batch (no per-group std). A flat
    batch (no segments) is ``reinforce_pp_baseline`` (TreePO needs tree ids and gives NaN
    without them).

    Args:
        inp: ``rewards``, ``mask``, ``group_id`` as ``grpo``; ``segments`` [B, T]: tree node per
            token (0 on padding), ``RolloutBatch.segments``.
    Returns:
        advantages [B, T], returns (= advantages), metrics (``tree_depth``: mean path length).
    """
    mask = inp.mask
    r = seq_rewards(inp.rewards, mask)
    inv, _ = group_index(inp.group_id)
    paths = tree_paths(inp.segments, mask, inv)
    below = _leaf_rewards(paths, r.tolist())
    deepest = max(len(p) for p in paths) - 1
    score = torch.zeros_like(r)
    for b, path in enumerate(paths):
        rb, root = float(r[b]), below[path[0]]
        entries = [(rb - (_mean(root) if len(root) > 1 else 0.0), len(root))]
        for node in path[1:deepest]:
            sub = below[node]
            uniform = max(sub) == min(sub)
            if len(sub) > 1 and not (cfg.treepo_drop_uniform_subgroups and uniform):
                entries.append((rb - _mean(sub), len(sub)))
        if cfg.treepo_weighting == "average":
            score[b] = sum(a for a, _ in entries) / len(entries)
        else:
            score[b] = sum(a * n for a, n in entries) / sum(n for _, n in entries)
    adv = masked_whiten(broadcast_rows(score, mask), mask)
    depth = sum(len(p) - 1 for p in paths) / max(len(paths), 1)
    _, _, _, group_std = group_baseline(r, inp.group_id)
    zero = (group_std <= cfg.eps).float().mean()
    return adv, adv, adv_metrics(adv, mask, tree_depth=depth, group_zero_std_frac=zero)


# ----------------------------------------------------------------------------- TreeRL


def _node_values(
    paths: list[list[tuple]], r: Tensor, groups: dict[tuple, list[float]], scale: str
) -> dict[tuple, float]:
    """TreeRL's node values: the mean leave-one-out reward of the leaves below a node, divided
    by ``sqrt`` (or by the count, or by nothing) of its leaf count; 0 at a group's root.
    ``groups``: each group root's leaf rewards."""
    loo = []
    for path, rb in zip(paths, r.tolist()):
        k, total = len(groups[path[0]]), sum(groups[path[0]])
        loo.append(rb - (total - rb) / (k - 1) if k > 1 else 0.0)
    value = {}
    for node, rs in _leaf_rewards(paths, loo).items():
        div = {"sqrt": len(rs) ** 0.5, "count": len(rs), "none": 1.0}[scale]
        value[node] = 0.0 if len(node) == 1 else _mean(rs) / div
    return value


def _segment_credit(values: list[float], mode: str) -> list[float]:
    """The credit of each segment on one path from its values (the root's first)."""
    local = [v - p for p, v in zip(values, values[1:])]
    if mode == "ancestors":  # mean gain over the root and every earlier segment
        return [sum(v - a for a in values[: i + 1]) / (i + 1) for i, v in enumerate(values[1:])]
    if mode == "value":
        return values[1:]
    for i in range(1, len(local)):  # TreeRL's fill_in_paths: no change takes the previous gain
        if abs(local[i]) < _ZERO:
            local[i] = local[i - 1]
    if mode == "local":
        return local
    return [g + v for g, v in zip(local, values[1:])]


@ADVANTAGES.register("treerl", needs=("segments",))
def treerl(inp: AdvantageInputs, cfg: AlgoConfig):
    """TreeRL's segment credit (Hou et al. 2025), as THUDM/TreeRL at f0edbea
    (``openrlhf/trainer/ppo_utils/tree_node.py``, ``parallel_mcts.py``) with its released
    script's settings (``scripts/treerl-qw14b.sh``: ``use_state_value_reward``,
    ``use_weighted_value`` with ``weighted_value_style sqrt``).

    Each leaf's reward becomes leave-one-out over its group, ``R'_i = r_i - mean(r_j, j != i)``;
    a node's value ``V(n)`` is the mean ``R'`` of the leaves below it divided by the square root
    of their number (``algo.treerl_value_scale``: ``count`` divides by the number, ``none`` not at
    all), and ``V(root) = 0``. Every token of segment ``n`` (parent ``p``) gets, by
    ``algo.treerl_credit``: ``state_value`` (released) ``(V(n) - V(p)) + V(n)``, the local gain
    plus the global one; ``local`` ``V(n) - V(p)`` (TreeRL's default without a mode flag);
    ``value`` ``V(n)``; ``ancestors`` the mean of ``V(n) - V(a)`` over the root and every earlier
    segment ``a`` of the path (``advantage_mix_allancestor``). In ``state_value`` and ``local`` a
    local gain of 0 (a node with one child) takes the previous segment's, as TreeRL's
    ``fill_in_paths``. No further normalisation; returns are the advantages; groups of one get 0
    (TreeRL needs two leaves). A flat row is one node: ``2 R'`` in ``state_value``.

    Differs from TreeRL in what surrounds it: every leaf is trained (TreeRL trains 16 of its 30
    leaves, which enter its values' counts only where selected), and a row that ran out of
    tokens keeps its reward (TreeRL's ``mask_repeated_samples`` sets the whole row to -1; a
    length penalty is a reward here).

    Args:
        inp: ``rewards``, ``mask``, ``group_id`` as ``grpo``; ``segments`` [B, T]: tree node per
            token (0 on padding), ``RolloutBatch.segments``.
    Returns:
        advantages [B, T], returns [B, T], metrics.
    """
    mask, segments = inp.mask, inp.segments
    r = seq_rewards(inp.rewards, mask)
    inv, _ = group_index(inp.group_id)
    paths = tree_paths(segments, mask, inv)
    groups = _leaf_rewards([p[:1] for p in paths], r.tolist())
    value = _node_values(paths, r, groups, cfg.treerl_value_scale)
    adv = torch.zeros_like(mask, dtype=r.dtype)
    for b, path in enumerate(paths):
        if len(groups[path[0]]) < 2:
            continue
        credit = _segment_credit([value[n] for n in path], cfg.treerl_credit)
        if path[1][1] == "row":  # a flat row: one node
            adv[b] = credit[0]
            continue
        for node, c in zip(path[1:], credit):
            adv[b][segments[b] == node[1]] = c
    adv = torch.where(mask > 0, adv, 0.0)
    return adv, adv, adv_metrics(adv, mask)
