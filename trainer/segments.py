"""`Segments`: a rollout's structure as data, the table every reader of a batch's shape indexes.

A rollout row is its prompt (``RolloutBatch.prompts``, the root) followed by segments: runs of
tokens the policy sampled (``POLICY``: a completion, a tree segment, a turn) or the environment
answered (``OBSERVATION``: in the context, out of the loss). Rows that share a segment share
its tokens and everything before it. So:

* a flat group is a shared root with one policy segment per row;
* an episode alternates policy and observation segments along one row;
* a tree (``rollout.tree``; a VLA tree of policy steps) shares interior segments between the
  rows below them, and an episode tree does both.

The table holds, for each segment, its parent (-1: it follows the prompt), kind, first column
and length, and a row that holds it; for each token, its segment (-1 on padding). Writers build
it where the structure is known (the sampler's tape, the VLA tree collector: `from_tokens`, or
`flat` for rows of one completion); readers take it by index: the training forward walks it
depth by depth (``vlm/policy.py``), the tree estimators read each row's path
(`token_ids`), the records and metrics count it. `select`, `concat` and `to` keep it; it stays
on the host, as ``prompt_index`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

POLICY, OBSERVATION = 1, 2
"""`Segments.kind`: tokens of the policy (sampled, or forced for guide rows and SFT traces);
tokens the environment answered"""


@dataclass
class Segments:
    node: Tensor
    """[B, T] long: the segment of every token, -1 on padding"""
    parent: Tensor
    """[N] long: each segment's parent segment, -1 when it follows the prompt"""
    kind: Tensor
    """[N] long: `POLICY` or `OBSERVATION`"""
    start: Tensor
    """[N] long: its first column (the same in every row that holds it)"""
    length: Tensor
    """[N] long: its tokens"""
    holder: Tensor
    """[N] long: the first row that holds it (its tokens are read there)"""
    branches: bool = False
    """rows branch from shared segments below the prompt (the schedule forks: a tree)"""
    vision: list = field(default_factory=list)
    """[N] each observation segment's vision inputs (``pixel_values``, ``image_grid_thw`` ...),
    stored once however many rows hold it; None for the others (empty: no images anywhere)"""

    def __len__(self) -> int:
        return int(self.parent.numel())

    # ---- writers ------------------------------------------------------------------------------

    @classmethod
    def flat(cls, mask: Tensor) -> Segments:
        """One policy segment per row over its tokens (``mask`` [B, T] > 0, contiguous from
        column 0): the layout of flat groups."""
        valid = (mask > 0).cpu()
        B = valid.shape[0]
        kind = torch.where(valid, POLICY, 0)
        return cls.from_tokens(torch.zeros_like(kind), kind, torch.arange(B))

    @classmethod
    def from_tokens(
        cls, ids: Tensor, kind: Tensor, group: Tensor, branches: bool = False
    ) -> Segments:
        """The table (segments numbered in the order rows first hold them) of rows whose tokens
        carry segment ids (``ids`` [B, T]: equal ids of the same
        ``kind`` in rows of one ``group`` [B] are one shared segment; 0: a segment of the row's
        own, one per contiguous run) and kinds (``kind`` [B, T]: `POLICY`, `OBSERVATION`, 0 on
        padding). A segment's tokens are contiguous in every row that holds it."""
        ids, kind, group = ids.cpu().long(), kind.cpu().long(), group.cpu().long()
        B, T = kind.shape
        valid = kind > 0
        prev_kind = torch.nn.functional.pad(kind[:, :-1], (1, 0))
        prev_ids = torch.nn.functional.pad(ids[:, :-1], (1, 0), value=-1)
        starts = valid & ((kind != prev_kind) | (ids != prev_ids))
        run = starts.long().cumsum(1)  # [B, T] run number within the row
        rows = torch.arange(B)[:, None].expand(B, T)
        cols = torch.arange(T)[None].expand(B, T)
        shared = (
            (group[:, None] * ((int(ids.max()) if ids.numel() else 0) + 1) + ids) * 3 + kind
        ) + 1
        own = -(rows * (T + 1) + run) - 1  # a run of id 0: the row's own
        key = torch.where(ids > 0, shared, own)[valid]
        uniq, inv = torch.unique(key, return_inverse=True)
        N = len(uniq)
        node = torch.full((B, T), -1, dtype=torch.long)
        node[valid] = inv
        big = torch.full((N,), B * T, dtype=torch.long)
        first = big.scatter_reduce(0, inv, cols[valid], "amin")
        last = torch.zeros(N, dtype=torch.long).scatter_reduce(0, inv, cols[valid], "amax")
        holder = big.scatter_reduce(0, inv, rows[valid], "amin")
        seg_kind = torch.zeros(N, dtype=torch.long).scatter(0, inv, kind[valid])
        parent = torch.full((N,), -1, dtype=torch.long)
        b, t = (starts & (cols > 0)).nonzero(as_tuple=True)
        parent[node[b, t]] = node[b, t - 1]
        table = cls(node, parent, seg_kind, first, last - first + 1, holder, branches)
        return table._numbered(torch.argsort(holder * (T + 1) + first))

    def _numbered(self, order: Tensor) -> Segments:
        """The same table with segment ``order[i]`` renumbered ``i``."""
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order))
        node = torch.where(self.node >= 0, rank[self.node.clamp(min=0)], -1)
        parent = self.parent[order]
        parent = torch.where(parent >= 0, rank[parent.clamp(min=0)], -1)
        return Segments(node, parent, self.kind[order], self.start[order], self.length[order],
                        self.holder[order], self.branches, _pick(self.vision, order))  # fmt: skip

    # ---- readers ------------------------------------------------------------------------------

    def depth(self) -> Tensor:
        """[N] segments above each one (0: it follows the prompt)."""
        depth = torch.zeros_like(self.parent)
        up = self.parent.clone()
        while (up >= 0).any():
            depth += (up >= 0).long()
            up = torch.where(up >= 0, self.parent[up.clamp(min=0)], -1)
        return depth

    def mask(self, kind: int) -> Tensor:
        """[B, T] float: 1 on the tokens of segments of ``kind``."""
        on = self.node >= 0
        k = self.kind[self.node.clamp(min=0)]
        return (on & (k == kind)).float()

    def attention(self) -> Tensor:
        """[B, T] float: 1 on every token a forward attends to (policy and observation)."""
        return (self.node >= 0).float()

    def token_ids(self) -> Tensor:
        """[B, T] long: 1 + the segment of every policy token, 0 elsewhere: the node ids the
        tree estimators read (rows holding the same id share that segment)."""
        return torch.where(self.mask(POLICY) > 0, self.node + 1, 0)

    def row_segments(self, kind: int) -> list[list[int]]:
        """Each row's segments of ``kind``, in order."""
        on = self.mask(kind) > 0
        return [self.node[b][on[b]].unique_consecutive().tolist() for b in range(len(on))]

    def attach_vision(self, observed: list[list[dict]]) -> None:
        """Set `vision` from each row's observations' vision inputs in order (``observed[b]``:
        one dict per observation segment of row b, {} for a text one), once per segment, from
        the first row holding it (rows below a fork hold the same)."""
        if not any(v for row in observed for v in row):
            return
        vision: list = [None] * len(self)
        for segs, row in zip(self.row_segments(OBSERVATION), observed):
            for s, v in zip(segs, row):
                if vision[s] is None and v:
                    vision[s] = v
        self.vision = vision

    def row_vision(self) -> dict[str, list[Tensor | None]]:
        """Each row's observation vision inputs, its observation segments' in order, per key
        (None for a row without); {} when the batch has no observation images."""
        if not any(v for v in self.vision):
            return {}
        keys = sorted({k for v in self.vision if v for k in v})
        out: dict[str, list[Tensor | None]] = {k: [] for k in keys}
        for row in self.row_segments(OBSERVATION):
            segs = [s for s in row if self.vision[s]]
            for k in keys:
                parts = [self.vision[s][k] for s in segs if k in self.vision[s]]
                out[k].append(torch.cat(parts) if parts else None)
        return out

    def shares_vision(self) -> bool:
        """Whether an observation segment with images is held by more than one row."""
        if not any(v for v in self.vision):
            return False
        rows = torch.arange(self.node.shape[0])[:, None].expand_as(self.node)
        pairs = torch.unique(torch.stack([self.node, rows], -1)[self.node >= 0], dim=0)
        held = torch.bincount(pairs[:, 0], minlength=len(self))
        return any(held[s] > 1 for s, v in enumerate(self.vision) if v)

    def decoded(self) -> int:
        """Tokens the sampler decoded: every policy segment once, however many rows hold it."""
        return int(self.length[self.kind == POLICY].sum())

    # ---- the batch's operations -----------------------------------------------------------------

    def select(self, idx: Tensor) -> Segments:
        """The table of rows ``idx`` (in that order): only the segments they hold, renumbered."""
        node = self.node[idx.cpu()]
        used = torch.unique(node[node >= 0])
        remap = torch.full((len(self),), -1, dtype=torch.long)
        remap[used] = torch.arange(len(used))
        node = torch.where(node >= 0, remap[node.clamp(min=0)], -1)
        parent = self.parent[used]
        parent = torch.where(parent >= 0, remap[parent.clamp(min=0)], -1)
        valid = node >= 0
        rows = torch.arange(node.shape[0])[:, None].expand_as(node)
        holder = torch.full((len(used),), node.numel(), dtype=torch.long)
        holder = holder.scatter_reduce(0, node[valid], rows[valid], "amin")
        return Segments(node, parent, self.kind[used], self.start[used], self.length[used],
                        holder, self.branches, _pick(self.vision, used))  # fmt: skip

    @staticmethod
    def concat(parts: list[Segments]) -> Segments:
        """Tables of batches stacked row-wise (their segments apart, ``node`` right-padded)."""
        T = max(p.node.shape[1] for p in parts)
        nodes, parents, holders, n, b = [], [], [], 0, 0
        for p in parts:
            pad = torch.nn.functional.pad(p.node, (0, T - p.node.shape[1]), value=-1)
            nodes.append(torch.where(pad >= 0, pad + n, -1))
            parents.append(torch.where(p.parent >= 0, p.parent + n, -1))
            holders.append(p.holder + b)
            n, b = n + len(p), b + p.node.shape[0]
        vision = []
        if any(p.vision for p in parts):
            vision = [v for p in parts for v in (p.vision or [None] * len(p))]
        return Segments(
            torch.cat(nodes), torch.cat(parents), torch.cat([p.kind for p in parts]),
            torch.cat([p.start for p in parts]), torch.cat([p.length for p in parts]),
            torch.cat(holders), any(p.branches for p in parts), vision,
        )  # fmt: skip


def _pick(vision: list, idx: Tensor) -> list:
    """``vision`` at segments ``idx`` (empty stays empty)."""
    return [vision[i] for i in idx.tolist()] if vision else []
