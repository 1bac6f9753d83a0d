"""The Hugging Face engine: the engine protocol (``vlm/sampler.py``) on a model's own KV cache.

The distinct prompts are prefilled once (vision tower included) and their keys/values indexed out
to the rows (`HFEngine.open`); `decode` feeds one token per live row per step, writing each to the
tape as it is sampled (stop strings are checked on the segment's text after every token); `fork`
and `keep` repeat or drop cache rows (`LiveRows`); `extend` feeds the environment's observations in
one left-padded forward, only their new images through the vision tower, at 3-D M-RoPE positions
from the model's own ``get_rope_index`` over the row's whole sequence. So an image is encoded once,
when it first appears, and a turn costs its new tokens, not its history.

`sample_token` is the one sampling function: its log-probs are those of the tempered distribution
``VLMPolicy.evaluate`` scores (tested equal to the training forward to 1e-5 in float32).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch import Tensor

from .rollout import BANNED_LOGIT, SamplingParams, collate, generation_mode, prompt_table
from .schedule import END_LENGTH, END_STOP, END_STOP_STRING, forked_rows

COMPACT_FRACTION = 0.25
"""rows whose branch ended leave the cache once they are this fraction of the live rows (a cache
``index_select`` then costs less than feeding them padding)"""

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
    table: dict
    """the prompts' inputs (``rollout.prompt_table``)"""
    prompt_of: Tensor
    """the driver's prompt of every tape row"""

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


