"""Tree rollouts on the vLLM engine: the HF tree sampler's contract (``vlm/tree_rollout.py``)
with vLLM generating each segment.

Depth by depth, every live branch is one request of one completion: its prompt and the tokens
of its ancestors' segments, stopped at the stop token or the segment's length (the last depth
runs to ``max_new_tokens``). vLLM's prefix caching holds the shared prompt and segments, so a
child's request computes only what its parent's did not (whole KV blocks: the segments should
span blocks, see ``rollout.vllm.block_size``). Branches that stop are leaves, forks follow the
same `tree_rollout.fork_plan` (TreePO's fallback: a stopped branch's leaves go to live ones),
rows are recorded on the same `LeafRows` and returned by the same `leaves_batch`, so the batch
(``segments`` included) and everything downstream are the HF sampler's.

``allocate="entropy"`` needs the next-token distribution at a segment's end, which vLLM does not
return; it is refused at load (``vlm/run.py``). Trees of multi-turn episodes are HF-only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..trainer.batch import RolloutBatch
from .prompts import EncodedPrompt
from .rollout import SamplingParams
from .tree_rollout import LeafRows, TreeShape, fork_plan, leaves_batch, rank_within
from .vllm_episode import RowImages
from .vllm_rollout import _sampled_logprob, check_prompt_ids, strip_vision_tokens

if TYPE_CHECKING:
    from .vllm_rollout import VLLMEngine


def sample_tree(
    engine: VLLMEngine, prompts: list[EncodedPrompt], shape: TreeShape, sp: SamplingParams
) -> RolloutBatch:
    """``shape.leaves`` completions per prompt grown as trees on ``engine`` (fewer when every
    branch of a prompt stops before the last fork); ``logp_rollout`` always filled."""
    if shape.allocate != "uniform":
        raise ValueError(f"tree allocate {shape.allocate!r} is HF-only; use uniform with vLLM")
    U, first, depth = len(prompts), shape.branches[0], len(shape.branches)
    buf = LeafRows(U * shape.leaves, sp.max_new_tokens, engine.pad_id)
    live = buf.take(U * first)
    buf.prompt[live] = torch.arange(U).repeat_interleave(first)
    next_node = torch.ones(U, dtype=torch.long)
    images = RowImages(prompts, engine.vision_ids)
    base = int(torch.randint(0, 2**30, ()))
    stripped = 0
    for d in range(depth):
        left = sp.max_new_tokens - d * shape.segment_tokens
        length = left if d == depth - 1 else min(shape.segment_tokens, left)
        prompt = buf.prompt[live]
        node = next_node[prompt] + rank_within(prompt)  # one new node per live branch
        next_node.index_add_(0, prompt, torch.ones_like(prompt))
        seed = base + d * len(buf.cursor)
        stripped += _segment(engine, prompts, buf, live, node, length, sp, images, seed)
        going = live[~buf.stopped[live]]
        if d == depth - 1 or length >= left or not len(going):
            break
        done = torch.arange(buf.used)[buf.stopped[: buf.used]]
        idx = fork_plan(buf.prompt[going], buf.prompt[done], U, shape, d + 1, None)
        live = going[idx].clone()
        first_child = torch.ones(len(idx), dtype=torch.bool)
        first_child[1:] = idx[1:] != idx[:-1]
        if not first_child.all():  # further children get fresh rows copying their parent's
            live[~first_child] = buf.clone(live[~first_child])
    engine.stats["rollout/vision_tokens_stripped"] = float(stripped)
    return leaves_batch(engine.processor, prompts, buf, True, depth > 1)


def _segment(engine: VLLMEngine, prompts: list[EncodedPrompt], buf: LeafRows, live: torch.Tensor,
             node: torch.Tensor, length: int, sp: SamplingParams, images: RowImages,
             seed: int) -> int:  # fmt: skip
    """Up to ``length`` tokens of every row in ``live`` (its request seeded ``seed + row``);
    rows that end with the stop token are marked stopped (a segment cut before a vision
    placeholder is kept up to the cut and the branch goes on). Returns how many were cut."""
    rows = live.tolist()
    seqs = [prompts[int(buf.prompt[r])].input_ids.tolist() + _so_far(buf, r) for r in rows]
    reqs = [images.request(seq, int(buf.prompt[r]), r) for r, seq in zip(rows, seqs)]
    seg_sp = replace(sp, max_new_tokens=length)
    params = [engine.sampling_params(seg_sp, 1, seed + r) for r in rows]
    outs = engine.llm.generate(reqs, params, use_tqdm=False)
    stripped = 0
    for i, (r, seq, out) in enumerate(zip(rows, seqs, outs)):
        sample = prompts[int(buf.prompt[r])].sample
        check_prompt_ids(seq, list(out.prompt_token_ids), sample.get("id"), engine.vision_ids)
        c = out.outputs[0]
        lp = [_sampled_logprob(e, t) for e, t in zip(c.logprobs, c.token_ids)]
        ids, lp, cut = strip_vision_tokens(list(c.token_ids), lp, engine.vision_ids)
        stripped += cut
        k = len(ids)
        if k:
            at = int(buf.cursor[r])
            buf.tokens[r, at : at + k] = torch.tensor(ids, dtype=torch.long)
            buf.logp[r, at : at + k] = torch.tensor(lp, dtype=torch.float32)
            buf.node[r, at : at + k] = node[i]
            buf.cursor[r] += k
        buf.stopped[r] = bool(k and ids[-1] in engine.stop_ids and not cut)
    return stripped


def _so_far(buf: LeafRows, row: int) -> list[int]:
    return buf.tokens[row, : int(buf.cursor[row])].tolist()
