"""data.mode=colocated: the target inside the trainer computes the states from token ids. Its states
equal the stored ones, and a run fed colocated equals a run fed shards of the same states."""

from collections import Counter
from pathlib import Path

import pytest
import torch

from dspark.config import ConfigError
from dspark.core.layer_ids import reference_hidden_states
from dspark.data.colocated import ColocatedDataset, ColocatedTarget
from dspark.data.shards import ShardDataset
from dspark.formats.shard_format import DatasetError, Manifest
from dspark.recipe import build_trainer
from dspark.target import load_target_heads
from tests.toy import TINY_LAYERS, overrides, two_rank_train

CAPTURED = TINY_LAYERS + [4]


def token_id_copy(data: Path, out: Path) -> Path:
    """``data``'s sequences as token-id shards: the same rows with no states (``layer_ids: []``)."""
    from data_tools.shard_writer import finalize, write_shard

    m = Manifest.load(data)
    m.layer_ids, m.shards, m.complete = [], [], False
    m.save(out)
    units = []
    for split in ("train", "val"):
        ds = ShardDataset(data, split)
        rows = [
            {
                "seq_id": s.seq_id,
                "num_tokens": len(s.input_ids),
                "input_ids": s.input_ids.tolist(),
                "loss_mask": s.loss_mask.int().tolist(),
                "hidden_states": b"",
            }
            for s in (ds[i] for i in range(len(ds)))
        ]
        write_shard(rows, out, split, 0, "zstd", Counter())
        units.append((split, 0))
    finalize(out, units)
    return out


def test_states_equal_the_single_sequence_reference_batched_padded_and_split(tiny_target_and_shards):
    from transformers import AutoModelForCausalLM

    target, data = tiny_target_and_shards
    ds = ShardDataset(data, "train")
    ids = [ds[i].input_ids[: 20 + i] for i in range(5)]  # different lengths: padding inside a call
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    refs = [reference_hidden_states(model, s[:-1], CAPTURED) for s in ids]
    for per_call in (10**6, 40):  # one call for all, or calls of at most 40 tokens (one or two sequences)
        got = ColocatedTarget(target, CAPTURED, tokens_per_call=per_call).states(ids)
        assert [tuple(g.shape) for g in got] == [(len(s) - 1, 3, 64) for s in ids]
        for g, r in zip(got, refs):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    # the stored shard rows (written from the same reference) read back alike through the dataset
    col = ColocatedDataset(ds, ColocatedTarget(target, CAPTURED))
    for got, stored in zip(col.many([3, 0, 7]), ds.many([3, 0, 7])):
        assert got.seq_id == stored.seq_id and torch.equal(got.input_ids, stored.input_ids)
        torch.testing.assert_close(got.hidden_states, stored.hidden_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("token_ids", [False, True], ids=["hidden-state-shards", "token-id-shards"])
def test_a_colocated_run_equals_the_shard_run(compose_config, tiny_target_and_shards, tmp_path, token_ids):
    target, data = tiny_target_and_shards
    heads = load_target_heads(target)
    extra = ("train.max_steps=4", "train.eval_every=2")
    ref = build_trainer(compose_config(*overrides(target, data, tmp_path / "offline", *extra)), heads)
    ref_state = ref.train()
    source = token_id_copy(data, tmp_path / "tokens") if token_ids else data
    col = build_trainer(
        compose_config(*overrides(target, source, tmp_path / "colocated", *extra, "data.mode=colocated")), heads
    )
    assert isinstance(col.batches.ds, ColocatedDataset) and isinstance(col.parts.val, ColocatedDataset)
    state = col.train()
    assert [h["seq_ids"] for h in state.history] == [h["seq_ids"] for h in ref_state.history]
    assert state.data_digest == ref_state.data_digest
    assert [h["loss"] for h in state.history] == pytest.approx([h["loss"] for h in ref_state.history], rel=1e-4)
    assert len(state.validations) == len(ref_state.validations) == 2
    for a, b in zip(state.validations, ref_state.validations):
        assert a["tau"] == pytest.approx(b["tau"], rel=1e-4) and a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    for (n, p), q in zip(col.model.named_parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=n)


def test_token_id_shards_are_refused_offline_and_topk_is_refused_colocated(
    compose_config, tiny_target_and_shards, tmp_path
):
    target, data = tiny_target_and_shards
    tokens = token_id_copy(data, tmp_path / "tokens")
    with pytest.raises(DatasetError, match=r"field 'layer_ids' is \[\] \(token-id shards.*data.mode=colocated"):
        build_trainer(compose_config(*overrides(target, tokens, tmp_path)), load_target_heads(target))
    with pytest.raises(ConfigError, match=r"train.target_topk=8: expected 0 with data.mode=colocated"):
        compose_config(*overrides(target, tokens, tmp_path, "data.mode=colocated", "train.target_topk=8"))
    with pytest.raises(ConfigError, match=r"data.engine='transformers': writes token-id shards .*data.mode=colocated"):
        compose_config(*overrides(target, tokens, tmp_path, "data.engine=transformers"))


@pytest.mark.slow
def test_two_ranks_each_hold_their_own_target(tiny_target_and_shards, tmp_path):
    target, data = tiny_target_and_shards
    log = two_rank_train(target, data, tmp_path, 2, "data.mode=colocated")
    assert log.count("colocated: the target") == 2  # one copy per rank, each logging its own


def test_a_missing_target_layer_is_named(tiny_target_and_shards):
    target, _ = tiny_target_and_shards
    with pytest.raises(ValueError, match=r"layer ids \[5\] outside \[0, 4\]"):
        ColocatedTarget(target, [1, 5])
