"""Re-storing a dataset in another dtype: same sequences, fp8 within its bound, verify passes,
a rerun resumes, a destination made differently is refused."""

import json

import pytest
import torch

from data_tools.convert import convert, main
from data_tools.verify import main as verify
from dspark.core import fp8
from dspark.data.shards import ShardDataset
from dspark.formats.shard_format import Manifest
from tests.dspark.test_shards import make_dataset


@pytest.mark.parametrize("dtype", ["float8_e4m3", "float16"])
def test_conversion_keeps_every_sequence_and_the_states_within_the_formats_bound(tmp_path, dtype):
    src, dst = tmp_path / "src", tmp_path / "dst"
    written = make_dataset(src, dtype="float32", rows=(3, 2), val_rows=2)
    manifest = convert(src, dst, store_dtype=dtype)
    source = Manifest.load(src)
    assert manifest.complete and manifest.dtype == dtype
    assert manifest.scale_granularity == ("token_layer" if dtype.startswith("float8") else "none")
    assert manifest.prompt_set_sha256 == source.prompt_set_sha256 and manifest.layer_ids == source.layer_ids
    assert [(s.split, s.name, s.rows, s.tokens) for s in manifest.shards] == [
        (s.split, s.name, s.rows, s.tokens) for s in source.shards
    ]
    assert sum(s.bytes for s in manifest.shards) < sum(s.bytes for s in source.shards)
    bound = fp8.FORMATS[dtype].row_rel_bound(8) if dtype in fp8.FORMATS else 1e-3
    for split in ("train", "val"):
        a, b = ShardDataset(src, split), ShardDataset(dst, split, states_dtype=torch.float32)
        assert len(a) == len(b) > 0
        for i in range(len(a)):
            x, y = a.read(i), b.read(i)
            assert x.seq_id == y.seq_id and torch.equal(x.input_ids, y.input_ids)
            assert torch.equal(x.loss_mask, y.loss_mask)
            ref = written[x.seq_id][1]
            err = (y.hidden_states.float() - ref).norm(dim=-1) / ref.norm(dim=-1)
            # fp8 is dequantized into the asked dtype; 16/32-bit cells are views in their stored dtype
            assert y.hidden_states.dtype == (torch.float32 if dtype in fp8.FORMATS else torch.float16)
            assert float(err.max()) <= bound
            assert float(err.max()) > 0  # a lossy format really was written
    assert verify([str(dst), "--recompute", "0"]) == 0


def test_a_rerun_keeps_complete_shards_and_rewrites_a_missing_one(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_dataset(src, rows=(2, 2))
    first = convert(src, dst, store_dtype="float8_e4m3")
    keep = dst / "train" / "shard-00000.parquet"
    mtime = keep.stat().st_mtime_ns
    (dst / "train" / "shard-00001.json").unlink()  # as if killed before the shard was complete
    (dst / "train" / ".shard-00001.parquet.tmp-host-1-abc").write_bytes(b"half")
    assert main([str(src), str(dst), "--store-dtype", "float8_e4m3"]) == 0
    assert "1 converted" in capsys.readouterr().out
    again = Manifest.load(dst)
    assert [s.sha256 for s in again.shards] == [s.sha256 for s in first.shards] and again.complete
    assert keep.stat().st_mtime_ns == mtime and not list((dst / "train").glob(".*tmp*"))


def test_bad_input_is_named(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_dataset(src, rows=(2,))
    convert(src, dst, store_dtype="float8_e4m3")
    with pytest.raises(SystemExit) as e:
        main([str(src), str(dst), "--store-dtype", "float8_e5m2"])
    err = capsys.readouterr().err.splitlines()[-1]
    assert e.value.code == 2 and err.startswith("error: ") and str(dst) in err and "float8_e5m2" in err
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["complete"] = False
    (src / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit) as e:
        main([str(src), str(tmp_path / "other"), "--store-dtype", "float8_e4m3"])
    assert e.value.code == 2 and "field 'complete' is false" in capsys.readouterr().err
