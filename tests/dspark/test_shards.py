"""The shard reader on shards written in the declared schema."""

import json
import os
import shutil
from collections import Counter

import pytest
import torch

from data_tools.shard_writer import finalize, write_shard
from dspark.core import fp8
from dspark.data.batching import collate
from dspark.data.shards import ShardDataset, open_dataset, require_dataset
from dspark.formats.shard_format import DatasetError, Manifest
from dspark.formats.shard_rows import encode_hidden_states
from tests.toy import toy_manifest


def make_dataset(directory, *, dtype="float32", rows=(3, 2), n_layers=3, hidden=8, val_rows=1, nan_in=None):
    """Random sequences written through the extractor's own encoder, writer and finaliser;
    returns seq_id -> (ids, states as stored: fp32 originals for fp8)."""
    gen = torch.Generator().manual_seed(0)
    toy_manifest(layer_ids=list(range(n_layers - 1)) + [4], hidden_size=hidden, dtype=dtype).save(directory)
    store = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
    written, units = {}, []
    for split, counts in (("train", rows), ("val", (val_rows,))):
        for k, n in enumerate(counts):
            shard_rows = []
            for r in range(n):
                t = int(torch.randint(3, 12, (1,), generator=gen))
                hs = torch.randn(t - 1, n_layers, hidden, generator=gen).to(store)
                if nan_in == f"{split}{k}-{r}":  # what a target that overflowed would have written
                    hs[-1, 1, 2] = float("nan")
                ids = torch.randint(0, 100, (t,), generator=gen).tolist()
                row = {
                    "seq_id": f"{split}{k}-{r}",
                    "num_tokens": t,
                    "input_ids": ids,
                    "loss_mask": [0] * 2 + [1] * (t - 2),
                    "hidden_states": encode_hidden_states(hs, dtype),
                }
                shard_rows.append(row)
                written[row["seq_id"]] = (ids, hs)
            write_shard(shard_rows, directory, split, k, "zstd", Counter())
            units.append((split, k))
    finalize(directory, units)
    return written


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_random_access_round_trips(tmp_path, dtype):
    written = make_dataset(tmp_path, dtype=dtype)
    ds = ShardDataset(tmp_path, "train")
    assert len(ds) == 5 and len(ShardDataset(tmp_path, "val")) == 1
    for i in reversed(range(len(ds))):
        seq = ds[i]
        ids, hs = written[seq.seq_id]
        assert seq.input_ids.tolist() == ids and seq.input_ids.dtype == torch.int64
        assert seq.loss_mask.dtype == torch.bool and int(seq.loss_mask.sum()) == len(ids) - 2
        assert seq.hidden_states.dtype == hs.dtype and torch.equal(seq.hidden_states, hs)
    with pytest.raises(IndexError, match="sequence 5 out of range for 5"):
        ds[5]


@pytest.mark.parametrize("dtype", ["float8_e4m3", "float8_e5m2"])
@pytest.mark.parametrize("states_dtype", [torch.float32, torch.bfloat16])
def test_fp8_shards_read_back_dequantized_in_the_dtype_asked_for(tmp_path, dtype, states_dtype):
    written = make_dataset(tmp_path, dtype=dtype, hidden=16)
    manifest = Manifest.load(tmp_path)
    assert (manifest.dtype, manifest.scale_granularity, manifest.bytes_per_token) == (dtype, "token_layer", 3 * 20)
    ds = ShardDataset(tmp_path, "train", states_dtype=states_dtype)
    bound = fp8.FORMATS[dtype].row_rel_bound(16) + (2**-8 if states_dtype == torch.bfloat16 else 0)
    for i in range(len(ds)):
        seq = ds[i]
        _, hs = written[seq.seq_id]
        assert seq.hidden_states.dtype == states_dtype and seq.hidden_states.shape == hs.shape
        rel = (seq.hidden_states.float() - hs).norm(dim=-1) / hs.norm(dim=-1)
        assert rel.max() <= bound


