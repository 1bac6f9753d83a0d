"""The shared-prefix training forward (``VLMPolicy.share_prefix``) against the plain one-forward
path: same log-probs, entropies and gradients, and the fallbacks where it does not apply."""

from __future__ import annotations

import pytest
import torch

from perceptrl.trainer.batch import RolloutBatch
from perceptrl.vlm.policy import VLMPolicy
from perceptrl.vlm.rollout import SamplingParams
from perceptrl.vlm.sampler import Rollouts
from perceptrl.vlm.tiny import build_tiny

LENGTHS = [9, 3, 12, 1, 7, 12, 5, 10, 2, 11, 6, 4]
"""completion lengths of the 12 rows (right padding differs per row)"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("prefix") / "qwen2_5_vl", seed=0)


@pytest.fixture(scope="module")
def pol(tiny_dir) -> VLMPolicy:
    return VLMPolicy.from_pretrained(tiny_dir)


def with_lengths(b: RolloutBatch, order: list[int]) -> RolloutBatch:
    """Rows in ``order`` (rows of one prompt no longer adjacent), completions cut to LENGTHS."""
    b = b.select(order)
    mask = torch.zeros_like(b.mask)
    for i, n in enumerate(LENGTHS[: len(b)]):
        mask[i, :n] = 1
    b.mask = mask
    return b


@pytest.fixture(scope="module")
def batch(pol, samples) -> RolloutBatch:
    """4 prompts of different lengths (left padding) x 3 completions, shuffled rows."""
    torch.manual_seed(0)
    prompts, _ = pol.encode([samples[i] for i in (0, 1, 2, 4)])
    b = Rollouts(pol).sample(prompts, n=3, sampling=SamplingParams(max_new_tokens=12))
    assert len({p.input_ids.numel() for p in prompts}) > 1  # prompts really differ in length
    return with_lengths(b, [5, 0, 9, 1, 11, 3, 7, 2, 10, 4, 8, 6])


def count_forwards(policy: VLMPolicy) -> tuple[list, object]:
    """Record the rows x tokens of each call of the policy's model."""
    shapes: list = []

    def hook(module, args, kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))

    return shapes, policy.model.register_forward_pre_hook(hook, with_kwargs=True)


def scored(policy: VLMPolicy, b: RolloutBatch, share: bool, grad: bool = False):
    """logp, entropy, forward shapes and (if ``grad``) the gradients of a GRPO-like loss."""
    policy.share_prefix = share
    policy.model.zero_grad()
    shapes, handle = count_forwards(policy)
    try:
        with torch.set_grad_enabled(grad):
            ev = policy.evaluate(b)
            logp, entropy = ev.logp, ev.entropy
            if grad:
                adv = torch.linspace(-1, 1, len(b))[:, None]
                ((logp * adv).sum() / b.mask.sum() + 0.01 * entropy.sum()).backward()
    finally:
        handle.remove()
        policy.share_prefix = True
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.model.zero_grad()
    return logp.detach(), entropy.detach(), shapes, grads


def test_shared_prefix_matches_plain_forward(pol, batch):
    logp, ent, shapes, _ = scored(pol, batch, share=True)
    ref_logp, ref_ent, ref_shapes, _ = scored(pol, batch, share=False)
    assert len(ref_shapes) == 1 and ref_shapes[0][0] == 12
    assert [s[0] for s in shapes] == [4, 12]  # 4 prompts once, then 12 completions
    assert shapes[1][1] == batch.tokens.shape[1]
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    m = batch.mask.bool()
    assert logp[~m].eq(0).all() and (logp[m] < 0).all() and (ent[m] > 0).all()


def test_shared_prefix_gradients_match(pol, batch):
    _, _, _, grads = scored(pol, batch, share=True, grad=True)
    _, _, _, ref = scored(pol, batch, share=False, grad=True)
    assert grads.keys() == ref.keys()
    assert any("visual" in n for n in grads) and any("language_model" in n for n in grads)
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], atol=1e-4, rtol=1e-4, msg=n)


