from __future__ import annotations

import pytest
import torch

from perceptrl.trainer.batch import GUIDE
from perceptrl.trainer.policy import RolloutSource
from perceptrl.vlm.config import RolloutConfig
from perceptrl.vlm.prompts import ImageLoadError
from perceptrl.vlm.source import VLMRolloutSource, evaluate_accuracy


@pytest.fixture
def policy(policy, with_settings):
    """The session policy sampling at most 10 new tokens (what these sources ask for)."""
    with with_settings(policy, max_new_tokens=10):
        yield policy


def make_source(samples, reward, **kw) -> VLMRolloutSource:
    cfg = RolloutConfig(prompts_per_step=3, group_size=2, max_new_tokens=10)
    return VLMRolloutSource(samples, reward, cfg, seed=kw.pop("seed", 7), **kw)


def test_collect_scores_a_batch_with_metrics(policy, samples, toy_reward):
    src = make_source(samples, toy_reward)
    assert isinstance(src, RolloutSource)
    batch, m = src.collect(policy, step=0)
    assert len(batch) == 6 and batch.rewards.shape == (6,)
    assert batch.group_id.tolist() == [0, 0, 1, 1, 2, 2]
    seen = toy_reward.calls[-1]
    assert all("model_image_size" in s["meta"] and "image_size" in s["meta"] for s in seen)
    expected = torch.tensor(toy_reward(
        [x["completion"] for x in batch.meta], [x["sample"] for x in batch.meta]
    )[0])  # fmt: skip
    torch.testing.assert_close(batch.rewards, expected)
    for key in (
        "reward/mean", "reward/std", "reward/accuracy", "reward/format", "reward/failed",
        "rollout/completion_len_mean", "rollout/completion_len_max", "rollout/clip_ratio",
        "time/rollout", "time/reward", "rollout/skipped_images", "rollout/zero_std_groups",
    ):  # fmt: skip
        assert key in m and isinstance(m[key], float), key
    assert m["rollout/completion_len_max"] <= 10
    assert m["rollout/completion_len_mean"] == pytest.approx(float(batch.mask.sum(1).mean()))


def test_data_order_is_a_seeded_shuffle_over_epochs(samples, toy_reward):
    src = make_source(samples, toy_reward)
    first = [src._next_index() for _ in range(len(samples))]
    second = [src._next_index() for _ in range(len(samples))]
    assert sorted(first) == sorted(second) == list(range(len(samples)))
    assert first != second and src.epoch == 1
    again = make_source(samples, toy_reward)
    assert [again._next_index() for _ in range(len(samples))] == first


def test_resume_continues_the_same_batches(policy, samples, toy_reward):
    ref = make_source(samples, toy_reward)
    ref_batches = [ref.collect(policy, s)[0] for s in range(3)]
    a = make_source(samples, toy_reward)
    a.collect(policy, 0)
    state = a.state_dict()
    torch.manual_seed(12345)  # the global RNG does not matter for sampling
    b = make_source(samples, toy_reward)
    b.load_state_dict(state)
    for step in (1, 2):
        got = b.collect(policy, step)[0]
        assert torch.equal(got.tokens, ref_batches[step].tokens)
        assert [x["sample"]["id"] for x in got.meta] == [
            x["sample"]["id"] for x in ref_batches[step].meta
        ]
    with pytest.raises(ValueError, match="same dataset"):
        make_source(samples[:2], toy_reward).load_state_dict(state)