@pytest.mark.parametrize("dtype", ["float8_e4m3", "float8_e5m2"])
@pytest.mark.parametrize("train_dtype", [torch.float32, torch.bfloat16])
def test_fp8_kept_to_the_device_gives_the_host_readers_batches_bit_for_bit(tmp_path, dtype, train_dtype):
    """The trainer's reader keeps fp8 as stored (values and scales, zero-copy views) and the batch
    dequantizes where it lands: the numbers equal dequantizing on the host, padding included
    (sequences of 3 to 11 tokens, one cropped to a window of 6)."""
    make_dataset(tmp_path, dtype=dtype, rows=(5, 4), hidden=16)
    host = ShardDataset(tmp_path, "train", states_dtype=train_dtype)
    kept = ShardDataset(tmp_path, "train", states_dtype=train_dtype, keep_fp8=True)
    seq = kept[0]
    assert seq.hidden_states.dtype == fp8.FORMATS[dtype].torch_dtype and seq.scales.dtype == torch.float32
    assert (
        seq.scales.shape == seq.hidden_states.shape[:2]
        and kept[0].hidden_states.data_ptr() == seq.hidden_states.data_ptr()
    )
    assert torch.equal(seq.states(slice(None), 2), ShardDataset(tmp_path, "train")[0].hidden_states[:, 2])  # fp32
    kw = dict(context_index=[0, 1], final_index=2)
    for idx, max_len in (([0, 1, 2, 3], 64), ([4, 5, 6, 7, 8], 6)):
        a = collate([host[i] for i in idx], **kw, max_len=max_len)
        b = collate([kept[i] for i in idx], **kw, max_len=max_len)
        assert a.context_scales is None and b.context_states.dtype == fp8.FORMATS[dtype].torch_dtype
        assert b.context_scales.shape == (len(idx), b.input_ids.shape[1] - 1, 2)
        a, b = a.to("cpu", train_dtype), b.to("cpu", train_dtype)
        for name in ("context_states", "final_states"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype == train_dtype and torch.equal(x, y), name
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.lengths, b.lengths)
        assert b.context_states.abs().sum() > 0


def test_target_topk_reads_fp8_kept_states_like_dequantized_ones(tmp_path):
    from dspark.data.target_topk import sequence_topk

    make_dataset(tmp_path, dtype="float8_e4m3", rows=(3,), hidden=16)
    head = torch.randn(16, 50, generator=torch.Generator().manual_seed(1))
    host, kept = ShardDataset(tmp_path, "train")[1], ShardDataset(tmp_path, "train", keep_fp8=True)[1]
    kw = dict(k=4, rule="answer", target_logits=lambda rows: rows @ head, final_index=2, rows_per_call=3)
    a = sequence_topk(host.loss_mask, host.hidden_states, **kw)
    b = sequence_topk(kept.loss_mask, kept.hidden_states, scales=kept.scales, **kw)
    assert len(a.positions) > 0 and torch.equal(a.positions, b.positions)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.probs, b.probs)


def test_states_are_zero_copy_views_of_the_mapped_file(tmp_path):
    make_dataset(tmp_path)
    ds = ShardDataset(tmp_path)
    a, b = ds[0].hidden_states, ds[0].hidden_states
    assert a.data_ptr() == b.data_ptr()  # same mapped bytes, no per-read copy
    assert (tmp_path / ".arrow_cache" / "train").is_dir()


def test_rank_iterators_partition_each_epoch(tmp_path):
    make_dataset(tmp_path, rows=(4, 4, 3))
    ds = ShardDataset(tmp_path)
    parts = [ds.rank_indices(rank=r, world_size=2, seed=1, epoch=0) for r in range(2)]
    assert len(parts[0]) == len(parts[1]) == 5 and not set(parts[0]) & set(parts[1])
    assert parts != [ds.rank_indices(rank=r, world_size=2, seed=1, epoch=1) for r in range(2)]  # reshuffled per epoch
    assert [s.seq_id for s in ds.iter_rank(rank=1, world_size=2, seed=1, start=3)] == [
        ds[i].seq_id for i in parts[1][3:]
    ]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        ds.rank_indices(rank=2, world_size=2)


def test_open_dataset_checks_layers_and_width(tmp_path):
    make_dataset(tmp_path)
    with pytest.raises(
        ValueError, match=r"manifest.json: field 'layer_ids' is \[0, 1, 4\], the config expects \[1, 2, 4\]"
    ):
        open_dataset(tmp_path, expect_layer_ids=[1, 2, 4])
    with pytest.raises(ValueError, match=r"field 'hidden_size' is 8, the config expects 576"):
        open_dataset(tmp_path, expect_hidden_size=576)


