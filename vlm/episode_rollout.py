"""Sampling multi-turn episodes with a Hugging Face model, the KV cache kept across turns.

One rollout call runs ``n`` episodes for each prompt, all rows in one batch:

1. the distinct prompts go through the model once (vision tower included) and their keys and
   values are indexed out to the ``n`` rows of each;
2. a turn: every live row samples tokens until its stop token, one of its stop strings
   (``rollout.episode.stop``, checked on the turn's text after every token),
   ``rollout.max_new_tokens`` or the episode's token budget; a row that ends early feeds
   padding with attention 0 (a hole in the cache) while the others go on;
3. the environment answers each turn (`EpisodeEnv.respond`); rows that stop (an answer, a
   budget) leave the batch (their cache rows are dropped), the others get their observation
   rendered through the chat template and fed in one forward, left-padded, with only the new
   images through the vision tower, at 3-D M-RoPE positions from the model's own
   ``get_rope_index`` over the row's whole sequence;
4. repeat from 2 until no row is live.

So an image is encoded once, when it first appears, and a turn costs its new tokens, not its
history. Rows are stored in fixed ``[B, T]`` buffers (`episode.Tape`); the log-probs recorded
while sampling are those of the tempered distribution ``VLMPolicy.evaluate`` scores (tested equal
to the training forward to 1e-5 in float32).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from ..trainer.batch import RolloutBatch
from .episode import (
    STOP_STRING,
    EncodedObservation,
    EpisodeSettings,
    ObservationTemplate,
    Tape,
    answer_round,
)
from .prompts import EncodedPrompt
from .rollout import BANNED_LOGIT, SamplingParams, collate, generation_mode, prompt_table

ROPE_GRID_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
"""Vision inputs the 3-D position index reads."""
_STOP, _TURN_LENGTH, _MAX_TOKENS, _STOP_STRING = 0, 1, 2, 3
_REASONS = {_TURN_LENGTH: "turn_length", _MAX_TOKENS: "max_tokens", _STOP_STRING: STOP_STRING}


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


class EpisodeSampler(KVSampler):
    """Runs episodes for a policy's model (see the module docstring).

    Args:
        model, processor: the policy's.
        settings: the budgets and the environment (``policy.episode``).
        stop_ids, pad_id, banned: the policy's stop tokens, padding and never-sampled ids.
    """

    def __init__(self, model, processor, settings: EpisodeSettings, stop_ids: list[int],
                 pad_id: int, banned: list[int]):  # fmt: skip
        super().__init__(model, processor, stop_ids, pad_id, banned)
        self.settings = settings
        stop_text = processor.tokenizer.convert_ids_to_tokens(stop_ids[0])
        self.template = ObservationTemplate(processor, stop_text, settings)

    def sample(self, prompts: list[EncodedPrompt], n: int, sp: SamplingParams,
               shape=None) -> RolloutBatch:  # fmt: skip
        """``n`` episodes per prompt, or the leaves of ``shape`` (a ``tree_rollout.TreeShape``
        with ``n`` leaves: its segments are turns, forks come after a turn's observation).
        Returns a `RolloutBatch` (layout in ``vlm/episode.py``; ``segments`` for trees) with
        ``logp_rollout`` when ``sp.return_logprobs``; rows of one prompt adjacent."""
        parts, start = [], 0
        width = self.settings.max_tokens
        for chunk in _chunks([p.input_ids.numel() for p in prompts], n, width, sp.token_budget):
            b = self._sample_chunk([prompts[i] for i in chunk], n, sp, shape)
            b.group_id = b.group_id + start
            start += len(chunk)
            parts.append(b)
        return RolloutBatch.concat(parts)

    def _sample_chunk(self, prompts: list[EncodedPrompt], n: int, sp: SamplingParams, shape):
        from .tree_rollout import TreeShape, rank_within

        shape = shape or TreeShape.flat(n)
        U, first = len(prompts), shape.branches[0]
        table = prompt_table(prompts)
        prompt_of = torch.full((U * n,), -1, dtype=torch.long)  # tape row -> prompt
        used = U * first
        prompt_of[:used] = torch.arange(U).repeat_interleave(first)
        env = self.settings.env()
        env.reset([prompts[u].sample for u in prompt_of[:used].tolist()])
        tape = Tape(U * n, self.settings.max_tokens, self.pad_id, self.template.keys())
        next_node = torch.ones(U, dtype=torch.long)  # each prompt's next tree node (a turn)
        with generation_mode(self.model):
            live = self._prefill(table, prompt_of[:used].clone())
            depth = 0
            while len(live.rows):
                t0, rows = time.perf_counter(), live.rows.tolist()
                prompt = prompt_of[live.rows]
                node = next_node[prompt] + rank_within(prompt)
                next_node.index_add_(0, prompt, torch.ones_like(prompt))
                reasons = self._turn(live, tape, sp, node)
                encs = self._respond(live, tape, env, reasons)
                if len(live.rows):
                    self._observe(live, tape, encs, table, prompt_of)
                dt = time.perf_counter() - t0  # one round: every live row's turn, batched
                for r in rows:
                    tape.logs[r].turn_seconds.append(dt)
                depth += 1
                if depth < len(shape.branches) and len(live.rows):
                    used = self._fork(live, tape, env, shape, depth, prompt_of, used, U)
        order = torch.arange(used)
        order = order[torch.argsort(prompt_of[order] * (used + 1) + order)]
        index = prompt_of[order].clone()
        samples = [prompts[u].sample for u in index.tolist()]
        return tape.to_batch(
            samples, index.clone(), table, index, sp.return_logprobs, rows=order,
            segments=len(shape.branches) > 1,
        )  # fmt: skip

    def _fork(self, live: LiveRows, tape: Tape, env, shape, depth: int, prompt_of: Tensor,
              used: int, U: int) -> int:  # fmt: skip
        """Fork the live episodes after a turn (see ``tree_rollout.fork_plan``): a child after
        the first gets a fresh tape row and environment episode copied from its parent's.
        Returns the rows in use."""
        from .tree_rollout import fork_plan

        if not hasattr(env, "fork"):
            raise ValueError(
                f"{type(env).__name__} cannot fork episodes (no fork(src, dst) method); tree "
                "rollouts of episodes need one"
            )
        live_set = set(live.rows.tolist())
        done = torch.tensor([r for r in range(used) if r not in live_set], dtype=torch.long)
        idx = fork_plan(prompt_of[live.rows], prompt_of[done], U, shape, depth, live.logits)

        def clone(src: Tensor) -> Tensor:
            dst = torch.arange(used, used + len(src))
            tape.copy_rows(dst.tolist(), src.tolist())
            for a, b in zip(dst.tolist(), src.tolist()):
                env.fork(b, a)
            prompt_of[dst] = prompt_of[src]
            return dst

        before = len(live.rows)
        live.fork(idx, clone)
        return used + len(live.rows) - before

    def _turn(self, live: LiveRows, tape: Tape, sp: SamplingParams, node: Tensor) -> Tensor:
        """Sample one policy turn of every live row (``node`` [L]: its tree node). Returns [L]
        why each turn ended (stop token, stop string, turn length, episode token budget)."""
        start = tape.cursor[live.rows].clone()
        budget = self.settings.max_tokens - start
        gen = budget > 0
        reason = torch.full((len(live.rows),), _MAX_TOKENS)
        stop = torch.tensor(self.stop_ids)
        while gen.any():
            tok, logp = sample_token(live.logits, sp, self.banned)
            tok, logp = tok.cpu(), logp.cpu()
            tape.put_tokens(live.rows[gen], tok[gen], logp[gen], node[gen])
            count = tape.cursor[live.rows] - start
            ended = gen & torch.isin(tok, stop)
            reason[ended] = _STOP
            if self.settings.stop:
                at_string = self._at_stop_string(live, tape, start, gen & ~ended)
                reason[at_string] = _STOP_STRING
                ended = ended | at_string
            long_turn = gen & ~ended & (count >= sp.max_new_tokens)
            reason[long_turn & (count < budget)] = _TURN_LENGTH
            self._step(live, tok.to(self.device), gen.to(self.device))
            gen = gen & ~ended & ~long_turn & (count < budget)
        return reason

    def _at_stop_string(self, live: LiveRows, tape: Tape, start: Tensor, rows: Tensor) -> Tensor:
        """[L] which of the live rows flagged in ``rows`` have a stop string in their turn so
        far (tokens from ``start``)."""
        hit = torch.zeros_like(rows)
        idx = rows.nonzero().flatten().tolist()
        if not idx:
            return hit
        ids = [tape.tokens[int(live.rows[i]), int(start[i]) : int(tape.cursor[live.rows[i]])]
               for i in idx]  # fmt: skip
        texts = self.processor.batch_decode(ids, skip_special_tokens=True)
        for i, text in zip(idx, texts):
            hit[i] = any(s in text for s in self.settings.stop)
        return hit

    # ---- the environment's answers ------------------------------------------------------------

    def _respond(
        self, live: LiveRows, tape: Tape, env, reasons: Tensor
    ) -> list[EncodedObservation]:
        """Decode each live row's turn, ask the environment, apply the budgets; rows that stop
        leave ``live``. Returns the encoded observations of the rows that go on."""
        texts = self._turn_texts(live, tape)
        stopped = [None if r == _STOP else _REASONS[int(r)] for r in reasons]
        answers = answer_round(self.settings, self.template, env, tape, live.rows.tolist(),
                               texts, stopped, self.banned)  # fmt: skip
        keep = [i for i, enc in enumerate(answers) if enc is not None]
        encs = [answers[i] for i in keep]
        live.keep(torch.tensor(keep, dtype=torch.long))
        return encs

    def _turn_texts(self, live: LiveRows, tape: Tape) -> list[str]:
        """The text of each live row's last turn (from its previous segment's end)."""
        out = []
        for row in live.rows.tolist():
            c = int(tape.cursor[row])
            seg = tape.mask[row, :c].flip(0)
            n = int(seg.cumprod(0).sum())  # policy tokens since the last observation
            out.append(tape.tokens[row, c - n : c].tolist())
        return self.processor.batch_decode(out, skip_special_tokens=True)

    def _observe(self, live: LiveRows, tape: Tape, encs: list, table: dict, index: Tensor) -> None:
        """Record the observations and feed them in one left-padded forward (new images only)."""
        L = len(encs)
        lens = [int(e.ids.numel()) for e in encs]
        width = max(lens)
        ids = torch.full((L, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((L, width), dtype=torch.long)
        pos = torch.zeros((3, L, width), dtype=torch.long)
        for i, (row, enc) in enumerate(zip(live.rows.tolist(), encs)):
            tape.put_observation(row, enc)
            ids[i, width - lens[i] :], attn[i, width - lens[i] :] = enc.ids, 1
            if enc.num_images:
                full = self._row_positions(tape, row, table, int(index[row]))
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

    def _row_positions(self, tape: Tape, row: int, table: dict, u: int) -> Tensor:
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


def _chunks(lens: list[int], n: int, width: int, budget: int):
    """Consecutive prompt indices whose rows (``n`` each) fit ``budget`` tokens of prompt plus
    ``width`` tokens of episode."""
    chunk: list[int] = []
    longest = 0
    for i, p in enumerate(lens):
        new = max(longest, p)
        if chunk and (len(chunk) + 1) * n * (new + width) > budget:
            yield chunk
            chunk, new = [], p
        chunk.append(i)
        longest = new
    if chunk:
        yield chunk
