from __future__ import annotations

import pytest
import torch

from perceptrl.trainer.batch import RolloutBatch
from perceptrl.trainer.policy import Policy
from perceptrl.vlm import rollout
from perceptrl.vlm.policy import VLMPolicy
from perceptrl.vlm.rollout import BANNED_LOGIT, SamplingParams
from perceptrl.vlm.sampler import Rollouts


@pytest.fixture(scope="module")
def batch(policy, samples) -> RolloutBatch:
    """3 completions for each of the 6 prompts (prompt lengths differ: padding is exercised)."""
    torch.manual_seed(0)
    prompts, _ = policy.encode(samples)
    sp = SamplingParams(max_new_tokens=20, return_logprobs=True)
    return Rollouts(policy).sample(prompts, n=3, sampling=sp)


def naive_logp_entropy(policy: VLMPolicy, b: RolloutBatch, i: int):
    """Row ``i`` alone: prompt + its unpadded completion, full logits, no padding anywhere."""
    n = int(b.mask[i].sum())
    rows = b.row_prompts()
    prompt = rows["prompt_ids"][i]
    ids = torch.cat([prompt, b.tokens[i, :n]])[None]
    types = torch.zeros_like(ids)
    types[0, : prompt.numel()] = rows["mm_token_type_ids"][i]
    with torch.no_grad():
        logits = policy.model(
            input_ids=ids,
            pixel_values=rows["pixel_values"][i],
            image_grid_thw=rows["image_grid_thw"][i],
            mm_token_type_ids=types,
        ).logits[0, prompt.numel() - 1 : -1]
    logits[:, policy.banned_ids] = float("-inf")  # the policy never emits vision placeholders
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, b.tokens[i, :n, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).nan_to_num().sum(-1)
    return logp, entropy


def test_is_a_trainer_policy(policy):
    assert isinstance(policy, Policy)


def test_evaluate_matches_naive_per_sample_forward(policy, batch):
    policy.eval()
    with torch.no_grad():
        ev = policy.evaluate(batch)
        logp, entropy, value = ev.logp, ev.entropy, ev.value
    assert value is None and logp.shape == entropy.shape == batch.tokens.shape
    assert logp.dtype == torch.float32
    for i in range(len(batch)):
        n = int(batch.mask[i].sum())
        ref_logp, ref_ent = naive_logp_entropy(policy, batch, i)
        torch.testing.assert_close(logp[i, :n], ref_logp, atol=1e-4, rtol=0)
        torch.testing.assert_close(entropy[i, :n], ref_ent, atol=1e-4, rtol=0)
        assert logp[i, n:].eq(0).all() and entropy[i, n:].eq(0).all()
    assert (entropy[batch.mask.bool()] > 0).all()


