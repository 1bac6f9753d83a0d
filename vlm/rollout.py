"""Batched sampling of G completions per prompt with ``model.generate``, and the helpers every
HF path shares (collation, prompt tables, generation mode, stop tokens).

Training rollouts go through the sampler driver (``vlm/sampler.py``) by default
(``rollout.sampler=fork``); ``generate`` serves ``rollout.sampler=generate`` (flat groups, for
models whose cache cannot fork rows), greedy evaluation and the judge.

Prompts are left-padded for generation (KV cache on), rows are packed into generate calls by a
token budget (prompt + completion tokens per call), and the result is a ``RolloutBatch`` whose
``tokens`` are the completions right-padded to ``[B, T]`` with ``mask`` 1 up to and including the
stop token. ``prompts`` keeps each distinct prompt's unpadded inputs once (ids, pixel values, grid
sizes ...) and ``prompt_index`` names each row's, so any minibatch can be re-collated for
``VLMPolicy.evaluate`` and the G rows of a prompt are known to share it.

Vision placeholder tokens (``<|image_pad|>`` ...) are never sampled: a completion holding one would
make the training forward look for image features that do not exist. The policy's ``evaluate``
applies the same restriction, so sampling and training see one distribution.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..trainer.batch import RolloutBatch
from ..trainer.segments import Segments
from .prompts import EncodedPrompt, vision_token_ids

BANNED_LOGIT = -1e9
"""Logit given to tokens the policy may not emit (finite, so 0 * logp stays 0 in the entropy)."""


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """sampling temperature; 0 decodes greedily"""
    top_p: float = 1.0
    """nucleus sampling mass (1 disables it)"""
    top_k: int = 0
    """keep the k most likely tokens (0 disables it)"""
    max_new_tokens: int = 48
    """longest completion; a completion that reaches it without a stop token is truncated"""
    token_budget: int = 16384
    """prompt + completion tokens per generate call: rows are packed until the next would exceed it"""
    return_logprobs: bool = False
    """also return the engine's log-probs of the sampled tokens (tempered, before top-p) as
    logp_rollout"""


def stop_token_ids(model, processor) -> list[int]:
    """Ids that end a completion: ``<|im_end|>`` first when the vocabulary has it (the end of a
    chat turn), then the tokenizer's and the generation config's EOS, then ``<|endoftext|>``."""
    tok = processor.tokenizer
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    named = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    named = [i if i != tok.unk_token_id else None for i in named]
    cands = [named[0], tok.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])]
    ids: list[int] = []
    for i in [*cands, named[1]]:
        if isinstance(i, int) and i not in ids:
            ids.append(i)
    if not ids:
        raise ValueError("the tokenizer defines no EOS token; cannot stop generation")
    return ids


def pad_token_id(processor, stop_ids: list[int]) -> int:
    pad = processor.tokenizer.pad_token_id
    return int(pad) if pad is not None else stop_ids[0]


def collate(
    inputs: dict[str, list],
    pad_id: int,
    device: torch.device,
    completions: Tensor | None = None,
    completion_mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """Model kwargs for rows of per-sample prompt inputs: prompts left-padded to the longest,
    completions (if given) appended right-padded.

    Args:
        inputs: ``prompt_ids`` -> list of [L_i] long; per-token extras -> list of [L_i]; vision
            keys (``pixel_values``, ``image_grid_thw`` ...) -> list of tensors (or None) that are
            concatenated along dim 0.
        completions: [B, T] ids; completion_mask: [B, T] (1 for real tokens).

    Returns:
        input_ids / attention_mask [B, P + T], per-token extras [B, P + T] (0 on padding and
        completion), vision tensors concatenated over rows.
    """
    ids = inputs["prompt_ids"]
    lens = [int(x.numel()) for x in ids]
    B, P = len(ids), max(lens)
    T = 0 if completions is None else completions.shape[1]
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros((B, P + T), dtype=torch.long, device=device)
    for b, x in enumerate(ids):
        input_ids[b, P - lens[b] : P] = x
        attn[b, P - lens[b] : P] = 1
    if completions is not None:
        input_ids[:, P:] = completions
        attn[:, P:] = 1 if completion_mask is None else completion_mask.to(device, torch.long)
    out = {"input_ids": input_ids, "attention_mask": attn}
    for k, vals in inputs.items():
        if k == "prompt_ids" or all(v is None for v in vals):
            continue
        present = [(b, v) for b, v in enumerate(vals) if v is not None]
        if all(v.dim() == 1 and v.numel() == lens[b] for b, v in present):  # per-token
            extra = torch.zeros((B, P + T), dtype=present[0][1].dtype, device=device)
            for b, v in present:
                extra[b, P - lens[b] : P] = v
            out[k] = extra
        else:
            out[k] = torch.cat([v for v in vals if v is not None], dim=0).to(device)
    return out


def prompt_table(prompts: list[EncodedPrompt]) -> dict[str, list]:
    """Input lists with one entry per prompt: ``prompt_ids``, per-token extras and vision
    tensors (None where a prompt lacks a key); a batch's ``prompts`` field."""
    keys = {k for p in prompts for k in (*p.token_extras, *p.vision)}
    out: dict[str, list] = {"prompt_ids": [p.input_ids for p in prompts]}
    for k in sorted(keys):
        out[k] = [p.token_extras.get(k, p.vision.get(k)) for p in prompts]
    return out