class HFEngine:
    """The engine protocol on a Hugging Face model (see the module docstring).

    Args:
        model, processor: the policy's.
        stop_ids, pad_id, banned: the policy's stop tokens, padding and never-sampled ids.
    """

    name = "hf"
    next_token_distribution = True
    """`next_logits` gives the next-token logits at a fork (``rollout.tree.allocate=entropy``)"""

    def __init__(self, model, processor, stop_ids: list[int], pad_id: int, banned: list[int]):
        self.model, self.processor = model, processor
        self.stop_ids, self.pad_id, self.banned = stop_ids, pad_id, banned
        self.rope = rope_module(model)
        self.device = next(model.parameters()).device
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters

    @classmethod
    def for_policy(cls, policy) -> HFEngine:
        return cls(
            policy.model, policy.processor, policy.stop_ids, policy.pad_id, policy.banned_ids
        )

    @contextlib.contextmanager
    def session(self, model):
        """A rollout: eval mode, no grad, a blank generation config (``generation_mode``)."""
        with generation_mode(model):
            yield

    # ---- the protocol ---------------------------------------------------------------------

    def open(self, prompts, prompt_of: Tensor, rows: int) -> LiveRows:
        """Prefill the distinct ``prompts`` once and index their keys/values out to ``rows``
        rows (row r continues prompt ``prompt_of[r]``; ``prompt_of`` is the driver's, kept as
        it grows with forks)."""
        from transformers import DynamicCache

        table = prompt_table(prompts)
        kwargs = collate(table, self.pad_id, self.device)  # [U, P], left-padded
        pos = batch_positions(self.rope, kwargs)
        vision = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")}
        if self.rope is not None:
            vision.pop("mm_token_type_ids", None)  # positions are given
        cache = DynamicCache()
        out = self._forward(kwargs["input_ids"], kwargs["attention_mask"], pos, cache, **vision)
        idx = prompt_of[:rows].to(self.device)
        cache.batch_select_indices(idx)
        return LiveRows(
            rows=torch.arange(rows), attn=kwargs["attention_mask"][idx],
            next_pos=pos.amax(dim=(0, 2))[idx] + 1, logits=out.logits[idx, -1], cache=cache,
            table=table, prompt_of=prompt_of,
        )  # fmt: skip

    def fork(self, live: LiveRows, idx: Tensor, clone) -> None:
        live.fork(idx, clone)

    def keep(self, live: LiveRows, idx: Tensor) -> None:
        live.keep(idx)

    def next_logits(self, live: LiveRows) -> Tensor:
        return live.logits

    def decode(self, live: LiveRows, tape, sp: SamplingParams, limit: Tensor, node: Tensor,
               stops: tuple[str, ...] = (), leaves: bool = False,
               final: bool = False) -> Tensor:  # fmt: skip
        """Sample one segment of every live row, up to ``limit`` [L] tokens each, onto ``tape``
        (``node`` [L]: each row's tree node). ``leaves``: a row that emits the stop token is a
        finished leaf (it leaves the cache, and so does every row after a ``final`` segment);
        otherwise rows stay for the environment's answer (`extend`) or the driver's `keep`.
        Returns [L] why each segment ended (``schedule.END_STOP`` ...)."""
        L = len(live.rows)
        reason = torch.full((L,), END_LENGTH)
        entry = torch.arange(L)  # each live row's position at entry (compaction moves them)
        start = tape.cursor[live.rows].clone()
        gen = limit > 0
        alive = torch.ones(L, dtype=torch.bool)  # leaves: rows whose branch goes on
        stop = torch.tensor(self.stop_ids)
        while gen.any():
            tok, logp = sample_token(live.logits, sp, self.banned)
            tok, logp = tok.cpu(), logp.cpu()
            tape.put_tokens(live.rows[gen], tok[gen], logp[gen], node[gen])
            ended = gen & torch.isin(tok, stop)
            reason[entry[ended]] = END_STOP
            if stops:
                at_string = self._at_stop_string(live, tape, start, gen & ~ended, stops)
                reason[entry[at_string]] = END_STOP_STRING
                ended = ended | at_string
            long = gen & ~ended & (tape.cursor[live.rows] - start >= limit)
            if not leaves:  # every token fed: an observation follows
                self._step(live, tok.to(self.device), gen.to(self.device))
                gen = gen & ~ended & ~long
                continue
            alive = alive & ~ended
            fed, gen = gen & ~ended, gen & ~ended & ~long
            if not fed.any() or (final and not gen.any()):
                live.keep(torch.zeros(0, dtype=torch.long))
                return reason
            if (~alive).sum() >= max(1, COMPACT_FRACTION * len(alive)):
                k = alive.nonzero().squeeze(1)
                live.keep(k)
                entry, start, limit, node, tok = entry[k], start[k], limit[k], node[k], tok[k]
                alive, fed, gen = alive[k], fed[k], gen[k]
            self._step(live, tok.to(self.device), fed.to(self.device))
        if leaves:
            live.keep(alive.nonzero().squeeze(1))
        return reason

    def extend(self, live: LiveRows, tape, encs: list) -> None:
        """Feed each live row's observation ``encs[i]`` (already on ``tape``) in one
        left-padded forward, new images only."""
        L = len(encs)
        lens = [int(e.ids.numel()) for e in encs]
        width = max(lens)
        ids = torch.full((L, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((L, width), dtype=torch.long)
        pos = torch.zeros((3, L, width), dtype=torch.long)
        for i, (row, enc) in enumerate(zip(live.rows.tolist(), encs)):
            ids[i, width - lens[i] :], attn[i, width - lens[i] :] = enc.ids, 1
            if enc.num_images:
                full = self._row_positions(tape, row, live.table, int(live.prompt_of[row]))
                pos[:, i, width - lens[i] :] = full[:, -lens[i] :].cpu()
            else:  # text continues
                pos[:, i, width - lens[i] :] = int(live.next_pos[i]) + torch.arange(lens[i])
        vision = {}
        for k in sorted({k for e in encs for k in e.vision}):
            vision[k] = torch.cat([e.vision[k] for e in encs if k in e.vision]).to(self.device)
        live.attn = torch.cat([live.attn, attn.to(self.device)], dim=1)
        pos = pos.to(self.device)
        out = self._forward(ids.to(self.device), live.attn, pos, live.cache, **vision)
        live.logits = out.logits[:, -1]
        live.next_pos = pos.amax(dim=(0, 2)) + 1

    # ---- model calls ------------------------------------------------------------------------

    def _forward(self, ids: Tensor, live_attn: Tensor, pos: Tensor, cache, **vision):
        pos = pos if self.rope is not None else pos[0]
        if self._keep_arg:
            vision["logits_to_keep"] = 1
        return self.model(
            input_ids=ids, attention_mask=live_attn, position_ids=pos, past_key_values=cache,
            use_cache=True, **vision,
        )  # fmt: skip

    def _step(self, live: LiveRows, tok: Tensor, feed: Tensor) -> None:
        """Feed one token per live row (padding with attention 0 where ``feed`` is False)."""
        ids = torch.where(feed, tok, torch.full_like(tok, self.pad_id))[:, None]
        live.attn = torch.cat([live.attn, feed.long()[:, None]], dim=1)
        pos = live.next_pos[:, None].expand(3, -1, 1)
        live.logits = self._forward(ids, live.attn, pos, live.cache).logits[:, -1]
        live.next_pos = live.next_pos + feed.long()

    def _at_stop_string(self, live: LiveRows, tape, start: Tensor, rows: Tensor,
                        stops: tuple[str, ...]) -> Tensor:  # fmt: skip
        """[L] which of the live rows flagged in ``rows`` have a stop string in their segment
        so far (tokens from ``start``)."""
        hit = torch.zeros_like(rows)
        idx = rows.nonzero().flatten().tolist()
        if not idx:
            return hit
        ids = [tape.tokens[int(live.rows[i]), int(start[i]) : int(tape.cursor[live.rows[i]])]
               for i in idx]  # fmt: skip
        texts = self.processor.batch_decode(ids, skip_special_tokens=True)
        for i, text in zip(idx, texts):
            hit[i] = any(s in text for s in stops)
        return hit

    def _row_positions(self, tape, row: int, table: dict, u: int) -> Tensor:
        """[3, P + C] positions of row ``row``'s whole sequence (prompt ``u`` + its tape)."""
        ids, extras, vision = tape.row_sequence(row)
        full_ids = torch.cat([table["prompt_ids"][u], ids])
        types = table.get("mm_token_type_ids", [None] * (u + 1))[u]
        if types is None:
            types = torch.zeros(table["prompt_ids"][u].numel(), dtype=torch.long)
        obs_types = extras.get("mm_token_type_ids", torch.zeros(ids.numel(), dtype=types.dtype))
        grids = {}
        for k in ROPE_GRID_KEYS:
            parts = [t for t in (table.get(k, [None] * (u + 1))[u], vision.get(k)) if t is not None]
            grids[k] = torch.cat(parts) if parts else None
        grids["second_per_grid_ts"] = table.get("second_per_grid_ts", [None] * (u + 1))[u]
        extras = {"mm_token_type_ids": torch.cat([types, obs_types.to(types.dtype)])}
        return sequence_positions(self.rope, full_ids.to(self.device), extras, grids)


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
