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

import time

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
from .kv_sampler import (
    ROPE_GRID_KEYS,
    KVSampler,
    LiveRows,
    TreeShape,
    fork_plan,
    rank_within,
    sample_token,
    sequence_positions,
)
from .prompts import EncodedPrompt
from .rollout import SamplingParams, generation_mode, prompt_table, row_chunks

_STOP, _TURN_LENGTH, _MAX_TOKENS, _STOP_STRING = 0, 1, 2, 3
_REASONS = {_TURN_LENGTH: "turn_length", _MAX_TOKENS: "max_tokens", _STOP_STRING: STOP_STRING}


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
        """``n`` episodes per prompt, or the leaves of ``shape`` (a `TreeShape`
        with ``n`` leaves: its segments are turns, forks come after a turn's observation).
        Returns a `RolloutBatch` (layout in ``vlm/episode.py``; ``segments`` for trees) with
        ``logp_rollout`` when ``sp.return_logprobs``; rows of one prompt adjacent."""
        parts, start = [], 0
        width = self.settings.max_tokens
        for chunk in row_chunks([p.input_ids.numel() for p in prompts], n, width, sp.token_budget):
            b = self._sample_chunk([prompts[i] for i in chunk], n, sp, shape)
            b.group_id = b.group_id + start
            start += len(chunk)
            parts.append(b)
        return RolloutBatch.concat(parts)

    def _sample_chunk(self, prompts: list[EncodedPrompt], n: int, sp: SamplingParams, shape):
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
        """Fork the live episodes after a turn (see `fork_plan`): a child after
        the first gets a fresh tape row and environment episode copied from its parent's.
        Returns the rows in use."""
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