def prompt_inputs(prompts: list[EncodedPrompt], n: int = 1) -> dict[str, list]:
    """Per-row input lists for ``prompts`` each repeated ``n`` times (tensors shared, not copied),
    as ``collate`` takes them."""
    return {k: [x for x in v for _ in range(n)] for k, v in prompt_table(prompts).items()}


def repeated_index(n_prompts: int, n: int, device=None) -> Tensor:
    """[n_prompts * n] long: the prompt of each row when every prompt has ``n`` adjacent rows."""
    return torch.arange(n_prompts, device=device).repeat_interleave(n)


def completion_mask(tokens: Tensor, stop_ids: list[int]) -> Tensor:
    """[B, T] float: 1 up to and including the first stop token, 0 after; all 1 without one."""
    is_stop = torch.isin(tokens, torch.tensor(stop_ids, device=tokens.device))
    after = (is_stop.cumsum(1) - is_stop.long()) > 0  # strictly after the first stop
    return (~after).float()


def row_chunks(lens: list[int], n: int, width: int, budget: int) -> Iterator[list[int]]:
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


@contextlib.contextmanager
def generation_mode(model):
    """Eval mode, no grad, and a blank model generation config so that nothing shipped with a
    checkpoint (repetition_penalty, top_k, temperature ...) leaks into RL sampling."""
    from transformers import GenerationConfig

    was_training, saved = model.training, model.generation_config
    model.eval()
    model.generation_config = GenerationConfig()
    try:
        with torch.no_grad():
            yield
    finally:
        model.generation_config = saved
        model.train(was_training)


def _generation_config(sp: SamplingParams, stop_ids: list[int], pad_id: int, banned: list[int]):
    from transformers import GenerationConfig

    sample = sp.temperature > 0
    return GenerationConfig(
        do_sample=sample,
        temperature=sp.temperature if sample else 1.0,
        top_p=sp.top_p if sample else 1.0,
        top_k=sp.top_k if sample else 0,
        max_new_tokens=sp.max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        suppress_tokens=banned or None,
        repetition_penalty=1.0,
        num_beams=1,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=sp.return_logprobs,
    )


def _generate_rows(model, rows: dict[str, list], sp, stop_ids, pad_id, banned):
    """One generate call. Returns completion ids [b, T'] and, if asked, raw log-probs [b, T']."""
    device = next(model.parameters()).device
    kwargs = collate(rows, pad_id, device)
    P = kwargs["input_ids"].shape[1]
    out = model.generate(
        **kwargs,
        generation_config=_generation_config(sp, stop_ids, pad_id, banned),
    )
    tokens = out.sequences[:, P:]
    logp = None
    if sp.return_logprobs:
        logits = torch.stack(out.logits, dim=1).float()  # [b, T', V], before the warpers
        if sp.temperature > 0:
            logits = logits / sp.temperature  # the tempered distribution the trainer scores
        if banned:
            logits[..., banned] = BANNED_LOGIT
        logp = logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logp


