"""Tree sampling (``vlm/tree_rollout.py``): the training forward scores what was sampled (flat
groups and trees, both Qwen families), shared segments are one sample copied into every leaf
below them, a tree samples fewer tokens than the same number of flat completions, a prompt is
encoded once for all its rows, stopped branches hand their leaves to the live ones."""

from __future__ import annotations

import contextlib

import pytest
import torch

from perceptrl.vlm.policy import VLMPolicy
from perceptrl.vlm.rollout import SamplingParams
from perceptrl.vlm.sampler import Rollouts, sampled_tokens
from perceptrl.vlm.schedule import TreeShape, _allocate
from perceptrl.vlm.tiny import ARCHS

TOL = 1e-5
"""float32 on the CPU: training-forward log-probs equal the sampled ones to this"""


@pytest.fixture(scope="module", params=ARCHS)
def pol(request, tiny_dirs) -> VLMPolicy:
    return VLMPolicy.from_pretrained(tiny_dirs[request.param])


@contextlib.contextmanager
def stop_bias(policy: VLMPolicy, bias: float):
    """Add ``bias`` to the stop token's logit in sampling and training alike (a hook on the LM
    head): positive ends completions early, very negative never ends them."""
    stop = torch.tensor([policy.stop_ids[0]])

    def hook(module, args, out):
        return out.index_add(-1, stop, torch.full((*out.shape[:-1], 1), bias))

    handle = policy.model.lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def sample(policy, samples, shape, max_new=24, seed=0):
    prompts, _ = policy.encode(samples)
    policy.tree = shape
    torch.manual_seed(seed)
    try:
        return Rollouts(policy).sample(
            prompts, shape.leaves, SamplingParams(max_new_tokens=max_new, return_logprobs=True)
        )
    finally:
        policy.tree = None


def count_decoded(policy) -> tuple[list, object]:
    """Rows fed per model call while sampling (prefill calls included)."""
    rows: list[int] = []

    def hook(module, args, kwargs):
        rows.append(int(kwargs["input_ids"].shape[0]))

    return rows, policy.model.register_forward_pre_hook(hook, with_kwargs=True)


SHAPES = [TreeShape.flat(4), TreeShape((2, 2), 8), TreeShape((1, 2, 2), 5, "entropy")]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s.branches)))
def test_training_forward_matches_the_sampled_logprobs(pol, samples, shape):
    with stop_bias(pol, 2.0):  # some rows stop early, some run to max_new
        b = sample(pol, samples[:3], shape)
        with torch.no_grad():
            logp = pol.evaluate(b).logp
    assert b.group_id.tolist() == sorted(b.group_id.tolist())
    gap = ((logp - b.logp_rollout) * b.mask).abs().max()
    assert gap <= TOL, float(gap)
    assert b.segments.branches == (len(shape.branches) > 1)


def test_a_shared_segment_is_one_sample_copied_into_its_leaves(pol, samples):
    with stop_bias(pol, -1e4):  # no row stops: a full tree of 4 leaves per prompt
        b = sample(pol, samples[:2], TreeShape((2, 2), 8))
    assert len(b) == 8 and b.mask.sum() == 8 * 24
    for g in range(2):
        rows = (b.group_id == g).nonzero().squeeze(1)
        seg = b.segments.node[rows]
        # depth 1: two nodes, each shared by two leaves; depth 2: four nodes, one per leaf
        assert seg[:, :8].unique().numel() == 2 and seg[:, 8:].unique().numel() == 4
        for node in seg[:, 0].unique():
            sharing = rows[seg[:, 0] == node]
            assert len(sharing) == 2
            assert torch.equal(b.tokens[sharing[0], :8], b.tokens[sharing[1], :8])
            assert torch.equal(b.logp_rollout[sharing[0], :8], b.logp_rollout[sharing[1], :8])
            assert not torch.equal(b.tokens[sharing[0], 8:], b.tokens[sharing[1], 8:])


def test_a_tree_samples_fewer_tokens_than_flat_groups(pol, samples):
    """No row stops: flat G=4 samples 4 x 24 tokens per prompt, the [2, 2] tree with 8-token
    segments 2 x 8 + 4 x 16; each prompt is prefilled once, and every sampled token but a
    completion's last is fed back through the model."""
    sampled, fed = {}, {}
    for name, shape in {"flat": TreeShape.flat(4), "tree": TreeShape((2, 2), 8)}.items():
        rows, handle = count_decoded(pol)
        try:
            with stop_bias(pol, -1e4):
                b = sample(pol, samples[:3], shape)
        finally:
            handle.remove()
        assert rows[0] == 3  # the prefill: each distinct prompt once
        fed[name] = sum(rows[1:])
        sampled[name] = sampled_tokens(b)
    assert sampled == {"flat": (3 * 4 * 24, 3 * 4 * 24), "tree": (3 * 80, 3 * 4 * 24)}
    assert fed == {"flat": 3 * 4 * 23, "tree": 3 * (2 * 8 + 4 * 15)}


