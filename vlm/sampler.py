"""`Rollouts`: the one sampler driver. Every shape of VLM rollout runs here, on either engine.

A rollout is a trajectory of segments after the prompt. The driver runs a schedule, round by
round, for all rows of a chunk of prompts at once:

1. the engine opens the rows (``Engine.open``: the HF engine prefills each distinct prompt once,
   vision tower included, and indexes its keys/values out to the rows);
2. every live row decodes one segment (``Engine.decode``): up to ``rollout.max_new_tokens`` or
   the rest of the episode's token budget for a turn, ``rollout.tree.segment_tokens`` for a tree
   segment before the last depth, ending early at the stop token or (episodes) a stop string;
3. episodes: the environment answers each turn (`episode.answer_round`); rows whose episode ends
   leave (``Engine.keep``), the others get their observation on the tape and the engine feeds it
   (``Engine.extend``). Single-turn rows that stopped are finished leaves;
4. at the end of a depth of ``rollout.tree.branches``, the live rows fork (`schedule.fork_plan`,
   ``Engine.fork``: a child after the first gets a fresh tape row, and environment episode,
   copied from its parent's);
5. repeat from 2 until no row is live.

A flat group is the tree of depth one (``branches = [G]``), an episode a tree whose segments
are turns; so flat groups, trees, episodes and trees of episodes are one loop. Rows are written
on one `episode.Tape` with each token's tree node, and come out as a `RolloutBatch` with the
rows of a prompt adjacent (``segments`` for trees, the episode layout of ``vlm/episode.py`` for
episodes, ``logp_rollout`` when asked; the vLLM engine always returns log-probs).

Engines (the protocol below): `hf_engine.HFEngine` (the model's own KV cache, forked row by
row) and `vllm_rollout.VLLMEngine` (one request per row and segment, vLLM's prefix cache
holding what rows share; its weights are pushed at the start of each rollout). What an engine
cannot do is refused when the recipe loads (``vlm/rules.py``). The HF ``generate`` path
(``rollout.sample``) stays for greedy evaluation, the judge and ``rollout.sampler=generate``
(flat groups, for models whose cache cannot fork rows).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Protocol

import torch
from torch import Tensor

from ..trainer.batch import RolloutBatch
from . import rollout
from .episode import STOP_STRING, ObservationKeys, ObservationTemplate, Tape, answer_round
from .hf_engine import HFEngine
from .prompts import EncodedPrompt
from .rollout import SamplingParams, prompt_table, row_chunks
from .schedule import END_LENGTH, END_STOP, END_STOP_STRING, TreeShape, fork_plan, rank_within


class Engine(Protocol):
    """What the driver needs of an engine. A state holds the live rows (``state.rows``: the
    tape row of each, in the engine's order); every method keeps it aligned with them."""

    name: str
    next_token_distribution: bool
    stop_ids: list[int]
    pad_id: int
    banned: list[int]

    def session(self, model):
        """Context manager around one rollout call (HF: generation mode; vLLM: weight push)."""
        ...

    def open(self, prompts: list[EncodedPrompt], prompt_of: Tensor, rows: int):
        """A state of rows ``0 .. rows - 1``, row r continuing ``prompts[prompt_of[r]]``."""
        ...

    def fork(self, state, idx: Tensor, clone) -> None:
        """Keep live rows ``idx`` (sorted, a row's children adjacent); ``clone(src)`` gives the
        fresh tape rows of the children after the first."""
        ...

    def keep(self, state, idx: Tensor) -> None: ...

    def next_logits(self, state) -> Tensor | None: ...

    def decode(self, state, tape: Tape, sp: SamplingParams, limit: Tensor, node: Tensor,
               stops: tuple[str, ...] = (), leaves: bool = False,
               final: bool = False) -> Tensor: ...  # fmt: skip

    def extend(self, state, tape: Tape, encs: list) -> None: ...


class Rollouts:
    """Samples a policy's rollouts on an engine (see the module docstring).

    Args:
        policy: the `VLMPolicy` (its model, processor, prompt, sampling, episode and tree
            settings; the engine pushes its weights where it has its own).
        engine: an engine (default: the HF engine on the policy's model).
        fork: single-turn flat groups on the HF engine prefill once and fork the cache; False
            samples them with ``generate`` on G copies (``rollout.sampler=generate``).
    """

    def __init__(self, policy, engine: Engine | None = None, *, fork: bool = True):
        self.policy = policy
        self.engine = engine or HFEngine.for_policy(policy)
        self.fork = fork

    def sample(
        self, prompts: list[EncodedPrompt], n: int, sampling: SamplingParams | None = None
    ) -> RolloutBatch:
        """``n`` completions (or episodes, with the policy's ``episode`` settings) per encoded
        prompt with ``sampling`` (default: the policy's, the distribution ``evaluate`` scores);
        the leaves of the policy's ``tree`` when it has ``n`` leaves. Rewards not filled."""
        policy, sp = self.policy, sampling or self.policy.sampling
        tree = policy.tree if policy.tree is not None and policy.tree.leaves == n else None
        shape = tree or TreeShape.flat(n)
        if self.engine.name == "vllm":
            sp = _with_logprobs(sp)
        elif not self.fork and policy.episode is None and len(shape.branches) == 1:
            return rollout.sample(policy.model, policy.processor, prompts, n, sp)
        width = policy.episode.max_tokens if policy.episode else sp.max_new_tokens
        lens = [p.input_ids.numel() for p in prompts]
        parts, start = [], 0
        with self.engine.session(policy.model):
            for chunk in row_chunks(lens, shape.leaves, width, sp.token_budget):
                b = _Run(self, [prompts[i] for i in chunk], shape, sp).batch()
                b.group_id = b.group_id + start
                start += len(chunk)
                parts.append(b)
        return RolloutBatch.concat(parts)

    def generate(
        self, samples: list[dict], n: int = 1, sampling: SamplingParams | None = None
    ) -> RolloutBatch:
        """Encode ``samples`` (strict about images) and sample ``n`` rollouts for each."""
        prompts, _ = self.policy.encode(samples, strict=True)
        return self.sample(prompts, n, sampling)


def _turn_end(why: int, room: bool) -> str | None:
    """A turn's stop reason for `episode.answer_turn` from the engine's (``room``: the episode
    has tokens left): None at the stop token; a turn cut by its length ends the episode as
    ``turn_length``, one cut by the episode's budget or the engine's context as ``max_tokens``."""
    if why == END_STOP:
        return None
    if why == END_STOP_STRING:
        return STOP_STRING
    return "turn_length" if why == END_LENGTH and room else "max_tokens"


def _with_logprobs(sp: SamplingParams) -> SamplingParams:
    return sp if sp.return_logprobs else replace(sp, return_logprobs=True)


class _Run:
    """One chunk of prompts through the schedule: the tape, the rows' prompts, the environment."""

    def __init__(self, owner: Rollouts, prompts: list[EncodedPrompt], shape: TreeShape,
                 sp: SamplingParams):  # fmt: skip
        policy = owner.policy
        self.engine, self.processor, self.settings = owner.engine, policy.processor, policy.episode
        self.prompts, self.shape, self.sp = prompts, shape, sp
        U, first = len(prompts), shape.branches[0]
        self.prompt_of = torch.full((U * shape.leaves,), -1, dtype=torch.long)  # tape row -> prompt
        self.used = U * first
        self.prompt_of[: self.used] = torch.arange(U).repeat_interleave(first)
        self.stopped = torch.zeros(U * shape.leaves, dtype=torch.bool)  # leaves at the stop token
        self.env, keys = None, ObservationKeys({}, ())
        if self.settings is not None:
            self.template = ObservationTemplate(self.processor, policy.stop_text, self.settings)
            keys = self.template.keys()
            self.env = self.settings.env()
            self.env.reset([prompts[u].sample for u in self.prompt_of[: self.used].tolist()])
        width = self.settings.max_tokens if self.settings else sp.max_new_tokens
        self.tape = Tape(U * shape.leaves, width, self.engine.pad_id, keys)
        self.next_node = torch.ones(U, dtype=torch.long)  # each prompt's next tree node

    def batch(self) -> RolloutBatch:
        state = self.engine.open(self.prompts, self.prompt_of, self.used)
        depth, D = 0, len(self.shape.branches)
        while len(state.rows):
            t0, rows = time.perf_counter(), state.rows.tolist()
            prompt = self.prompt_of[state.rows]
            node = self.next_node[prompt] + rank_within(prompt)  # one new node per live row
            self.next_node.index_add_(0, prompt, torch.ones_like(prompt))
            if self.settings is not None:
                self._turn(state, node)
                for r in rows:  # one round: every live row's turn, batched
                    self.tape.logs[r].turn_seconds.append(time.perf_counter() - t0)
            elif self._segment(state, node, depth):
                break
            depth += 1
            if depth < D and len(state.rows):
                self._fork(state, depth)
        return self._to_batch(branches=D > 1)

    def _segment(self, state, node: Tensor, depth: int) -> bool:
        """One single-turn segment of every live row. Returns whether it was the last."""
        sp, seg = self.sp, self.shape.segment_tokens
        left = sp.max_new_tokens - depth * seg
        last = depth == len(self.shape.branches) - 1
        length = left if last else min(seg, left)
        final = last or length >= left
        limit = torch.full((len(state.rows),), length)
        rows = state.rows.clone()
        why = self.engine.decode(state, self.tape, sp, limit, node, leaves=True, final=final)
        self.stopped[rows[why == END_STOP]] = True
        return final

    def _turn(self, state, node: Tensor) -> None:
        """One policy turn of every live episode, the environment's answers, the observations."""
        s, tape = self.settings, self.tape
        budget = s.max_tokens - tape.cursor[state.rows]
        limit = budget.clamp(min=0, max=self.sp.max_new_tokens)
        why = self.engine.decode(state, tape, self.sp, limit, node, stops=s.stop)
        rows = state.rows.tolist()
        stopped = [
            _turn_end(w, int(tape.cursor[r]) < s.max_tokens) for r, w in zip(rows, why.tolist())
        ]
        texts = self.processor.batch_decode(
            [tape.turn_tokens(r) for r in rows], skip_special_tokens=True
        )
        answers = answer_round(s, self.template, self.env, tape, rows, texts, stopped,
                               self.engine.banned)  # fmt: skip
        keep = [i for i, enc in enumerate(answers) if enc is not None]
        self.engine.keep(state, torch.tensor(keep, dtype=torch.long))
        encs = [answers[i] for i in keep]
        for r, enc in zip(state.rows.tolist(), encs):
            tape.put_observation(r, enc)
        if encs:
            self.engine.extend(state, tape, encs)

    def _fork(self, state, depth: int) -> None:
        """Fork the live rows at the end of a depth (`fork_plan`): a child after the first gets
        a fresh tape row (and environment episode) copied from its parent's."""
        if self.env is not None and not hasattr(self.env, "fork"):
            raise ValueError(
                f"{type(self.env).__name__} cannot fork episodes (no fork(src, dst) method); "
                "tree rollouts of episodes need one"
            )
        live = set(state.rows.tolist())
        done = torch.tensor([r for r in range(self.used) if r not in live], dtype=torch.long)
        idx = fork_plan(self.prompt_of[state.rows], self.prompt_of[done], len(self.prompts),
                        self.shape, depth, self.engine.next_logits(state))  # fmt: skip

        def clone(src: Tensor) -> Tensor:
            dst = torch.arange(self.used, self.used + len(src))
            self.used += len(src)
            self.tape.copy_rows(dst.tolist(), src.tolist())
            for a, b in zip(dst.tolist(), src.tolist()):
                if self.env is not None:
                    self.env.fork(b, a)
            self.prompt_of[dst], self.stopped[dst] = self.prompt_of[src], self.stopped[src]
            return dst

        self.engine.fork(state, idx, clone)

    def _to_batch(self, branches: bool) -> RolloutBatch:
        """The recorded rows, grouped by prompt (a prompt's rows in tape order)."""
        order = torch.argsort(self.prompt_of[: self.used], stable=True)  # by prompt, then row
        index = self.prompt_of[order].clone()
        samples = [self.prompts[u].sample for u in index.tolist()]
        batch = self.tape.to_batch(
            samples, index.clone(), prompt_table(self.prompts), index, self.sp.return_logprobs,
            rows=order, branches=branches, episodes=self.settings is not None,
        )  # fmt: skip
        if self.settings is None:
            cursor = self.tape.cursor[order].tolist()
            texts = self.processor.batch_decode(
                [r[:c] for r, c in zip(batch.tokens.tolist(), cursor)], skip_special_tokens=True
            )
            for m, t, s in zip(batch.meta, texts, self.stopped[order].tolist()):
                m.update(completion=t, truncated=not s)
        return batch


def sampled_tokens(batch: RolloutBatch) -> tuple[int, int]:
    """(tokens the sampler decoded, tokens of the leaves): a segment shared by k leaves counts
    once in the first, k times in the second. Equal for flat groups."""
    leaf = int(batch.mask.sum())
    return (leaf if batch.segments is None else batch.segments.decoded()), leaf
