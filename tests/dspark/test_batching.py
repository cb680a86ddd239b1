"""Collation: padding, and cropping that keeps the answer."""

import torch

from dspark.data.batching import collate
from dspark.data.shards import ShardSequence


def seq(seq_id: str, t: int, answer: int) -> ShardSequence:
    ids = torch.arange(t)
    hs = torch.arange(t - 1, dtype=torch.float32)[:, None, None].expand(t - 1, 3, 2).clone()
    hs[:, 2] += 1000  # the final-state layer
    return ShardSequence(seq_id, ids, torch.arange(t) >= t - answer, hs)


def test_pads_to_the_longest_and_splits_context_from_final_states():
    b = collate([seq("a", 6, 2), seq("b", 4, 1)], context_index=[0, 1], final_index=2, max_len=100)
    assert b.input_ids.shape == (2, 6) and b.lengths.tolist() == [6, 4]
    assert b.input_ids[1].tolist() == [0, 1, 2, 3, 0, 0] and b.loss_mask[1].tolist() == [
        False,
        False,
        False,
        True,
        False,
        False,
    ]
    assert b.context_states.shape == (2, 5, 4) and b.final_states.shape == (2, 5, 2)
    assert b.context_states[0, :, 0].tolist() == [0, 1, 2, 3, 4] and b.final_states[0, :, 0].tolist() == [
        1000,
        1001,
        1002,
        1003,
        1004,
    ]
    assert b.context_states[1, 3:].abs().sum() == 0  # padding
    assert b.num_tokens == 10


def test_crop_keeps_the_end_where_the_answer_is():
    b = collate([seq("long", 10, 3)], context_index=[0], final_index=2, max_len=4)
    assert b.input_ids[0].tolist() == [6, 7, 8, 9]
    assert b.loss_mask[0].tolist() == [False, True, True, True]  # the whole answer survives
    # the state of token 6 (row 6) lines up with token 6, and so on
    assert b.context_states[0, :, 0].tolist() == [6, 7, 8] and b.final_states[0, :, 0].tolist() == [1006, 1007, 1008]