def test_incomplete_dataset_is_refused(tmp_path):
    make_dataset(tmp_path)
    (tmp_path / "train" / "shard-00001.parquet").unlink()
    finalize(tmp_path, [("train", 0), ("train", 1)])
    with pytest.raises(ValueError, match="field 'complete' is false"):
        ShardDataset(tmp_path)


def test_a_truncated_or_missing_shard_names_the_file_and_the_way_out(tmp_path):
    make_dataset(tmp_path)
    shard = tmp_path / "train" / "shard-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:-200])  # a torn copy
    before = shard.read_bytes()
    with pytest.raises(DatasetError) as err:
        ShardDataset(tmp_path)
    assert str(err.value).startswith(f"{shard}: {len(before)} bytes with sha256 ") and str(err.value).endswith(
        f"truncated or altered on disk. Check the dataset: python -m data_tools.verify {tmp_path} --recompute 0; "
        f"re-extract the shard: delete {shard} and run stages=[extract] again with the same settings (complete "
        "shards are kept)"
    )
    assert shard.read_bytes() == before and not list((tmp_path / ".arrow_cache").rglob("shard-00001*"))
    shard.unlink()
    with pytest.raises(DatasetError, match=r"shard-00001.parquet: missing file, listed in manifest.json\. Check"):
        ShardDataset(tmp_path)


def test_bytes_flipped_in_a_shard_of_the_same_size_are_caught_and_never_cached(tmp_path):
    """Issue #37: eight bytes flipped mid-shard trained with rc 0 and poisoned the Arrow cache,
    which kept serving them after the good shard was put back."""
    make_dataset(tmp_path)
    shard = tmp_path / "train" / "shard-00000.parquet"
    good = shard.read_bytes()
    mid = len(good) // 2
    shard.write_bytes(good[:mid] + bytes(b ^ 0xFF for b in good[mid : mid + 8]) + good[mid + 8 :])
    with pytest.raises(DatasetError, match=r"shard-00000.parquet: \d+ bytes with sha256 [0-9a-f]{16}, but manifest"):
        ShardDataset(tmp_path)
    assert not list((tmp_path / ".arrow_cache").rglob("shard-00000*"))  # nothing cached from the bad bytes
    shard.write_bytes(good)
    ds = ShardDataset(tmp_path)
    (cache,) = (tmp_path / ".arrow_cache" / "train").glob("shard-00000-*.arrow")
    assert cache.name.endswith(".verified.arrow") and len(ds) == 5


def test_a_non_finite_state_names_the_shard_row_and_sequence(tmp_path):
    make_dataset(tmp_path, nan_in="train1-1")
    ds = ShardDataset(tmp_path)
    ds.read(0)  # the others read
    with pytest.raises(DatasetError) as err:
        ds.read(4)
    assert str(err.value).startswith(
        f"{tmp_path / 'train' / 'shard-00001.parquet'}: row 1 (sequence train1-1): 1 non-finite hidden-state values "
    ) and "captured layer 1" in str(err.value)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m["shards"][0].update(name="../../../elsewhere/evil"), r"shards\[0\].'name' is '../../../elsewhere"),
        (lambda m: m["shards"][0].update(name="/abs/shard"), r"expected a plain file name inside the dataset"),
        (lambda m: m["shards"][0].update(rows="32"), r"shards\[0\].'rows' is '32', expected an integer"),
        (lambda m: m["shards"][0].update(rows=-1), r"shards\[0\].'rows' is -1, expected an integer >= 0"),
        (lambda m: m["shards"][0].update(split="test"), r"'split' is 'test', expected one of \['train', 'val'\]"),
        (lambda m: m["shards"][0].update(sha256="abc"), r"'sha256' is 'abc', expected 64 lowercase hex digits"),
        (lambda m: m.update(layer_ids=None), r"field 'layer_ids' is None, expected a list"),
        (lambda m: m.update(layer_ids=[0, "1"]), r"field 'layer_ids' is \[0, '1'\], expected a list of integers"),
        (lambda m: m.update(hidden_size="576"), r"field 'hidden_size' is '576', expected an integer"),
        (lambda m: m.update(complete="yes"), r"field 'complete' is 'yes', expected a bool"),
        (lambda m: m["shards"].append(7), r"shards\[3\] is 7, expected an object"),
    ],
    ids=["dotdot", "absolute", "rows-str", "rows-neg", "split", "sha", "layers-null", "layers-str", "width", "bool",
         "entry"],
)  # fmt: skip
def test_a_manifest_is_checked_as_data_field_by_field(tmp_path, change, message):
    make_dataset(tmp_path)
    path = tmp_path / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m))
    with pytest.raises(DatasetError, match=message):
        ShardDataset(tmp_path)
    assert not (tmp_path / ".arrow_cache").exists() and not (tmp_path.parent / "elsewhere").exists()


