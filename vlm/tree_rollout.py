"""Tree sampling: each prompt's completions grow as a tree of segments that share their prefixes.

A prompt is prefilled once (vision tower included) and its KV cache forked to ``branches[0]``
rows; every row samples a segment of ``segment_tokens`` tokens; at the segment's end each row
still going is forked (its cache row copied, not recomputed) into ``branches[1]`` children,
and so on; the segment of the last depth runs to the stop token or ``max_new_tokens``. A
branch that emits the stop token ends there: it is a leaf, and its share of the prompt's
leaves goes to the branches still running at the next fork (TreePO's fallback), so a prompt
has ``prod(branches)`` leaves unless every branch ends first. Every leaf is an ordinary
completion row (its ancestors' tokens copied in), so rewards, losses and the loop see a flat
batch; ``RolloutBatch.segments`` [B, T] names the tree node each token was sampled in (1, 2,
... within a prompt; 0 on padding), the structure the tree estimators read
(``trainer/advantages.py``).

A flat GRPO group is the tree of depth one (``branches = [G]``): its prompt is prefilled once
and forked to G rows instead of being re-encoded G times as ``generate`` on G copies does, and
rows that stop leave the batch. `VLMPolicy.sample` uses this sampler for single-turn rollouts.

Forks are spread over a depth's live branches evenly (``allocate="uniform"``: each gets the
same number of children, the remainder to random ones) or by uncertainty (``"entropy"``: every
branch gets one child, each further child goes to the branch whose next-token entropy divided
by its children so far is highest, so the tree branches where the policy is unsure).

Log-probs are those of the tempered distribution ``VLMPolicy.evaluate`` scores (one sampling
function with the episode sampler: ``kv_sampler.sample_token``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..trainer.batch import RolloutBatch
from .kv_sampler import (
    KVSampler,
    LiveRows,
    TreeShape,
    fork_plan,
    rank_within,
    sample_token,
)
from .prompts import EncodedPrompt
from .rollout import SamplingParams, generation_mode, prompt_table, row_chunks

COMPACT_FRACTION = 0.25
"""stopped rows leave the cache once they are this fraction of the live rows (a cache
``index_select`` then costs less than feeding them padding)"""


class LeafRows:
    """Fixed buffers of a chunk's completions (one row per leaf), written at per-row cursors."""

    def __init__(self, rows: int, width: int, pad_id: int):
        self.tokens = torch.full((rows, width), pad_id, dtype=torch.long)
        self.logp = torch.zeros((rows, width))
        self.node = torch.zeros((rows, width), dtype=torch.long)
        self.cursor = torch.zeros(rows, dtype=torch.long)
        self.stopped = torch.zeros(rows, dtype=torch.bool)
        self.prompt = torch.full((rows,), -1, dtype=torch.long)
        self.used = 0

    def take(self, n: int) -> Tensor:
        """``n`` fresh rows."""
        out = torch.arange(self.used, self.used + n)
        self.used += n
        return out

    def put(self, rows: Tensor, tok: Tensor, logp: Tensor, node: Tensor) -> None:
        at = self.cursor[rows]
        self.tokens[rows, at], self.logp[rows, at], self.node[rows, at] = tok, logp, node
        self.cursor[rows] += 1

    def put_segment(self, row: int, ids: list[int], logp: list[float], node: int) -> None:
        """A whole segment of row ``row`` (an engine that returns segments, vLLM) at its cursor."""
        at, k = int(self.cursor[row]), len(ids)
        self.tokens[row, at : at + k] = torch.tensor(ids, dtype=torch.long)
        self.logp[row, at : at + k] = torch.tensor(logp, dtype=torch.float32)
        self.node[row, at : at + k] = node
        self.cursor[row] += k

    def sequence(self, row: int) -> list[int]:
        """Row ``row``'s tokens so far."""
        return self.tokens[row, : int(self.cursor[row])].tolist()

    def clone(self, src: Tensor) -> Tensor:
        """Fresh rows holding copies of rows ``src`` (a fork: the prefix is shared history)."""
        dst = self.take(len(src))
        for buf in (self.tokens, self.logp, self.node, self.cursor, self.stopped, self.prompt):
            buf[dst] = buf[src]
        return dst