def test_text_only_and_mixed_prompts(pol, samples):
    text = [{**samples[i], "id": f"t{i}", "images": [], "question": q} for i, q in
            enumerate(["Say yes.", "How many circles are there in the picture? Count."])]  # fmt: skip
    torch.manual_seed(1)
    for chosen in (text, [text[0], samples[1], text[1]]):
        prompts, _ = pol.encode(chosen)
        b = Rollouts(pol).sample(prompts, n=3, sampling=SamplingParams(max_new_tokens=12))
        b = with_lengths(b, list(range(len(b)))[::-1])
        logp, ent, shapes, grads = scored(pol, b, share=True, grad=True)
        ref_logp, ref_ent, _, ref = scored(pol, b, share=False, grad=True)
        assert [s[0] for s in shapes] == [len(chosen), len(b)]
        torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], atol=1e-4, rtol=1e-4, msg=n)


def test_no_shared_rows_keep_one_forward(pol, samples):
    prompts, _ = pol.encode(samples[:3])
    torch.manual_seed(2)
    b = Rollouts(pol).sample(prompts, n=1, sampling=SamplingParams(max_new_tokens=6))
    _, _, shapes, _ = scored(pol, b, share=True)
    assert shapes == [(3, shapes[0][1])]


def vision_patches(policy: VLMPolicy, b: RolloutBatch, share: bool) -> int:
    """Patch rows the vision tower encodes while ``policy`` scores ``b``."""
    visual = next(m for n, m in policy.model.named_modules() if n.endswith("visual"))
    seen: list[int] = []
    handle = visual.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    policy.share_prefix = share
    try:
        with torch.no_grad():
            policy.evaluate(b)
    finally:
        handle.remove()
        policy.share_prefix = True
    return sum(seen)


def test_group_structure_survives_a_copying_move(batch):
    """The rows of a prompt share one stored copy of its tensors, before and after a device move
    that really copies (to ``meta``): the policy reads that structure, not tensor identity."""
    assert batch.num_prompts() == 4 and len(batch) == 12
    moved = batch.to("meta")
    assert moved.num_prompts() == 4 and torch.equal(moved.prompt_index, batch.prompt_index)
    assert all(x.device.type == "meta" for x in moved.prompts["pixel_values"])
    rows = moved.row_prompts()["pixel_values"]
    for b in range(len(moved)):
        first = int((batch.prompt_index == batch.prompt_index[b]).nonzero()[0])
        assert rows[b] is rows[first]  # one tensor per prompt, not one per row
    part = batch.select([11, 0, 5, 6])
    assert part.num_prompts() == len(set(batch.prompt_index[[11, 0, 5, 6]].tolist()))


@pytest.mark.parametrize("share", [True, False])
def test_vision_tower_runs_once_per_prompt(pol, batch, share):
    per_prompt = [int(g.prod(-1).sum()) for g in batch.prompts["image_grid_thw"]]
    assert vision_patches(pol, batch, share) == sum(per_prompt)
    both = RolloutBatch.concat([batch.select([0, 1, 2]), batch.select([3, 4, 5, 6])])
    used = set(batch.prompt_index[:3].tolist()), set(batch.prompt_index[3:7].tolist())
    expect = sum(per_prompt[u] for u in used[0]) + sum(per_prompt[u] for u in used[1])
    assert vision_patches(pol, both, share) == expect


def test_fallbacks_gradient_checkpointing_and_switch(tiny_dir, batch):
    ckpt = VLMPolicy.from_pretrained(tiny_dir, gradient_checkpointing=True).train()
    _, _, shapes, _ = scored(ckpt, batch, share=True, grad=True)
    assert len(shapes) == 1  # activation checkpointing drops caches: one plain forward
    off = VLMPolicy.from_pretrained(tiny_dir, share_prefix=False)
    assert not off.share_prefix and not off.reference().share_prefix


def test_lora_policy_shares_prefix(tiny_dir, batch):
    from perceptrl.vlm.lora import apply_lora

    lora = apply_lora(VLMPolicy.from_pretrained(tiny_dir), rank=4, alpha=8.0)
    with torch.no_grad():  # B = 0 at init: make the adapters do something
        for n, p in lora.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    logp, _, shapes, grads = scored(lora, batch, share=True, grad=True)
    ref_logp, _, _, ref = scored(lora, batch, share=False, grad=True)
    assert len(shapes) == 2 and grads.keys() == ref.keys() and all("lora_" in n for n in ref)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], atol=1e-4, rtol=1e-4, msg=n)