def test_rows_and_tokens_must_agree_with_the_files_and_links_out_are_refused(tmp_path):
    """Issue #37: rows 0 silently dropped a shard (244 -> 212 sequences)."""
    make_dataset(tmp_path)
    path = tmp_path / "manifest.json"
    good = path.read_text()
    for key, value, says in (("rows", 0, "3 rows, but manifest.json records 0"), ("tokens", 1, "records 1")):
        m = json.loads(good)
        m["shards"][0][key] = value
        path.write_text(json.dumps(m))
        shutil.rmtree(tmp_path / ".arrow_cache", ignore_errors=True)
        with pytest.raises(DatasetError, match=says):
            ShardDataset(tmp_path)
    path.write_text(good)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.parquet"
    shard = tmp_path / "train" / "shard-00000.parquet"
    shard.rename(outside)
    shard.symlink_to(outside)
    shutil.rmtree(tmp_path / ".arrow_cache", ignore_errors=True)
    with pytest.raises(DatasetError, match=r"shard-00000.parquet: a link to .*-outside.parquet, outside the dataset"):
        ShardDataset(tmp_path)


def test_verify_drops_caches_no_verified_shard_produced(tmp_path, capsys):
    from data_tools.verify import main as verify

    make_dataset(tmp_path)
    ShardDataset(tmp_path)
    old = tmp_path / ".arrow_cache" / "train" / "shard-00000-0123456789ab.arrow"  # unverified, as built before
    old.write_bytes(b"poisoned")
    kept = sorted((tmp_path / ".arrow_cache").rglob("*.verified.arrow"))
    assert verify([str(tmp_path), "--recompute", "0"]) == 0
    out = capsys.readouterr().out
    assert (
        "dropped 1 Arrow cache(s) no verified shard of this manifest produced: .arrow_cache/train/shard-00000-0123"
        in out
    )
    assert not old.exists() and sorted((tmp_path / ".arrow_cache").rglob("*.arrow")) == kept and len(kept) == 2


def _zero_middle(path):
    """What issue #48 did to a cache: zeros over its middle, the size kept (zeros are finite)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid - 64 : mid + 64] = bytes(128)
    path.write_bytes(bytes(data))


def test_a_damaged_arrow_cache_is_rebuilt_from_its_shard_with_a_warning(tmp_path, caplog):
    """Issue #48: 20 MiB zeroed inside a built cache changed the val loss, rc 0, verify OK."""
    written = make_dataset(tmp_path)
    ShardDataset(tmp_path)
    (cache,) = (tmp_path / ".arrow_cache" / "train").glob("shard-00000-*.arrow")
    good = cache.read_bytes()
    assert json.loads((cache.parent / (cache.name + ".record.json")).read_text())["bytes"] == len(good)
    for damage in (_zero_middle, lambda p: p.write_bytes(b"not arrow")):
        damage(cache)
        assert cache.read_bytes() != good
        caplog.clear()
        with caplog.at_level("WARNING"):
            ds = ShardDataset(tmp_path)
        assert cache.read_bytes() == good  # rebuilt from the verified shard
        (warning,) = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
        assert warning.startswith(f"{cache}: ") and warning.endswith("rebuilding this Arrow cache from its source")
        for i in range(len(ds)):
            assert torch.equal(ds[i].hidden_states, written[ds[i].seq_id][1])
    caplog.clear()
    with caplog.at_level("WARNING"):
        ShardDataset(tmp_path)  # intact: reused, nothing said
    assert not [r for r in caplog.records if "rebuilding" in r.getMessage()]


