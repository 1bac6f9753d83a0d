"""Tree rollouts on the vLLM engine: the HF tree sampler's contract (``vlm/tree_rollout.py``)
with vLLM generating each segment.

Depth by depth, every live branch is one request of one completion: its prompt and the tokens
of its ancestors' segments, stopped at the stop token or the segment's length (the last depth
runs to ``max_new_tokens``). vLLM's prefix caching holds the shared prompt and segments, so a
child's request computes only what its parent's did not (whole KV blocks: the segments should
span blocks, see ``rollout.vllm.block_size``). Branches that stop are leaves, forks follow the
same `kv_sampler.fork_plan` (TreePO's fallback: a stopped branch's leaves go to live ones),
rows are recorded on the same `LeafRows` and returned by the same `leaves_batch`, so the batch
(``segments`` included) and everything downstream are the HF sampler's.

``allocate="entropy"`` needs the next-token distribution at a segment's end, which vLLM does not
return; it is refused at load (``vlm/builder.py``). Trees of multi-turn episodes are HF-only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..trainer.batch import RolloutBatch
from .kv_sampler import TreeShape, fork_plan, forked_rows, rank_within
from .prompts import EncodedPrompt
from .rollout import SamplingParams
from .tree_rollout import LeafRows, leaves_batch
from .vllm_episode import RowImages

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
        live = forked_rows(going, idx, buf.clone)
    engine.stats["rollout/vision_tokens_stripped"] = float(stripped)
    return leaves_batch(engine.processor, prompts, buf, True, depth > 1)


def _segment(engine: VLLMEngine, prompts: list[EncodedPrompt], buf: LeafRows, live: torch.Tensor,
             node: torch.Tensor, length: int, sp: SamplingParams, images: RowImages,
             seed: int) -> int:  # fmt: skip
    """Up to ``length`` tokens of every row in ``live`` (its request seeded ``seed + row``);
    rows that end with the stop token are marked stopped (a segment cut before a vision
    placeholder is kept up to the cut and the branch goes on). Returns how many were cut."""
    rows = live.tolist()
    of = [int(buf.prompt[r]) for r in rows]
    seqs = [prompts[u].input_ids.tolist() + buf.sequence(r) for r, u in zip(rows, of)]
    reqs = [images.request(seq, u, r) for r, seq, u in zip(rows, seqs, of)]
    seg_sp = replace(sp, max_new_tokens=length)
    params = [engine.sampling_params(seg_sp, 1, seed + r) for r in rows]
    segments = engine.complete_rows(seqs, reqs, params, [prompts[u].sample.get("id") for u in of])
    stripped = 0
    for i, (r, (ids, lp, cut)) in enumerate(zip(rows, segments)):
        stripped += cut
        buf.put_segment(r, ids, lp, int(node[i]))
        buf.stopped[r] = bool(ids and ids[-1] in engine.stop_ids and not cut)
    return stripped