def test_each_prompt_goes_through_the_vision_tower_once(pol, samples):
    patches = []
    visual = next(m for n, m in pol.model.named_modules() if n.endswith("visual"))
    handle = visual.register_forward_pre_hook(lambda m, a: patches.append(a[0].shape[0]))
    try:
        b = sample(pol, samples[:3], TreeShape((2, 2), 8))
    finally:
        handle.remove()
    per_prompt = [int(v.shape[0]) for v in b.prompts["pixel_values"]]
    assert patches == [sum(per_prompt)]


def test_stopped_branches_hand_their_leaves_to_live_ones(pol, samples):
    """With a strong stop bias most first segments end; every prompt still gets 4 leaves as long
    as one branch lives at each fork, and a row ends with the stop token unless truncated."""
    with stop_bias(pol, 3.0):
        b = sample(pol, samples, TreeShape((2, 2), 3), max_new=12, seed=3)
    counts = torch.bincount(b.group_id)
    stop = pol.stop_ids[0]
    short = b.mask.sum(1) <= 3
    assert short.any() and (~short).any()  # leaves of depth one and of depth two
    for i, m in enumerate(b.meta):
        n = int(b.mask[i].sum())
        assert (int(b.tokens[i, n - 1]) == stop) != m["truncated"]
    assert all(c <= 4 for c in counts.tolist())
    for g, c in enumerate(counts.tolist()):
        rows = (b.group_id == g).nonzero().squeeze(1)
        if (b.mask[rows].sum(1) > 3).any():  # some branch lived past the fork
            assert c == 4


def test_entropy_allocation_branches_where_the_policy_is_unsure():
    counts = _allocate(6, 3, torch.tensor([0.1, 2.0, 1.0]))
    assert counts.tolist() == [1, 3, 2]
    assert _allocate(2, 3).tolist() == [1, 1, 1]  # never fewer than one child
    torch.manual_seed(0)
    uniform = _allocate(7, 3)
    assert sorted(uniform.tolist()) == [2, 2, 3]


def test_recipe_checks_the_tree():
    """The tree's rules are checked when the recipe loads; the run plan holds its shape."""
    from perceptrl.trainer.config import ConfigError
    from perceptrl.vlm.run_plan import resolve
    from perceptrl.wiring import load_config

    def tree(*o):
        return resolve(load_config(None, ["side=vlm", *o])).tree

    assert tree() is None
    assert tree("rollout.tree.branches=[2,2]", "rollout.group_size=4") == TreeShape((2, 2), 16)
    with pytest.raises(ConfigError, match="rollout.group_size=4"):
        tree("rollout.tree.branches=[2,2]", "rollout.group_size=8")
    with pytest.raises(ConfigError, match="rollout.sampler=fork"):
        tree("rollout.tree.branches=[4]", "rollout.sampler=generate")
    vllm = ("rollout.engine=vllm", "rollout.tree.branches=[2,2]", "rollout.group_size=4")
    assert tree(*vllm) == TreeShape((2, 2), 16)
    with pytest.raises(ConfigError, match="allocate=uniform"):
        tree(*vllm, "rollout.tree.allocate=entropy")
    with pytest.raises(ConfigError, match="nothing of rollout.max_new_tokens"):
        tree("rollout.tree.branches=[2,2]", "rollout.group_size=4", "rollout.max_new_tokens=16")


def test_shared_segment_forward_equals_one_forward_per_leaf(tiny_dirs, samples):
    """Qwen2.5-VL: the tree forward (prompts once, each depth's distinct segments once on their
    parents' keys/values) gives the log-probs and gradients of a plain forward per leaf, on a
    tree where some branches stopped early; and it runs fewer completion tokens."""
    from perceptrl.vlm.policy import tree_levels

    pol = VLMPolicy.from_pretrained(tiny_dirs["qwen2_5_vl"])
    with stop_bias(pol, 2.5):
        b = sample(pol, samples[:3], TreeShape((2, 2, 2), 4), max_new=16, seed=5)
        levels = tree_levels(b)
        assert levels is not None and len(levels) == 3
        assert [len(lv.rows) for lv in levels][0] == 6  # two first segments per prompt
        fed = []
        handle = pol.model.register_forward_pre_hook(
            lambda m, a, k: fed.append(k["input_ids"].numel()), with_kwargs=True
        )
        grads = {}
        for share in (True, False):
            pol.share_prefix = share
            pol.model.zero_grad()
            ev = pol.evaluate(b)
            (ev.logp * b.mask).sum().backward()
            grads[share] = [p.grad.clone() for p in pol.model.parameters() if p.grad is not None]
            if share:
                tree_logp, tree_fed, tree_calls = ev.logp.detach(), sum(fed), len(fed)
        handle.remove()
        pol.share_prefix = True
    plain = ev.logp.detach()
    torch.testing.assert_close(tree_logp * b.mask, plain * b.mask, atol=1e-5, rtol=0)
    for g1, g2 in zip(grads[True], grads[False]):
        torch.testing.assert_close(g1, g2, atol=1e-4, rtol=1e-3)
    assert tree_calls == 1 + len(levels)  # the prompts, then one pass per depth
    assert tree_fed < sum(fed) - tree_fed  # fewer tokens than one forward per leaf
    assert sampled_tokens(b)[0] < b.mask.sum()  # some segments were shared
