"""Advantage estimators for tree rollouts: TreePO's subgroup baselines and TreeRL's segment credit.

A tree rollout's rows are its leaves; ``segments`` [B, T] names the tree node of every token (0 on
padding), so a row's path from its group's root is the sequence of distinct nodes of its tokens
(a flat row, without segments, is one node below the root: its own row). Both estimators read
the tree by index, batched: `tree_index` gives every row's path as dense node indices, node
statistics are scatter sums over those paths, and only TreeRL's zero-gain fill loops (over
depth, never over rows). Both register in ``perceptrl.registry.ADVANTAGES`` with
``needs=("segments",)`` and follow the code their names come from, at the settings of its
released training script; the options offer the original's other settings. Where perceptrl
differs, the docstring says how and why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
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


class TreeIndex(NamedTuple):
    """Every row's path from its group's root, by dense node index (the root itself is not on
    it: a group's root statistics are its group's). Nodes are the distinct (group, node id)
    pairs of the batch, plus one node of its own for each row without node ids (a flat row).

    ``path`` [B, D]: the node at each depth below the root, in sampling order, -1 past the
    row's leaf (D: the batch's longest path). ``length`` [B]: nodes on the path (>= 1).
    ``token_depth`` [B, T]: the depth on its row's path of each token's node, -1 on tokens
    without one (padding, masked, node id 0); every token of a flat row is at depth 0.
    ``n_nodes``: N, the number of nodes.
    """

    path: Tensor
    length: Tensor
    token_depth: Tensor
    n_nodes: int


def tree_index(segments: Tensor | None, mask: Tensor, inv: Tensor) -> TreeIndex:
    """Each row's path (see `TreeIndex`) from ``segments`` [B, T] (None: every row is flat),
    ``mask`` [B, T] and the dense group index ``inv`` [B]. A new node starts at a valid token
    (mask > 0, id > 0) whose id differs from the previous valid token's: a node's tokens are
    contiguous in its rows, and masked tokens inside it do not split it."""
    B, T = mask.shape
    dev = mask.device
    seg = torch.zeros(B, T, dtype=torch.long, device=dev) if segments is None else segments.long()
    on = (mask > 0) & (seg > 0)  # [B, T] tokens that name a node
    pos = torch.where(on, torch.arange(T, device=dev), -1)
    prev = F.pad(pos.cummax(dim=1).values[:, :-1], (1, 0), value=-1)  # last valid token before
    start = on & ((prev < 0) | (seg.gather(1, prev.clamp(min=0)) != seg))  # [B, T]
    depth = start.long().cumsum(dim=1) - 1  # [B, T]
    length = start.sum(dim=1)  # [B]
    flat = length == 0  # no node ids: the row is one node of its own
    b, t = start.nonzero(as_tuple=True)
    rows = torch.arange(B, device=dev)
    key = torch.cat([inv[b] * (int(seg.max()) + 1) + seg[b, t], -1 - rows[flat]])  # (group, id)
    uniq, node = torch.unique(key, return_inverse=True)
    path = torch.full((B, max(int(length.max()), 1)), -1, dtype=torch.long, device=dev)
    path[b, depth[b, t]] = node[: len(b)]
    path[rows[flat], 0] = node[len(b) :]
    token_depth = torch.where(on, depth, -1)
    token_depth[flat] = 0
    return TreeIndex(path, length.clamp(min=1), token_depth, int(uniq.numel()))


def _node_sums(tree: TreeIndex, x: Tensor) -> tuple[Tensor, Tensor]:
    """The number of leaves (rows) below every node and the sum of their ``x`` [B]: [N] each."""
    on = tree.path >= 0  # [B, D]
    node = tree.path.clamp(min=0).flatten()
    zeros = x.new_zeros(tree.n_nodes)
    count = zeros.index_add(0, node, on.flatten().to(x.dtype))
    total = zeros.index_add(0, node, torch.where(on, x[:, None], 0.0).flatten())
    return count, total


def _group_sums(x: Tensor, inv: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's group size and the sum of its group's ``x`` [B]: [B] each."""
    zeros = x.new_zeros(int(inv.max()) + 1)
    return zeros.index_add(0, inv, torch.ones_like(x))[inv], zeros.index_add(0, inv, x)[inv]


def _at(table: Tensor, path: Tensor) -> Tensor:
    """``table`` [N] read at every node of ``path`` [B, D]; 0 past a row's leaf."""
    return torch.where(path >= 0, table[path.clamp(min=0)], 0.0)


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
    tree = tree_index(inp.segments, mask, inv)
    score = _treepo_scores(tree, r.double(), inv, cfg).to(r.dtype)  # in float64, as before
    adv = masked_whiten(broadcast_rows(score, mask), mask)
    depth = int(tree.length.sum()) / max(len(r), 1)
    _, _, _, group_std = group_baseline(r, inp.group_id)
    zero = (group_std <= cfg.eps).float().mean()
    return adv, adv, adv_metrics(adv, mask, tree_depth=depth, group_zero_std_frac=zero)


