import torch

from perceptrl.trainer.batch import RolloutBatch
from perceptrl.trainer.segments import POLICY, Segments


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


def _shared_batch(G=3):
    """2 prompts x G rows; each prompt's tensors stored once."""
    pix = [torch.randn(4, 3), torch.randn(6, 3)]
    index = torch.arange(2).repeat_interleave(G)
    return RolloutBatch(
        tokens=torch.zeros(2 * G, 2, dtype=torch.long), mask=torch.ones(2 * G, 2),
        group_id=index.clone(), prompts={"pixel_values": pix, "prompt_ids": [torch.ones(5), None]},
        prompt_index=index,
    )  # fmt: skip


def test_to_moves_each_shared_prompt_once():
    """A move that really copies (to the meta device) keeps one copy per prompt, shared by its
    rows, instead of one copy per row."""
    moved = _shared_batch().to("meta")
    assert moved.num_prompts() == 2 and moved.prompts["prompt_ids"][1] is None
    rows = moved.row_prompts()["pixel_values"]
    assert rows[0].device.type == "meta" and rows[0] is rows[1] is rows[2]
    assert rows[3] is rows[5] and rows[0] is not rows[3]


def test_select_and_concat_keep_the_prompts_rows_use():
    b = _shared_batch()
    part = b.select([4, 1])  # one row of each prompt, in reverse order
    assert part.num_prompts() == 2 and part.prompt_index.tolist() == [1, 0]
    assert part.row_prompts()["pixel_values"][0] is b.prompts["pixel_values"][1]
    one = b.select([3, 5])
    assert one.num_prompts() == 1 and one.prompt_index.tolist() == [0, 0]
    both = RolloutBatch.concat([one, b.select([0])])
    assert both.prompt_index.tolist() == [0, 0, 1] and both.num_prompts() == 2
    assert both.prompts["pixel_values"][1] is b.prompts["pixel_values"][0]


def test_tree_fields_survive_select_and_concat():
    """Dynamic sampling selects groups and concatenates refills: the segment table keeps the
    selected rows' segments (renumbered; padding none) and step rewards pad with 0, so the tree
    estimators read the same trees."""
    a = _batch(B=4, T=3)
    ids = torch.tensor([[1, 1, 3], [1, 1, 4], [2, 2, 5], [2, 2, 6]])
    a.segments = Segments.from_tokens(ids, torch.full((4, 3), POLICY), a.group_id, True)
    a.step_rewards = torch.ones(4, 3)
    b = _batch(B=2, T=5)
    ids = torch.tensor([[1, 2, 2, 2, 2], [1, 3, 3, 3, 0]])
    kind = torch.where(ids > 0, POLICY, 0)
    b.segments = Segments.from_tokens(ids, kind, b.group_id, True)
    b.step_rewards = torch.zeros(2, 5)
    both = RolloutBatch.concat([a.select([2, 3]), b])
    assert both.tree_ids().tolist() == [
        [1, 1, 2, 0, 0], [1, 1, 3, 0, 0], [4, 5, 5, 5, 5], [4, 6, 6, 6, 0]
    ]  # fmt: skip
    assert both.step_rewards.shape == (4, 5) and both.step_rewards[:2, 3:].abs().sum() == 0
