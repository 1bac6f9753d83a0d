import torch

from perceptrl.trainer.batch import RolloutBatch


def _batch(B=6, T=5):
    return RolloutBatch(
        tokens=torch.arange(B * T).view(B, T),
        mask=torch.ones(B, T),
        group_id=torch.arange(B) // 2,
        rewards=torch.arange(B).float(),
        inputs={
            "pixels": [torch.full((i + 1, 3), float(i)) for i in range(B)],
            "ids": torch.arange(B) * 10,
        },
        meta=[{"i": i} for i in range(B)],
    )


def test_select_slices_every_batch_first_field():
    b = _batch().select([4, 1])
    assert b.tokens[:, 0].tolist() == [20, 5]
    assert b.rewards.tolist() == [4.0, 1.0] and b.group_id.tolist() == [2, 0]
    assert [p.shape[0] for p in b.inputs["pixels"]] == [5, 2]
    assert b.inputs["ids"].tolist() == [40, 10] and b.meta == [{"i": 4}, {"i": 1}]
    assert b.logp_old is None


def test_split_then_concat_round_trips():
    b = _batch()
    parts = b.split(4)
    assert [len(p) for p in parts] == [4, 2]
    again = RolloutBatch.concat(parts)
    assert torch.equal(again.tokens, b.tokens) and again.meta == b.meta
    assert all(torch.equal(x, y) for x, y in zip(again.inputs["pixels"], b.inputs["pixels"]))


def test_concat_right_pads_to_the_longest_T():
    a, b = _batch(2, 3), _batch(2, 5)
    c = RolloutBatch.concat([a, b])
    assert c.tokens.shape == (4, 5) and c.mask[:2, 3:].sum() == 0 and c.mask[2:].sum() == 10


def test_to_moves_tensors_and_keeps_meta():
    b = _batch().to("cpu")
    assert b.meta[0] == {"i": 0} and b.inputs["pixels"][0].device.type == "cpu"