def _treepo_scores(tree: TreeIndex, r: Tensor, inv: Tensor, cfg: AlgoConfig) -> Tensor:
    """Each leaf's TreePO score [B] from its rewards ``r`` [B]: its root entry and its path's
    subgroups above the batch's deepest depth, averaged or weighted by subgroup size."""
    n_root, root_sum = _group_sums(r, inv)  # [B] each
    root = r - torch.where(n_root > 1, root_sum / n_root, 0.0)  # a group of one: mean 0
    count, total = _node_sums(tree, r)  # [N] each
    sub = tree.path[:, :-1]  # [B, D - 1]: the deepest depth is never a subgroup
    n = _at(count, sub)
    keep = n > 1
    if cfg.treepo_drop_uniform_subgroups:
        on, node = tree.path >= 0, tree.path.clamp(min=0).flatten()  # [B, D], [B * D]
        hi = torch.where(on, r[:, None], -torch.inf).flatten()  # each node's leaf rewards
        lo = torch.where(on, r[:, None], torch.inf).flatten()
        hi = r.new_full((tree.n_nodes,), -torch.inf).scatter_reduce(0, node, hi, "amax")
        lo = r.new_full((tree.n_nodes,), torch.inf).scatter_reduce(0, node, lo, "amin")
        keep &= _at((hi > lo).to(r.dtype), sub) > 0  # not all equal
    entry = torch.where(keep, r[:, None] - _at(total, sub) / n.clamp(min=1), 0.0)  # [B, D - 1]
    n = torch.where(keep, n, 0.0)
    if cfg.treepo_weighting == "average":
        entries, weights = root, 1 + keep.sum(dim=1)
    else:
        entry, entries, weights = entry * n, root * n_root, n_root + n.sum(dim=1)
    for d in range(entry.shape[1]):  # summed in depth order, as the per-row code did
        entries = entries + entry[:, d]
    return entries / weights


# ----------------------------------------------------------------------------- TreeRL


def _node_values(tree: TreeIndex, loo: Tensor, scale: str) -> Tensor:
    """TreeRL's node values along every path, [B, D + 1] (the root's 0 first, 0 past the
    leaf): the mean leave-one-out reward ``loo`` [B] of the leaves below a node, divided by
    ``sqrt`` (or by the count, or by nothing) of its leaf count."""
    count, total = _node_sums(tree, loo)  # [N] each
    div = {"sqrt": count.sqrt(), "count": count, "none": torch.ones_like(count)}[scale]
    value = _at(total / count / div, tree.path)  # [B, D]
    return F.pad(value, (1, 0))


def _segment_credit(values: Tensor, mode: str) -> Tensor:
    """The credit [B, D] of each segment on every path from its values [B, D + 1] (the root's
    first); past a row's leaf the credit is meaningless and unread."""
    local = values[:, 1:] - values[:, :-1]  # [B, D]
    if mode == "ancestors":  # mean gain over the root and every earlier segment
        gain = torch.zeros_like(local)
        for a in range(local.shape[1]):  # ancestor a, in the per-row code's order
            gain[:, a:] += values[:, a + 1 :] - values[:, a : a + 1]  # [B, D - a]
        return gain / torch.arange(1, values.shape[1], device=values.device, dtype=values.dtype)
    if mode == "value":
        return values[:, 1:]
    for i in range(1, local.shape[1]):  # TreeRL's fill_in_paths: no change takes the previous gain
        local[:, i] = torch.where(local[:, i].abs() < _ZERO, local[:, i - 1], local[:, i])
    if mode == "local":
        return local
    return local + values[:, 1:]


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
    mask = inp.mask
    r = seq_rewards(inp.rewards, mask)
    inv, _ = group_index(inp.group_id)
    tree = tree_index(inp.segments, mask, inv)
    r64 = r.double()  # in float64, as before
    k, total = _group_sums(r64, inv)  # [B] each
    loo = torch.where(k > 1, r64 - (total - r64) / (k - 1).clamp(min=1), 0.0)
    values = _node_values(tree, loo, cfg.treerl_value_scale)  # [B, D + 1]
    credit = _segment_credit(values, cfg.treerl_credit)  # [B, D]
    adv = credit.gather(1, tree.token_depth.clamp(min=0))  # [B, T]
    keep = (mask > 0) & (tree.token_depth >= 0) & (k[:, None] > 1)  # TreeRL needs two leaves
    adv = torch.where(keep, adv, 0.0).to(r.dtype)
    return adv, adv, adv_metrics(adv, mask)