def test_a_cache_and_record_copied_from_another_shard_are_rebuilt_and_verify_drops_them(tmp_path, caplog, capsys):
    """Issue #58 item 1: the validation shard's cache and record over train shard 0's names trained
    rc 0 with no warning (val loss 17.97 -> 27.64), and verify said OK: a record vouched for its
    cache's bytes, not for the shard it was built from."""
    from data_tools.verify import main as verify

    written = make_dataset(tmp_path)
    ShardDataset(tmp_path)
    ShardDataset(tmp_path, split="val")
    (cache,) = (tmp_path / ".arrow_cache" / "train").glob("shard-00000-*.arrow")
    (other,) = (tmp_path / ".arrow_cache" / "val").glob("*.arrow")
    good = cache.read_bytes()

    def swap() -> None:
        for suffix in ("", ".record.json"):
            shutil.copyfile(other.parent / (other.name + suffix), cache.parent / (cache.name + suffix))

    swap()
    caplog.clear()
    with caplog.at_level("WARNING"):
        ds = ShardDataset(tmp_path)
    (warning,) = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
    assert "built from val/shard-" in warning and ", not from train/shard-00000.parquet sha256 " in warning
    assert cache.read_bytes() == good
    assert all(torch.equal(ds[i].hidden_states, written[ds[i].seq_id][1]) for i in range(len(ds)))
    swap()
    assert verify([str(tmp_path), "--recompute", "0"]) == 0
    out = capsys.readouterr().out
    assert f"dropped {cache}: built from val/shard-" in out and not cache.exists()


def test_a_topk_cache_moved_onto_another_shards_name_is_rebuilt_for_that_shard(tmp_path, caplog, capsys):
    """Issue #58 item 2: shard 1's top-k file and record moved onto shard 0's names were accepted, and
    all of shard 0's cached positions were another sequence's."""
    from data_tools.verify import main as verify
    from dspark.data.target_topk import TargetTopK

    make_dataset(tmp_path, rows=(3, 2), hidden=8)
    ds = ShardDataset(tmp_path)
    head = torch.randn(8, 11, generator=torch.Generator().manual_seed(0))

    def topk() -> TargetTopK:
        return TargetTopK(ds, k=4, rule="all", target_logits=lambda h: h @ head, head_id="h0", final_index=2)

    good = topk().load()
    zero, one = (topk().path(info) for info in ds.shards)
    for suffix in ("", ".record.json"):
        shutil.copyfile(one.parent / (one.name + suffix), zero.parent / (zero.name + suffix))
    caplog.clear()
    with caplog.at_level("WARNING"):
        again = topk().load()
    (warning,) = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
    assert "built from train/shard-00001.parquet" in warning and "not from train/shard-00000.parquet" in warning
    assert len(again) == len(good) and all(torch.equal(a.positions, b.positions) for a, b in zip(again, good))
    for suffix in ("", ".record.json"):
        shutil.copyfile(one.parent / (one.name + suffix), zero.parent / (zero.name + suffix))
    assert verify([str(tmp_path), "--recompute", "0"]) == 0
    assert f"dropped {zero}: built from train/shard-00001.parquet" in capsys.readouterr().out


def test_a_cache_without_a_record_is_rebuilt_and_one_confirmed_is_not_hashed_again(tmp_path, monkeypatch):
    from dspark.core import derived_files

    make_dataset(tmp_path)
    ShardDataset(tmp_path)
    (cache,) = (tmp_path / ".arrow_cache" / "train").glob("shard-00000-*.arrow")
    derived_files.record_path(cache).unlink()  # a cache built before records existed, or a kill before its record
    assert derived_files.problem(cache).startswith("no intact record of its build")
    ShardDataset(tmp_path)
    assert derived_files.problem(cache) is None
    hashed = []
    monkeypatch.setattr(derived_files, "file_sha256", lambda p: hashed.append(p) or "0" * 64)
    ShardDataset(tmp_path)  # the rerun: a stat per cache, no hash
    assert hashed == []
    os.utime(cache)  # touched: hashed once (here against a wrong hash, so refused)
    assert derived_files.problem(cache).startswith("sha256 0000000000000000, its build recorded")