class TreeSampler(KVSampler):
    """Samples completion trees (flat groups included) for a policy's model.

    Args:
        model, processor: the policy's.
        stop_ids, pad_id, banned: the policy's stop tokens, padding and never-sampled ids.
    """

    def sample(
        self, prompts: list[EncodedPrompt], shape: TreeShape, sp: SamplingParams
    ) -> RolloutBatch:
        """``shape.leaves`` completions per prompt (fewer when every branch of a prompt stops
        before the last fork). Returns a `RolloutBatch` like ``rollout.sample``'s (rows of one
        prompt adjacent, ``group_id`` the prompt's position, ``logp_rollout`` when
        ``sp.return_logprobs``) plus ``segments`` for trees deeper than one segment."""
        parts, start = [], 0
        lens = [p.input_ids.numel() for p in prompts]
        for chunk in row_chunks(lens, shape.leaves, sp.max_new_tokens, sp.token_budget):
            b = self._sample_chunk([prompts[i] for i in chunk], shape, sp)
            b.group_id = b.group_id + start
            start += len(chunk)
            parts.append(b)
        return RolloutBatch.concat(parts)

    def _sample_chunk(self, prompts: list[EncodedPrompt], shape: TreeShape, sp: SamplingParams):
        U, first = len(prompts), shape.branches[0]
        buf = LeafRows(U * shape.leaves, sp.max_new_tokens, self.pad_id)
        rows = buf.take(U * first)
        buf.prompt[rows] = torch.arange(U).repeat_interleave(first)
        next_node = torch.ones(U, dtype=torch.long)  # next node id of each prompt's tree
        depth = len(shape.branches)
        with generation_mode(self.model):
            live = self._prefill(prompt_table(prompts), buf.prompt[rows].clone())
            live.rows = rows
            for d in range(depth):
                last = d == depth - 1
                done = d * shape.segment_tokens
                left = sp.max_new_tokens - done
                length = left if last else min(shape.segment_tokens, left)
                prompt = buf.prompt[live.rows]
                node = next_node[prompt] + rank_within(prompt)  # one new node per live row
                next_node.index_add_(0, prompt, torch.ones_like(prompt))
                final = last or length >= left
                self._segment(live, buf, node, length, sp, final)
                if final or not len(live.rows):
                    break
                self._fork(live, buf, shape, d + 1, U)
        return leaves_batch(self.processor, prompts, buf, sp.return_logprobs, depth > 1)

    def _segment(self, live: LiveRows, buf: LeafRows, node: Tensor, length: int,
                 sp: SamplingParams, final: bool) -> None:  # fmt: skip
        """Up to ``length`` tokens of every live row; rows that stop are marked and dropped.
        The last token of the ``final`` segment is not fed (nothing follows it)."""
        stop = torch.tensor(self.stop_ids)
        gen = torch.ones(len(live.rows), dtype=torch.bool)
        for i in range(length):
            tok, logp = sample_token(live.logits, sp, self.banned)
            tok, logp = tok.cpu(), logp.cpu()
            buf.put(live.rows[gen], tok[gen], logp[gen], node[gen])
            ended = gen & torch.isin(tok, stop)
            buf.stopped[live.rows[ended]] = True
            gen = gen & ~ended
            if not gen.any() or (final and i == length - 1):
                live.keep(torch.zeros(0, dtype=torch.long))
                return
            if (~gen).sum() >= max(1, COMPACT_FRACTION * len(gen)):
                keep = gen.nonzero().squeeze(1)
                live.keep(keep)
                gen, node, tok = gen[keep], node[keep], tok[keep]
            self._step(live, tok.to(self.device), gen.to(self.device))
        keep = gen.nonzero().squeeze(1)
        live.keep(keep)

    def _fork(self, live: LiveRows, buf: LeafRows, shape: TreeShape, depth: int, U: int) -> None:
        """Each prompt's live branches get children (`fork_plan`, `LiveRows.fork`); a child
        after the first gets a fresh buffer row holding a copy of its parent's."""
        done = torch.arange(buf.used)[buf.stopped[: buf.used]]
        idx = fork_plan(buf.prompt[live.rows], buf.prompt[done], U, shape, depth, live.logits)
        live.fork(idx, buf.clone)


def leaves_batch(processor, prompts: list[EncodedPrompt], buf: LeafRows, with_logp: bool,
                 segments: bool) -> RolloutBatch:  # fmt: skip
    """The leaves recorded in ``buf`` as a `RolloutBatch`, grouped by prompt (``segments`` from
    the tree nodes when asked)."""
    rows = torch.arange(buf.used)
    order = rows[torch.argsort(buf.prompt[rows] * (buf.used + 1) + rows)]
    cursor = buf.cursor[order]
    T = max(int(cursor.max()), 1) if len(order) else 1
    tokens = buf.tokens[order, :T].clone()
    mask = (torch.arange(T)[None] < cursor[:, None]).float()
    texts = processor.batch_decode(
        [r[:c] for r, c in zip(tokens.tolist(), cursor.tolist())], skip_special_tokens=True
    )
    index = buf.prompt[order].clone()
    stopped = buf.stopped[order].tolist()
    meta = [
        {"sample": prompts[u].sample, "completion": t, "truncated": not s}
        for u, t, s in zip(index.tolist(), texts, stopped)
    ]
    return RolloutBatch(
        tokens=tokens, mask=mask, group_id=index.clone(),
        logp_rollout=buf.logp[order, :T] * mask if with_logp else None,
        segments=buf.node[order, :T].clone() if segments else None,
        prompts=prompt_table(prompts), prompt_index=index, meta=meta,
    )  # fmt: skip


def sampled_tokens(batch: RolloutBatch) -> tuple[int, int]:
    """(tokens the sampler decoded, tokens of the leaves): a segment shared by k leaves counts
    once in the first, k times in the second. Equal for flat groups."""
    leaf = int(batch.mask.sum())
    if batch.segments is None:
        return leaf, leaf
    nodes = batch.group_id.cpu()[:, None] * (int(batch.segments.max()) + 1) + batch.segments.cpu()
    valid = (batch.mask.cpu() > 0) & (batch.segments.cpu() > 0)
    keys, counts = torch.unique(nodes[valid], return_counts=True)
    sharing = torch.zeros_like(keys)  # leaves that carry each node
    for row_nodes, row_valid in zip(nodes, valid):
        sharing += torch.isin(keys, row_nodes[row_valid]).long()
    return int((counts // sharing.clamp(min=1)).sum()), leaf
