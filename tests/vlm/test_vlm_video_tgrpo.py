"""T-GRPO: the per-group temporal bonus (hand cases, several batch sizes, against a plain loop)
and its place in the VLM rollout source (shuffled rollouts scored, never trained on)."""

from __future__ import annotations

import json

import pytest
import torch

from perceptrl.datasets.video import generate
from perceptrl.vlm.config import RolloutConfig, VideoConfig
from perceptrl.vlm.source import VLMRolloutSource, tgrpo_bonus, tgrpo_correct_key

A = 0.3


def _t(xs):
    return torch.tensor(xs)


def test_one_group_hand_cases():
    # ordered 3/4 correct, shuffled 1/4: 0.75 >= 0.25 -> the 3 correct rollouts get alpha
    b, m = tgrpo_bonus(_t([1, 1, 0, 1]), _t([0] * 4), _t([0, 1, 0, 0]), _t([0] * 4), A, 1.0)
    assert b.tolist() == pytest.approx([A, A, 0, A])
    assert m["tgrpo_bonus_rate"] == 1.0 and m["tgrpo_groups"] == 1.0
    assert m["tgrpo_acc_ordered"] == 0.75 and m["tgrpo_acc_shuffled"] == 0.25
    # shuffled does better: no bonus
    b, m = tgrpo_bonus(_t([1, 0, 0, 0]), _t([0] * 4), _t([1, 1, 0, 0]), _t([0] * 4), A, 1.0)
    assert b.tolist() == [0, 0, 0, 0] and m["tgrpo_bonus_rate"] == 0.0
    # equal accuracy: mu = 1 grants it (p >= mu * p~), mu = 1.2 does not
    args = (_t([1, 0]), _t([0, 0]), _t([0, 1]), _t([0, 0]))
    assert tgrpo_bonus(*args, A, 1.0)[0].tolist() == pytest.approx([A, 0])
    assert tgrpo_bonus(*args, A, 1.2)[0].tolist() == [0, 0]
    # mu < 1 tolerates a worse ordered accuracy: 0.5 >= 0.8 * 0.6
    b, _ = tgrpo_bonus(_t([1, 0]), _t([0, 0]), _t([1, 1, 1, 0, 0]), _t([0] * 5), A, 0.8)
    assert b.tolist() == pytest.approx([A, 0])


def test_groups_are_judged_separately_and_image_groups_get_nothing():
    # group 5: ordered 2/2, shuffled 0/2 -> bonus; group 9: ordered 1/2, shuffled 2/2 -> none;
    # group 2 has no shuffled rollouts (an image prompt) -> none, and is not counted
    correct = _t([1, 1, 1, 0, 1, 1])
    gid = _t([5, 5, 9, 9, 2, 2])
    b, m = tgrpo_bonus(correct, gid, _t([0, 0, 1, 1]), _t([5, 5, 9, 9]), A, 1.0)
    assert b.tolist() == pytest.approx([A, A, 0, 0, 0, 0])
    assert m["tgrpo_groups"] == 2.0 and m["tgrpo_bonus_rate"] == 0.5
    assert m["tgrpo_acc_ordered"] == 0.75 and m["tgrpo_acc_shuffled"] == 0.5


def test_all_wrong_group_earns_no_bonus_and_no_rate():
    b, m = tgrpo_bonus(_t([0, 0]), _t([0, 0]), _t([0, 0]), _t([0, 0]), A, 1.0)
    assert b.tolist() == [0, 0] and m["tgrpo_bonus_rate"] == 0.0


def _reference(correct, gid, cs, gs, alpha, mu):
    """Plain loop over groups (what Video-R1 computes for one group per device)."""
    out = [0.0] * len(correct)
    for g in set(gid):
        rows = [i for i, x in enumerate(gid) if x == g]
        srows = [i for i, x in enumerate(gs) if x == g]
        if not srows:
            continue
        p = sum(correct[i] for i in rows) / len(rows)
        ps = sum(cs[i] for i in srows) / len(srows)
        if p >= mu * ps:
            for i in rows:
                out[i] = alpha if correct[i] else 0.0
    return out


