"""The segment table (``trainer/segments.py``): built from per-token ids, kept by select and
concat, read by depth, kind and path."""

from __future__ import annotations

import torch

from perceptrl.trainer.segments import OBSERVATION, POLICY, Segments

P, OB = POLICY, OBSERVATION


def tree() -> Segments:
    """Two groups: a [2] tree of 2-token segments under a shared 2-token segment (rows 0, 1),
    and a row of its own that stopped after 3 tokens (row 2)."""
    ids = torch.tensor([[1, 1, 2, 2], [1, 1, 3, 3], [1, 1, 1, 0]])
    kind = torch.tensor([[P, P, P, P], [P, P, P, P], [P, P, P, 0]])
    return Segments.from_tokens(ids, kind, torch.tensor([0, 0, 1]), branches=True)


def test_a_tree_is_its_shared_segments_and_their_children():
    s = tree()
    assert s.node.tolist() == [[0, 0, 1, 1], [0, 0, 2, 2], [3, 3, 3, -1]]
    assert s.parent.tolist() == [-1, 0, 0, -1] and s.depth().tolist() == [0, 1, 1, 0]
    assert s.start.tolist() == [0, 2, 2, 0] and s.length.tolist() == [2, 2, 2, 3]
    assert s.holder.tolist() == [0, 0, 1, 2]
    assert s.decoded() == 9  # the shared segment once: 2 + 2 + 2 + 3, against 11 leaf tokens
    assert s.token_ids().tolist() == [[1, 1, 2, 2], [1, 1, 3, 3], [4, 4, 4, 0]]


def test_the_same_id_in_two_groups_is_two_segments():
    ids = torch.tensor([[1, 1], [1, 1]])
    kind = torch.full((2, 2), P)
    assert Segments.from_tokens(ids, kind, torch.tensor([0, 0])).node.tolist() == [[0, 0]] * 2
    apart = Segments.from_tokens(ids, kind, torch.tensor([0, 1]))
    assert apart.node.tolist() == [[0, 0], [1, 1]]


def test_an_episode_alternates_policy_and_observation_segments():
    kind = torch.tensor([[P, P, OB, OB, OB, P, 0], [P, OB, P, 0, 0, 0, 0]])
    s = Segments.from_tokens(torch.zeros_like(kind), kind, torch.tensor([0, 0]))
    assert s.node.tolist() == [[0, 0, 1, 1, 1, 2, -1], [3, 4, 5, -1, -1, -1, -1]]
    assert s.kind.tolist() == [P, OB, P, P, OB, P]
    assert s.parent.tolist() == [-1, 0, 1, -1, 3, 4] and s.depth().tolist() == [0, 1, 2, 0, 1, 2]
    assert s.mask(OBSERVATION).tolist()[0] == [0, 0, 1, 1, 1, 0, 0]
    assert s.attention().sum(1).tolist() == [6, 3]
    assert s.decoded() == 5 and s.token_ids()[0].tolist() == [1, 1, 0, 0, 0, 3, 0]


def test_flat_rows_are_one_policy_segment_each():
    s = Segments.flat(torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1]]))
    assert s.node.tolist() == [[0, 0, -1], [1, -1, -1], [2, 2, 2]]
    assert s.parent.tolist() == [-1, -1, -1] and s.kind.tolist() == [P, P, P]
    assert not s.branches


def test_select_keeps_the_segments_of_the_rows_renumbered():
    s = tree().select(torch.tensor([2, 1]))
    assert s.node.tolist() == [[2, 2, 2, -1], [0, 0, 1, 1]]
    assert s.parent.tolist() == [-1, 0, -1] and s.holder.tolist() == [1, 1, 0]
    assert s.length.tolist() == [2, 2, 3] and s.branches


def test_concat_shifts_the_second_table_past_the_first():
    a, b = tree(), Segments.flat(torch.tensor([[1.0, 1, 1, 1, 1]]))
    both = Segments.concat([a, b])
    assert both.node.shape == (4, 5) and both.node[0].tolist() == [0, 0, 1, 1, -1]
    assert both.node[3].tolist() == [4] * 5 and both.holder.tolist() == [0, 0, 1, 2, 3]
    assert both.parent.tolist() == [-1, 0, 0, -1, -1] and both.branches
    again = both.select(torch.tensor([3, 0]))
    assert again.node.tolist() == [[2] * 5, [0, 0, 1, 1, -1]]