def test_verify_hashes_every_cache_and_drops_a_damaged_one(tmp_path, capsys):
    from data_tools.verify import main as verify

    make_dataset(tmp_path)
    ShardDataset(tmp_path)
    (cache,) = (tmp_path / ".arrow_cache" / "train").glob("shard-00000-*.arrow")
    stat = cache.stat()
    _zero_middle(cache)
    os.utime(cache, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the mtime restored: only a full hash sees it
    assert verify([str(tmp_path), "--recompute", "0"]) == 0
    out = capsys.readouterr().out
    assert f"dropped {cache}: sha256 " in out and "(altered on disk); the next run rebuilds it" in out
    assert not cache.exists()


def test_a_shard_listed_twice_is_refused_by_training_and_verify(tmp_path, capsys):
    """Issue #48: a manifest listing one shard twice trained on 269 sequences instead of 237."""
    from data_tools.verify import main as verify

    make_dataset(tmp_path)
    path = tmp_path / "manifest.json"
    m = json.loads(path.read_text())
    m["shards"].append(dict(m["shards"][0]))
    path.write_text(json.dumps(m))
    says = (
        f"{path}: shards[3].'name' is 'shard-00000' in split 'train', already listed as shards[0]; expected each "
        "shard listed once"
    )
    with pytest.raises(DatasetError) as err:
        ShardDataset(tmp_path)
    assert str(err.value) == says
    with pytest.raises(SystemExit) as exit_:
        verify([str(tmp_path), "--recompute", "0"])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip() == f"error: {says}"


def test_verify_refuses_a_shard_that_links_out_of_the_dataset_as_training_does(tmp_path, capsys):
    """Issue #48: verify said OK for a link training refuses."""
    from data_tools.verify import main as verify

    make_dataset(tmp_path)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.parquet"
    shard = tmp_path / "train" / "shard-00000.parquet"
    shard.rename(outside)
    shard.symlink_to(outside)
    assert verify([str(tmp_path), "--recompute", "0"]) == 1
    out = capsys.readouterr().out
    assert f"PROBLEM {shard}: a link to {outside}, outside the dataset {tmp_path}; resume rebuilds it" in out
    with pytest.raises(DatasetError, match="outside the dataset"):
        ShardDataset(tmp_path)


def test_a_directory_without_a_dataset_says_to_extract_first(tmp_path):
    with pytest.raises(DatasetError) as err:
        require_dataset(tmp_path / "data")
    assert str(err.value) == (
        f"data.shards_dir={tmp_path / 'data'}: no dataset there (no manifest.json), expected the shards the extract "
        "stage writes; run stages=[extract] first (the same command with stages=[extract,train]), or set "
        "data.shards_dir to an extracted dataset"
    )
    make_dataset(tmp_path / "data")
    assert require_dataset(tmp_path / "data") == tmp_path / "data"


def test_the_manifest_records_the_format_and_refuses_a_mismatched_one(tmp_path):
    make_dataset(tmp_path, dtype="float8_e4m3")
    path = tmp_path / "manifest.json"
    data = json.loads(path.read_text())
    assert (data["dtype"], data["scale_granularity"]) == ("float8_e4m3", "token_layer")
    path.write_text(json.dumps({**data, "scale_granularity": "none"}))
    with pytest.raises(DatasetError) as err:
        Manifest.load(tmp_path)
    assert str(err.value) == (
        f"{path}: field 'scale_granularity' is 'none', dtype 'float8_e4m3' is stored with 'token_layer'"
    )
    path.write_text(json.dumps({**data, "dtype": "float4"}))
    with pytest.raises(DatasetError, match=rf"{path}: field 'dtype' is 'float4', this code reads \['float32', "):
        Manifest.load(tmp_path)


def test_a_manifest_written_before_fp8_reads_as_unscaled(tmp_path):
    written = make_dataset(tmp_path, dtype="float16")
    path = tmp_path / "manifest.json"
    data = json.loads(path.read_text())
    del data["scale_granularity"]
    path.write_text(json.dumps(data))
    assert Manifest.load(tmp_path).scale_granularity == "none"
    seq = ShardDataset(tmp_path)[0]
    assert torch.equal(seq.hidden_states, written[seq.seq_id][1])