@pytest.mark.parametrize("groups, G, S", [(1, 8, 8), (2, 4, 4), (3, 8, 2), (16, 8, 8), (5, 1, 3)])
def test_matches_a_plain_loop_at_any_batch_size(groups, G, S):
    gen = torch.Generator().manual_seed(groups * 100 + G)
    for _ in range(20):
        gid = torch.randperm(groups, generator=gen).repeat_interleave(G) * 3  # arbitrary ids
        correct = torch.randint(0, 2, (len(gid),), generator=gen)
        video = torch.rand(groups, generator=gen) < 0.8  # some groups are image prompts
        gs = torch.cat(
            [torch.full((S,), int(g) * 3) for g in range(groups) if video[g]] or [_t([])]
        )
        cs = torch.randint(0, 2, (len(gs),), generator=gen)
        mu = float(torch.rand(1, generator=gen)) + 0.5
        b, _ = tgrpo_bonus(correct, gid, cs, gs.long(), A, mu)
        ref = _reference(correct.tolist(), gid.tolist(), cs.tolist(), gs.tolist(), A, mu)
        assert b.tolist() == pytest.approx(ref)


def test_correctness_component():
    assert tgrpo_correct_key({"format": 0.2, "accuracy": 1.0}) == "accuracy"
    assert tgrpo_correct_key({"format": 0.2, "mcq": 1.0}) == "mcq"
    with pytest.raises(ValueError, match="one correctness reward"):
        tgrpo_correct_key({"format": 0.2, "mcq": 1.0, "tiou": 1.0})


# ---- in the rollout source -------------------------------------------------------------------


@pytest.fixture(scope="module")
def order_samples(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("order_clips")
    path = generate(root, {"train": 4}, families=["temporal_order"], seed=3)["train"]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{**r, "videos": [str(root / v) for v in r["videos"]]} for r in rows]


def _reward(shuffled_correct: float):
    """Ordered rollouts are all correct; shuffled ones (meta has frame_order) score as given."""

    def reward(completions, samples, ctx=None):
        acc = [shuffled_correct if "frame_order" in s["meta"] else 1.0 for s in samples]
        reward.seen.append(samples)
        return list(acc), {"accuracy": acc}, {}

    reward.seen = []
    return reward


@pytest.mark.parametrize("mu, shuffled_correct, bonus", [(1.0, 0.0, A), (1.5, 1.0, 0.0)])
def test_source_adds_the_bonus_from_shuffled_rollouts(
    policy, order_samples, mu, shuffled_correct, bonus, with_settings
):
    cfg = RolloutConfig(
        prompts_per_step=2, group_size=3, max_new_tokens=6, tgrpo_alpha=A, tgrpo_mu=mu,
        tgrpo_shuffled=2, reward={"format": 0.2, "accuracy": 1.0},
    )  # fmt: skip
    reward = _reward(shuffled_correct)
    src = VLMRolloutSource(order_samples, reward, cfg, seed=0)
    with with_settings(policy, video=VideoConfig(max_frames=8), max_new_tokens=6):
        batch, m = src.collect(policy, step=0)
    assert len(batch) == 6  # the trained batch holds only the ordered rollouts
    assert all("frame_order" not in x["sample"]["meta"] for x in batch.meta)
    assert batch.rewards.tolist() == pytest.approx([1.0 + bonus] * 6)
    ordered, shuffled = reward.seen
    assert len(ordered) == 6 and len(shuffled) == 4  # 2 video prompts x tgrpo_shuffled
    assert [s["id"] for s in shuffled] == [ordered[0]["id"]] * 2 + [ordered[3]["id"]] * 2
    assert m["reward/tgrpo_bonus_rate"] == (1.0 if bonus else 0.0)
    assert m["reward/tgrpo_acc_ordered"] == 1.0
    assert m["reward/tgrpo_acc_shuffled"] == shuffled_correct
    assert m["reward/tgrpo_shuffled_samples"] == 4.0


def test_source_without_video_or_alpha_samples_no_shuffled_rollouts(
    policy, order_samples, samples, with_settings
):
    cfg = RolloutConfig(prompts_per_step=2, group_size=2, tgrpo_alpha=A)
    reward = _reward(0.0)
    src = VLMRolloutSource(samples, reward, cfg)  # image prompts: T-GRPO has nothing to shuffle
    with with_settings(policy, max_new_tokens=4):
        _, m = src.collect(policy, step=0)
        assert len(reward.seen) == 1 and "reward/tgrpo_bonus_rate" not in m
        off = VLMRolloutSource(
            order_samples, reward, RolloutConfig(prompts_per_step=1, group_size=2)
        )
        off.collect(policy, step=0)  # alpha 0 (the default): plain GRPO
    assert len(reward.seen) == 2