def test_evaluate_is_independent_of_minibatch_composition(policy, batch):
    with torch.no_grad():
        full = policy.evaluate(batch).logp
        perm = [7, 0, 16, 3, 11]
        part = policy.evaluate(batch.select(perm)).logp
    T = part.shape[1]
    torch.testing.assert_close(part, full[perm, :T], atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_evaluate_matches_generation_scores(policy, samples, temperature, with_settings):
    """Sampling with top_p 1, top_k 0 at the policy's temperature: the scores generate sampled
    from are the policy's (tempered) distribution, so their log-softmax equals ``evaluate``."""
    with with_settings(policy, temperature=temperature):
        assert policy.temperature == temperature
        _check_evaluate_matches_generation(policy, samples, temperature)


def _check_evaluate_matches_generation(policy, samples, temperature):
    prompts, _ = policy.encode(samples[:4])
    kwargs = rollout.collate(rollout.prompt_inputs(prompts, 2), policy.pad_id, policy.device)
    torch.manual_seed(3)
    with torch.no_grad():
        out = policy.model.generate(
            **kwargs,
            do_sample=True, temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=16,
            eos_token_id=policy.stop_ids, pad_token_id=policy.pad_id,
            suppress_tokens=policy.banned_ids, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens = out.sequences[:, kwargs["input_ids"].shape[1] :]
    mask = rollout.completion_mask(tokens, policy.stop_ids)
    scores = torch.stack(out.scores, 1).log_softmax(-1)  # [B, T, V]
    gen_logp = scores.gather(-1, tokens[..., None]).squeeze(-1) * mask
    index = rollout.repeated_index(4, 2)
    b = RolloutBatch(
        tokens=tokens, mask=mask, group_id=index, prompts=rollout.prompt_table(prompts),
        prompt_index=index,
    )  # fmt: skip
    with torch.no_grad():
        logp = policy.evaluate(b).logp
    torch.testing.assert_close(logp, gen_logp, atol=1e-4, rtol=0)


def test_rollout_logprobs_match_evaluate(policy, batch):
    with torch.no_grad():
        logp = policy.evaluate(batch).logp
    torch.testing.assert_close(batch.logp_rollout, logp, atol=1e-4, rtol=0)


def test_gradient_flows_to_text_and_vision(policy, batch):
    policy.train()
    policy.model.zero_grad()
    ev = policy.evaluate(batch.select([0, 5, 9]))
    logp, entropy = ev.logp, ev.entropy
    (-(logp.sum()) - 0.01 * entropy.sum()).backward()
    named = dict(policy.named_parameters())
    vision = [g for k, p in named.items() if "visual" in k and (g := p.grad) is not None]
    text = [g for k, p in named.items() if "language_model" in k and (g := p.grad) is not None]
    assert vision and any(g.abs().sum() > 0 for g in vision)
    assert text and any(g.abs().sum() > 0 for g in text)
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None)
    policy.model.zero_grad()
    policy.eval()


def test_banned_tokens_get_no_probability(policy, batch):
    logits = policy.completion_logits(batch.select([0]))
    assert (logits[..., policy.banned_ids] == BANNED_LOGIT).all()


def test_save_load_roundtrip_same_logits(policy, batch, tmp_path):
    policy.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    loaded = VLMPolicy.from_pretrained(tmp_path / "ckpt")
    sub = batch.select([1, 4, 8])
    with torch.no_grad():
        a = policy.completion_logits(sub)
        b = loaded.completion_logits(sub)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_reference_is_a_frozen_copy(policy, batch):
    ref = policy.reference()
    assert not ref.training and all(not p.requires_grad for p in ref.parameters())
    sub = batch.select([2, 3])
    with torch.no_grad():
        before = ref.evaluate(sub).logp
        torch.testing.assert_close(before, policy.evaluate(sub).logp)
        p = next(policy.parameters())
        p.add_(0.5)
        try:
            assert torch.equal(ref.evaluate(sub).logp, before)
            assert not torch.allclose(policy.evaluate(sub).logp, before)
        finally:
            p.sub_(0.5)


def test_train_eval_modes(policy):
    assert policy.train() is policy and policy.training and policy.model.training
    assert policy.eval() is policy and not policy.training


def test_gradient_checkpointing_gives_the_same_gradients(policy, tiny_dirs, batch):
    arch = policy.model.config.model_type
    sub = batch.select([0, 10])
    grads = []
    for ckpt in (False, True):
        pol = VLMPolicy.from_pretrained(tiny_dirs[arch], gradient_checkpointing=ckpt).train()
        logp = pol.evaluate(sub).logp
        logp.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in pol.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_one_policy_gradient_step_changes_parameters(policy, tiny_dirs, samples):
    """A GRPO-shaped update (group-normalised rewards, token-mean loss) on a fresh copy."""
    pol = VLMPolicy.from_pretrained(tiny_dirs[policy.model.config.model_type])
    torch.manual_seed(0)
    b = Rollouts(pol).generate(samples[:2], n=4, sampling=SamplingParams(max_new_tokens=12))
    rewards = torch.tensor([float(len(m["completion"]) % 3) for m in b.meta])
    grouped = rewards.view(2, 4)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(
        -1
    )
    before = [p.detach().clone() for p in pol.parameters()]
    opt = torch.optim.AdamW(pol.parameters(), lr=1e-3)
    pol.train()
    logp = pol.evaluate(b).logp
    loss = -(logp * adv[:, None] * b.mask).sum() / b.mask.sum()
    loss.backward()
    opt.step()
    changed = sum(not torch.equal(a, p) for a, p in zip(before, pol.parameters()))
    assert changed > len(before) // 2


def test_load_restores_weights_in_place(policy, tiny_dirs, batch, tmp_path):
    policy.save(tmp_path / "ckpt")
    other = VLMPolicy.from_pretrained(tiny_dirs[policy.model.config.model_type])
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5).add_(0.01)
    ids = [id(p) for p in other.parameters()]
    other.load(tmp_path / "ckpt")
    assert [id(p) for p in other.parameters()] == ids  # the optimizer's tensors stay valid
    sub = batch.select([0, 6])
    with torch.no_grad():
        torch.testing.assert_close(other.completion_logits(sub), policy.completion_logits(sub))
    with pytest.raises(Exception, match="does not exist"):
        other.load(tmp_path / "missing")


def test_completions_batch_scores_given_texts(policy, samples):
    texts = ["<think>two</think><answer>2</answer>", "<answer>B</answer>"]
    b = policy.completions_batch(samples[:2], texts)
    im_end = policy.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    lengths = b.mask.sum(1).long().tolist()
    for i, n in enumerate(lengths):
        assert b.tokens[i, n - 1] == im_end
        assert policy.processor.tokenizer.decode(b.tokens[i, : n - 1]) == texts[i]
    with torch.no_grad():
        logp = policy.evaluate(b).logp
    assert torch.isfinite(logp).all() and (logp[b.mask.bool()] < 0).all()


def test_mixed_text_only_and_image_rows(policy, samples):
    text_only = {**samples[0], "id": "t", "images": [], "question": "Say yes."}
    torch.manual_seed(0)
    b = Rollouts(policy).generate(
        [text_only, samples[1]], n=2, sampling=SamplingParams(max_new_tokens=8)
    )
    assert b.prompts["pixel_values"][0] is None and b.prompts["pixel_values"][1] is not None
    with torch.no_grad():
        logp = policy.evaluate(b).logp
        for i in (2, 3):  # the image rows, scored next to text-only rows, match their naive forward
            n = int(b.mask[i].sum())
            ref, _ = naive_logp_entropy(policy, b, i)
            torch.testing.assert_close(logp[i, :n], ref, atol=1e-4, rtol=0)
        alone = policy.evaluate(b.select([0, 1])).logp
    torch.testing.assert_close(alone, logp[:2, : alone.shape[1]], atol=1e-4, rtol=0)