def test_bad_images_strict_and_lenient(policy, samples, toy_reward, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG garbage")
    data = [dict(s) for s in samples]
    data[2] = {**data[2], "images": [str(broken)]}
    strict = make_source(data, toy_reward)
    with pytest.raises(ImageLoadError, match=r"broken\.png.*sample 's2' \(index 2\)"):
        for step in range(3):
            strict.collect(policy, step)
    lenient = make_source(data, toy_reward, strict=False)
    skipped = 0.0
    for step in range(4):  # two epochs: the broken sample comes up twice
        batch, m = lenient.collect(policy, step)
        assert len(batch) == 6 and "s2" not in {x["sample"]["id"] for x in batch.meta}
        skipped += m["rollout/skipped_images"]
    assert skipped >= 1 and m["rollout/skipped_images_total"] == skipped
    all_bad = [{**s, "images": [str(broken)]} for s in samples]
    with pytest.raises(RuntimeError, match="failed to load"):
        make_source(all_bad, toy_reward, strict=False).collect(policy, 0)


def test_evaluate_accuracy_per_family(policy, samples, toy_reward):
    out = evaluate_accuracy(policy, samples, toy_reward, batch_size=4, max_new_tokens=8)
    assert out["count"] == 6.0 and out["count/count"] == 3.0 and out["count/mcq"] == 3.0
    assert 0.0 <= out["accuracy"] <= 1.5
    assert out["accuracy"] == pytest.approx((out["accuracy/count"] + out["accuracy/mcq"]) / 2)
    assert {"reward/accuracy", "reward/format", "completion_len_mean", "clip_ratio"} <= out.keys()
    again = evaluate_accuracy(policy, samples, toy_reward, batch_size=6, max_new_tokens=8)
    assert again == out  # greedy decoding does not depend on batching


def test_with_the_composite_reward(policy, samples):
    """The real reward package scores a collected batch; its error counts become metrics."""
    from perceptrl.rewards import build_reward

    reward = build_reward({"format": 0.5, "accuracy": 1.0})
    batch, m = make_source(samples, reward).collect(policy, 0)
    assert batch.rewards.shape == (6,) and torch.isfinite(batch.rewards).all()
    assert {"reward/format", "reward/accuracy", "reward/errors"} <= m.keys()


def test_grounding_boxes_in_model_coordinates_map_back(policy, samples):
    """meta["model_image_size"] is the contract with the iou reward: a box answered in the
    resized image's coordinates scores 1 against the ground truth in original pixels."""
    from perceptrl.rewards import build_reward

    sample = {**samples[1], "reward": "iou", "answer": "[20, 10, 100, 80]", "family": "ground"}
    (enc,), _ = policy.encode([sample])
    (w, h), (mw, mh) = enc.sample["meta"]["image_size"], enc.sample["meta"]["model_image_size"]
    assert (w, h) == (168, 112)
    box = [20 * mw / w, 10 * mh / h, 100 * mw / w, 80 * mh / h]
    text = "<think>there</think><answer>[" + ", ".join(f"{v:.2f}" for v in box) + "]</answer>"
    totals, comps, _ = build_reward({"accuracy": 1.0})([text], [enc.sample])
    assert totals[0] == pytest.approx(1.0, abs=1e-3)


def test_skips_are_data_errors_and_load_time_skips_are_metrics(
    policy, samples, toy_reward, tmp_path
):
    """Every sample of a step failing to load is a data error (the command's clean exit); the
    counts of samples skipped when the data loaded ride along in every step's metrics."""
    from perceptrl.datasets.loader import DataError

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG garbage")
    all_bad = [{**s, "images": [str(broken)]} for s in samples]
    with pytest.raises(DataError, match="failed to load.*data"):
        make_source(all_bad, toy_reward, strict=False).collect(policy, 0)
    src = make_source(samples, toy_reward, strict=False, data_skipped={"images": 2, "too_long": 0})
    _, m = src.collect(policy, 0)
    assert m["data/skipped_images"] == 2.0 and "data/skipped_too_long" not in m


def test_guide_rows_join_each_group_and_the_metrics_describe_the_samples(
    policy, samples, toy_reward
):
    """``rollout.guide=1``: each group is one sample and the reference trace, adjacent; the
    trace's row holds its tokens and the stop token (all in the loss), is rewarded like a
    sample, and stays out of the policy's own metrics."""
    cfg = RolloutConfig(prompts_per_step=3, group_size=2, max_new_tokens=10, guide=1)
    trace = lambda s: f"<answer>{s['answer']}</answer>"  # noqa: E731
    src = VLMRolloutSource(samples, toy_reward, cfg, seed=7, guide=trace)
    batch, m = src.collect(policy, step=0)
    assert len(batch) == 6 and batch.group_id.tolist() == [0, 0, 1, 1, 2, 2]
    guide = (batch.origin == GUIDE).nonzero().squeeze(1).tolist()
    assert guide == [1, 3, 5]
    tok = policy.processor.tokenizer
    for i in guide:
        ids = batch.tokens[i][batch.mask[i] > 0].tolist()
        assert tok.decode(ids[:-1]) == trace(batch.meta[i]["sample"])
        assert ids[-1] == policy.stop_ids[0]
        assert batch.rewards[i] == 1.5  # the answer and the format
        assert batch.meta[i]["sample"]["id"] == batch.meta[i - 1]["sample"]["id"]
    assert m["rollout/guide_rows"] == 3.0 and m["reward/guide_mean"] == 1.5
    sampled = [float(batch.rewards[i]) for i in (0, 2, 4)]
    assert m["reward/sampled_mean"] == pytest.approx(sum(sampled) / 3)
