from __future__ import annotations

import torch

from perceptrl.vlm import rollout
from perceptrl.vlm.rollout import SamplingParams, completion_mask
from perceptrl.vlm.sampler import Rollouts


def test_completion_mask_includes_first_stop_only():
    tokens = torch.tensor([[5, 6, 2, 0, 0], [5, 2, 7, 2, 9], [5, 6, 7, 8, 9], [2, 0, 0, 0, 0]])
    mask = completion_mask(tokens, stop_ids=[2, 0])
    expected = [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert mask.tolist() == expected
    assert mask.dtype == torch.float32


def test_budget_chunks_respect_the_token_budget():
    lens = [10, 12, 30, 8, 8, 8, 40]
    chunks = list(rollout.row_chunks(lens, 1, 10, 70))
    assert [i for c in chunks for i in c] == list(range(len(lens)))
    for c in chunks:
        assert len(c) == 1 or len(c) * (max(lens[i] for i in c) + 10) <= 70
    assert chunks == [[0, 1], [2], [3, 4, 5], [6]]
    assert list(rollout.row_chunks([100], 1, 10, 5)) == [[0]]  # never empty


def test_collate_left_pads_prompts_and_appends_completions():
    inputs = {
        "prompt_ids": [torch.tensor([1, 2, 3]), torch.tensor([4, 5])],
        "mm_token_type_ids": [torch.tensor([0, 1, 0]), torch.tensor([1, 0])],
        "pixel_values": [torch.ones(4, 6), torch.zeros(8, 6)],
        "image_grid_thw": [torch.tensor([[1, 2, 2]]), torch.tensor([[1, 2, 4]])],
    }
    comp = torch.tensor([[7, 8], [9, 0]])
    out = rollout.collate(inputs, 0, torch.device("cpu"), comp, torch.tensor([[1, 1], [1, 0]]))
    assert out["input_ids"].tolist() == [[1, 2, 3, 7, 8], [0, 4, 5, 9, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
    assert out["mm_token_type_ids"].tolist() == [[0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]
    assert out["pixel_values"].shape == (12, 6)
    assert out["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4]]


def test_sample_groups_masks_and_text(policy, samples):
    prompts, _ = policy.encode(samples[:3])
    torch.manual_seed(0)
    sp = SamplingParams(max_new_tokens=24, token_budget=200)  # several generate calls
    b = Rollouts(policy).sample(prompts, n=4, sampling=sp)
    B, T = b.tokens.shape
    assert B == 12 and T <= 24
    assert b.group_id.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert [m["sample"]["id"] for m in b.meta] == [s["id"] for s in samples[:3] for _ in range(4)]
    assert not b.inputs and b.prompt_index.tolist() == b.group_id.tolist()
    assert len(b.prompts["prompt_ids"]) == 3 and len(b.prompts["pixel_values"]) == 3  # once each
    rows = b.row_prompts()
    assert rows["pixel_values"][0] is rows["pixel_values"][3]  # shared, not copied
    stops = torch.tensor(policy.stop_ids)
    lengths = b.mask.sum(1).long()
    for i in range(B):
        n = int(lengths[i])
        assert b.mask[i, :n].eq(1).all() and b.mask[i, n:].eq(0).all()
        row = b.tokens[i, :n]
        assert not torch.isin(row[:-1], stops).any()  # the first stop token ends the mask
        assert b.meta[i]["truncated"] == (not bool(torch.isin(row[-1], stops)))
        assert b.meta[i]["truncated"] == (n == 24 and not bool(torch.isin(row[-1], stops)))
        text = policy.processor.tokenizer.decode(row, skip_special_tokens=True)
        assert b.meta[i]["completion"] == text
    assert not torch.isin(b.tokens, torch.tensor(policy.banned_ids)).any()
    # the 4 samples of a prompt are different draws
    assert len({tuple(b.tokens[i].tolist()) for i in range(4)}) > 1


def test_eos_is_kept_and_stops_generation(policy, samples):
    """Make <|im_end|> overwhelmingly likely: every completion is exactly that one token."""
    prompts, _ = policy.encode(samples[:2])
    im_end = policy.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    head = policy.model.get_output_embeddings()
    bias = torch.zeros(head.weight.shape[0])
    bias[im_end] = 50.0
    hook = head.register_forward_hook(lambda module, inp, out: out + bias)
    try:
        b = Rollouts(policy).sample(prompts, n=3, sampling=SamplingParams(max_new_tokens=8))
    finally:
        hook.remove()
    assert b.tokens.shape == (6, 1)
    assert b.tokens.eq(im_end).all() and b.mask.eq(1).all()
    assert all(m["completion"] == "" and not m["truncated"] for m in b.meta)


def test_greedy_is_independent_of_token_budget(policy, samples):
    prompts, _ = policy.encode(samples)
    big = rollout.greedy(policy.model, policy.processor, prompts, 16, token_budget=100_000)
    small = rollout.greedy(policy.model, policy.processor, prompts, 16, token_budget=150)
    assert torch.equal(big.tokens, small.tokens) and torch.equal(big.mask, small.mask)
    assert [m["completion"] for m in big.meta] == [m["completion"] for m in small.meta]


def test_shipped_generation_config_does_not_leak(policy, samples):
    """A checkpoint's generation_config (e.g. Qwen's top_k=1, repetition_penalty) must not change
    RL sampling: with top_k=1 leaking, the 4 draws of a prompt would all be identical."""
    prompts, _ = policy.encode(samples[:1])
    gc = policy.model.generation_config
    saved = (gc.top_k, gc.repetition_penalty, gc.max_new_tokens)
    gc.top_k, gc.repetition_penalty, gc.max_new_tokens = 1, 1.5, 2
    try:
        torch.manual_seed(1)
        b = Rollouts(policy).sample(prompts, n=4, sampling=SamplingParams(max_new_tokens=12))
    finally:
        gc.top_k, gc.repetition_penalty, gc.max_new_tokens = saved
    assert b.tokens.shape[1] > 2
    assert len({tuple(r) for r in b.tokens.tolist()}) > 1
    assert policy.model.generation_config.top_k == saved[0]
