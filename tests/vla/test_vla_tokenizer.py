"""Uniform 256-bin action tokenizer: round trip, reserved ids, chunks, non-action tokens."""

from __future__ import annotations

import pytest
import torch

from perceptrl.vla.tokenizer import ActionTokenizer


def test_round_trip_within_half_a_bin():
    tok = ActionTokenizer.last_ids(1024)
    assert tok.first_id == 768 and list(tok.ids)[-1] == 1023
    a = torch.rand(4, 3, 5) * 2 - 1  # [batch, K, D]
    ids = tok.encode(a)
    assert ids.shape == (4, 15) and ids.min() >= 768 and ids.max() <= 1023
    back = tok.decode(ids, dim=5)
    assert back.shape == a.shape
    assert (back - a).abs().max() <= 1 / 256 + 1e-6
    torch.testing.assert_close(tok.decode(tok.encode(back), dim=5), back)  # bin centres are fixed


def test_edges_and_clipping():
    tok = ActionTokenizer(first_id=0)
    ids = tok.encode(torch.tensor([[[-1.0, 1.0, 0.0, -5.0, 5.0]]]))
    assert ids.tolist() == [[0, 255, 128, 0, 255]]


def test_step_major_order():
    tok = ActionTokenizer(first_id=10, bins=4)
    a = torch.tensor([[-0.9, 0.9], [0.1, -0.1]])  # K=2, D=2
    assert tok.encode(a).tolist() == [10, 13, 12, 11]


def test_non_action_tokens_decode_to_nan():
    tok = ActionTokenizer(first_id=100, bins=256)
    x = tok.decode(torch.tensor([99, 100, 355, 356]), dim=2)
    assert torch.isnan(x[0, 0]) and torch.isnan(x[1, 1]) and torch.isfinite(x[0, 1])
    assert tok.is_action(torch.tensor([99, 100, 355, 356])).tolist() == [False, True, True, False]


def test_vocab_too_small():
    with pytest.raises(ValueError, match="cannot hold"):
        ActionTokenizer.last_ids(100)
