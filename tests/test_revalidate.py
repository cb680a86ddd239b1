"""benchmarks/revalidate.py: the held-out prompts are the bundled ones after the demo's, none of the
demo's, and a dataset without shards is named."""

import pytest

from benchmarks import revalidate as rv
from data_tools.prompts import bundled_conversations, read_conversations


def test_heldout_prompts_follow_the_first_n_distinct_and_read_back_as_a_prompt_file(tmp_path):
    out = tmp_path / "held.jsonl"
    assert rv.heldout_prompts(out, skip=20, count=5) == 5
    distinct: list[str] = []
    for c in bundled_conversations():
        if c.seq_id not in distinct:
            distinct.append(c.seq_id)
        if len(distinct) == 25:
            break
    got = [c.seq_id for c in read_conversations(out)]
    assert got == distinct[20:25]  # the same conversations, so extraction gives them the same ids


def test_a_dataset_without_shards_is_named(tmp_path):
    with pytest.raises(SystemExit, match=f"error: {tmp_path}: no \\*/shard-\\*.parquet"):
        rv.seq_ids(tmp_path)
