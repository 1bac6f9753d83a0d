"""The KV-cache sampling that the tree and episode samplers share, with the tree shape both fork by.

`KVSampler` samples token by token with a Hugging Face KV cache: the distinct prompts are
prefilled once (vision tower included) and their keys/values indexed out to the rows, one token
per live row is fed per step, and `LiveRows.keep`/`fork` drop or repeat cache rows.
`sample_token` is the one sampling function (its log-probs are those of the tempered
distribution ``VLMPolicy.evaluate`` scores). `TreeShape` says how a prompt's completions
branch, and `fork_plan` which live rows get how many children at a fork (TreePO's fallback: a
stopped branch's leaves go to the live ones). The tree sampler (``vlm/tree_rollout.py``), the
episode sampler (``vlm/episode_rollout.py``) and the vLLM tree sampler (``vlm/vllm_tree.py``)
build on these.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor

from .rollout import BANNED_LOGIT, SamplingParams, collate

ROPE_GRID_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
"""Vision inputs the 3-D position index reads."""


def rope_module(model):
    """The submodule with ``get_rope_index`` (Qwen-VL's inner model), or None (1-D positions)."""
    return next((m for m in model.modules() if hasattr(m, "get_rope_index")), None)


def sequence_positions(rope, ids: Tensor, extras: dict, grids: dict) -> Tensor:
    """[3, L] positions of one unpadded sequence: ``get_rope_index`` when it holds images or
    videos (``grids``: image_grid_thw ... of its vision, in order), else 0..L-1."""
    L = ids.numel()
    if rope is None or not any(grids.get(k) is not None for k in ROPE_GRID_KEYS[:2]):
        return torch.arange(L, device=ids.device).expand(3, L)
    types = extras.get("mm_token_type_ids")
    if types is None:
        raise ValueError("3-D positions need the processor's mm_token_type_ids")
    kw = {k: v for k, v in grids.items() if k in ROPE_GRID_KEYS and v is not None}
    pos, _ = rope.get_rope_index(ids[None], types[None].to(ids.device), **kw)
    return pos[:, 0]


def batch_positions(rope, kwargs: dict) -> Tensor:
    """[3, B, L] positions of left-padded rows, each row's first token at 0 (as
    `sequence_positions` of the unpadded row, so later segments continue them exactly)."""
    ids, attn = kwargs["input_ids"], kwargs["attention_mask"]
    if rope is not None and "mm_token_type_ids" in kwargs and "image_grid_thw" in kwargs:
        kw = {k: kwargs[k] for k in ROPE_GRID_KEYS if k in kwargs}
        pos, _ = rope.get_rope_index(ids, kwargs["mm_token_type_ids"], attention_mask=attn, **kw)
        return pos
    return (attn.long().cumsum(-1) - 1).clamp(min=0).expand(3, -1, -1)


@dataclass
class LiveRows:
    """The rows still in the batch, aligned with the cache's rows."""

    rows: Tensor
    """[L] tape row of each live row"""
    attn: Tensor
    """[L, S] attention over the cache (0 on padding and holes)"""
    next_pos: Tensor
    """[L] position of the next text token"""
    logits: Tensor
    """[L, V] logits of the next token"""
    cache: object

    def fork(self, idx: Tensor, clone) -> None:
        """`keep` rows ``idx`` (sorted, a row's children adjacent), their storage rows as
        `forked_rows` gives them."""
        rows = forked_rows(self.rows, idx, clone)
        self.keep(idx)
        self.rows = rows

    def keep(self, idx: Tensor) -> None:
        """Keep rows ``idx`` [L'] in this order: a row left out is dropped, a row named twice is
        forked (its cache row copied)."""
        if len(idx) == len(self.rows) and bool((idx == torch.arange(len(idx))).all()):
            return
        self.cache.batch_select_indices(idx.to(self.attn.device))
        self.rows, self.next_pos = self.rows[idx], self.next_pos[idx.to(self.next_pos.device)]
        self.attn, self.logits = (
            self.attn[idx.to(self.attn.device)],
            self.logits[idx.to(self.logits.device)],
        )


def forked_rows(rows: Tensor, idx: Tensor, clone) -> Tensor:
    """Storage rows of the children ``rows[idx]`` (``idx`` sorted, a row's children adjacent):
    a row's first child keeps its parent's storage row, each further child gets the row
    ``clone(parent rows [M])`` returns ([M]: fresh rows holding copies of the parents')."""
    first = torch.ones(len(idx), dtype=torch.bool)
    first[1:] = idx[1:] != idx[:-1]
    out = rows[idx].clone()
    if not first.all():
        out[~first] = clone(out[~first])
    return out


class KVSampler:
    """Token-by-token sampling with a Hugging Face KV cache that rows share and fork: the distinct
    prompts are prefilled once and their keys/values indexed out to the rows (`_prefill`), one
    token per live row is fed per step (`_step`), and `LiveRows.keep` drops or repeats cache rows.
    The episode sampler and the tree sampler (``vlm/tree_rollout.py``) are built on it.

    Args:
        model, processor: the policy's.
        stop_ids, pad_id, banned: the policy's stop tokens, padding and never-sampled ids.
    """

    def __init__(self, model, processor, stop_ids: list[int], pad_id: int, banned: list[int]):
        self.model, self.processor = model, processor
        self.stop_ids, self.pad_id, self.banned = stop_ids, pad_id, banned
        self.rope = rope_module(model)
        self.device = next(model.parameters()).device
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters

    # ---- model calls ------------------------------------------------------------------------

    def _forward(self, ids: Tensor, live_attn: Tensor, pos: Tensor, cache, **vision):
        pos = pos if self.rope is not None else pos[0]
        if self._keep_arg:
            vision["logits_to_keep"] = 1
        return self.model(
            input_ids=ids, attention_mask=live_attn, position_ids=pos, past_key_values=cache,
            use_cache=True, **vision,
        )  # fmt: skip

    def _prefill(self, table: dict, index: Tensor) -> LiveRows:
        """The distinct prompts once, their keys/values indexed out to the rows."""
        from transformers import DynamicCache

        kwargs = collate(table, self.pad_id, self.device)  # [U, P], left-padded
        pos = batch_positions(self.rope, kwargs)
        vision = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")}
        if self.rope is not None:
            vision.pop("mm_token_type_ids", None)  # positions are given
        cache = DynamicCache()
        out = self._forward(kwargs["input_ids"], kwargs["attention_mask"], pos, cache, **vision)
        idx = index.to(self.device)
        cache.batch_select_indices(idx)
        return LiveRows(
            rows=torch.arange(len(index)), attn=kwargs["attention_mask"][idx],
            next_pos=pos.amax(dim=(0, 2))[idx] + 1, logits=out.logits[idx, -1], cache=cache,
        )  # fmt: skip

    def _step(self, live: LiveRows, tok: Tensor, feed: Tensor) -> None:
        """Feed one token per live row (padding with attention 0 where ``feed`` is False)."""
        ids = torch.where(feed, tok, torch.full_like(tok, self.pad_id))[:, None]
        live.attn = torch.cat([live.attn, feed.long()[:, None]], dim=1)
        pos = live.next_pos[:, None].expand(3, -1, 1)
        live.logits = self._forward(ids, live.attn, pos, live.cache).logits[:, -1]
        live.next_pos = live.next_pos + feed.long()


def sample_token(logits: Tensor, sp: SamplingParams, banned: list[int]) -> tuple[Tensor, Tensor]:
    """One token per row from [L, V] logits (greedy at temperature 0; else tempered, then top-k
    and top-p as Hugging Face's warpers apply them) and its log-prob under the tempered
    distribution without top-k/top-p, which ``VLMPolicy.evaluate`` scores. Returns [L], [L]."""
    logits = logits.float()
    if banned:
        logits[:, banned] = BANNED_LOGIT
    if sp.temperature > 0:
        logits = logits / sp.temperature
    logp_all = logits.log_softmax(-1)
    if sp.temperature <= 0:
        tok = logits.argmax(-1)
    else:
        filt = logits
        if sp.top_k > 0:
            kth = filt.topk(min(sp.top_k, filt.shape[-1]), dim=-1).values[:, -1:]
            filt = filt.masked_fill(filt < kth, -float("inf"))
        if sp.top_p < 1.0:
            srt, order = filt.sort(dim=-1)
            drop = srt.softmax(-1).cumsum(-1) <= 1 - sp.top_p
            drop[:, -1] = False
            filt = filt.masked_fill(drop.scatter(1, order, drop), -float("inf"))
        tok = torch.multinomial(filt.softmax(-1), 1).squeeze(1)
    return tok, logp_all.gather(-1, tok[:, None]).squeeze(1)


# ---------------------------------------------------------------------------------------------
# tree shapes and forks
# ---------------------------------------------------------------------------------------------

ALLOCATIONS = ("uniform", "entropy")
"""how a depth's forks are spread over its live branches (`TreeShape.allocate`)"""


@dataclass(frozen=True)
class TreeShape:
    """How a prompt's completions branch (see ``vlm/tree_rollout.py``)."""

    branches: tuple[int, ...]
    """children per node at each depth; branches[0] rows start from the prompt; the product is
    the prompt's leaves (the group size)"""
    segment_tokens: int = 0
    """tokens of every segment but the last (unused for a tree of depth one)"""
    allocate: str = "uniform"
    """uniform | entropy: how a depth's forks are spread over its live branches"""

    def __post_init__(self):
        if not self.branches or any(b < 1 for b in self.branches):
            raise ValueError(f"tree branches must be positive integers, got {self.branches}")
        if len(self.branches) > 1 and self.segment_tokens < 1:
            raise ValueError("a tree deeper than one segment needs segment_tokens >= 1")
        if self.allocate not in ALLOCATIONS:
            raise ValueError(f"tree allocate {self.allocate!r}: use one of {ALLOCATIONS}")

    @property
    def leaves(self) -> int:
        out = 1
        for b in self.branches:
            out *= b
        return out

    @classmethod
    def flat(cls, n: int) -> TreeShape:
        return cls((n,))


def fork_plan(live_prompt: Tensor, done_prompt: Tensor, U: int, shape: TreeShape, depth: int,
              logits: Tensor) -> Tensor:  # fmt: skip
    """Which live rows to keep, repeated by their number of children, at fork ``depth``: each
    prompt's finished leaves (``done_prompt``: the prompt of every finished row) plus its live
    rows' children make ``prod(branches[:depth + 1])`` (at least one child each; spread as
    ``shape.allocate`` says, entropy read from the next-token ``logits`` [L, V]).
    Returns idx [L'] into the live rows, sorted (a row's children adjacent)."""
    target = 1
    for b in shape.branches[: depth + 1]:
        target *= b
    finished = torch.bincount(done_prompt, minlength=U)
    entropy = None
    if shape.allocate == "entropy":
        logp = logits.float().log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1).cpu()
    counts = torch.zeros(len(live_prompt), dtype=torch.long)
    for u in live_prompt.unique().tolist():
        mine = (live_prompt == u).nonzero().squeeze(1)
        ent = None if entropy is None else entropy[mine]
        counts[mine] = _allocate(int(min(target, shape.leaves) - finished[u]), len(mine), ent)
    return torch.arange(len(live_prompt)).repeat_interleave(counts)


def rank_within(keys: Tensor) -> Tensor:
    """[N] position of each element among the earlier elements with the same key."""
    same = keys[:, None] == keys[None, :]
    return torch.tril(same, diagonal=-1).sum(1)


def _allocate(want: int, n: int, entropy: Tensor | None = None) -> Tensor:
    """Children of each of a prompt's ``n`` live branches, ``max(want, n)`` in all, each >= 1:
    even shares with the remainder to random branches, or (``entropy`` [n] given) one each and
    every further child to the branch with the highest entropy per child so far."""
    counts = torch.ones(n, dtype=torch.long)
    extra = want - n
    if extra <= 0:
        return counts
    if entropy is None:
        counts += extra // n
        counts[torch.randperm(n)[: extra % n]] += 1
        return counts
    for _ in range(extra):
        counts[int(torch.argmax(entropy / counts))] += 1
    return counts