def _pad_right(xs: list[Tensor], width: int, value: float) -> Tensor:
    return torch.cat([F.pad(x, (0, width - x.shape[1]), value=value) for x in xs], dim=0)


def sample(
    model,
    processor,
    prompts: list[EncodedPrompt],
    n: int,
    sp: SamplingParams,
) -> RolloutBatch:
    """Sample ``n`` completions for each prompt.

    Returns:
        RolloutBatch with tokens [B, T] (B = n * len(prompts), rows of one prompt adjacent),
        mask [B, T], group_id [B] (the prompt's position), logp_rollout [B, T] if asked,
        prompts (one entry per prompt) with prompt_index [B], and meta (``{"sample", "completion", "truncated"}``).
    """
    stop_ids = stop_token_ids(model, processor)
    pad_id = pad_token_id(processor, stop_ids)
    banned = vision_token_ids(processor)
    rows = prompt_inputs(prompts, n)
    lens = [int(x.numel()) for x in rows["prompt_ids"]]
    toks, logps = [], []
    with generation_mode(model):
        for chunk in row_chunks(lens, 1, sp.max_new_tokens, sp.token_budget):
            sub = {k: [v[i] for i in chunk] for k, v in rows.items()}
            t, lp = _generate_rows(model, sub, sp, stop_ids, pad_id, banned)
            toks.append(t)
            logps.append(lp)
    width = max(t.shape[1] for t in toks)
    tokens = _pad_right(toks, width, pad_id)  # [B, T']
    mask = completion_mask(tokens, stop_ids)
    T = max(int(mask.sum(1).max()), 1)
    tokens, mask = tokens[:, :T].contiguous(), mask[:, :T].contiguous()
    logp_rollout = None
    if sp.return_logprobs:
        logp_rollout = _pad_right(logps, width, 0.0)[:, :T] * mask
    lengths = mask.sum(1).long().tolist()
    texts = processor.batch_decode(
        [row[:n_tok] for row, n_tok in zip(tokens.tolist(), lengths)], skip_special_tokens=True
    )
    stop_t = torch.tensor(stop_ids, device=tokens.device)
    last = tokens.gather(1, (mask.sum(1, keepdim=True).long() - 1).clamp(min=0)).squeeze(1)
    truncated = (~torch.isin(last, stop_t)).tolist()
    meta = [
        {"sample": prompts[i // n].sample, "completion": texts[i], "truncated": truncated[i]}
        for i in range(len(texts))
    ]
    index = repeated_index(len(prompts), n)
    return RolloutBatch(
        tokens=tokens,
        mask=mask,
        group_id=index.to(tokens.device),
        logp_rollout=logp_rollout,
        segments=Segments.flat(mask),
        prompts=prompt_table(prompts),
        prompt_index=index,
        meta=meta,
    )


def greedy(
    model, processor, prompts: list[EncodedPrompt], max_new_tokens: int, token_budget: int = 16384
) -> RolloutBatch:
    """Greedy (temperature 0) completion of each prompt, e.g. for accuracy evaluation."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, token_budget=token_budget)
    return sample(model, processor, prompts, 1, sp)


def completions_batch(
    processor, prompts: list[EncodedPrompt], completions: list[str], stop_ids: list[int]
) -> RolloutBatch:
    """One row per (prompt, given completion text): ids are the tokenized text plus the stop
    token ``stop_ids[0]``, right-padded; ``group_id`` is the row index."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    tok = processor.tokenizer
    rows = [tok(c, add_special_tokens=False)["input_ids"] + [stop_ids[0]] for c in completions]
    T = max(len(r) for r in rows)
    pad = pad_token_id(processor, stop_ids)
    tokens = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), T))
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1.0
    meta = [
        {"sample": p.sample, "completion": c, "truncated": False}
        for p, c in zip(prompts, completions)
    ]
    return RolloutBatch(
        tokens=tokens,
        mask=mask,
        group_id=torch.arange(len(rows)),
        segments=Segments.flat(mask),
        prompts=prompt_table(prompts),
        prompt_index=torch.arange(len(rows)),
        meta=meta,
    )
