"""`python -m data_tools.verify` on bad input: rc 2 and an `error:` line naming the file; a damaged
shard or sidecar is a problem in the report (rc 1). The numeric check of 16-bit shards runs in
test_extract_vllm.py; fp8 shards are checked here against a tiny transformers target."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from data_tools.shard_writer import finalize, write_shard
from data_tools.verify import main
from dspark.core import fp8
from dspark.core.layer_ids import reference_hidden_states
from dspark.formats.shard_rows import encode_hidden_states
from tests.toy import save_target, tiny_llama_target, toy_manifest

REPO = Path(__file__).resolve().parents[2]


def tiny_dataset(directory: Path) -> Path:
    toy_manifest(target_path="/nowhere/toy", compression="none").save(directory)
    hs = torch.randn(4, 2, 8)
    row = {"seq_id": "a", "num_tokens": 5, "input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]}
    write_shard([{**row, "hidden_states": hs.numpy().tobytes()}], directory, "train", 0, "none", Counter())
    finalize(directory, [("train", 0)])
    return directory


def test_not_a_dataset_is_rc_2_with_one_error_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "data_tools.verify", str(tmp_path / "nope")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (out.returncode, out.stderr) == (
        2,
        f"error: {tmp_path / 'nope' / 'manifest.json'}: missing file; not a dataset directory written by "
        "data_tools.extract\n",
    )


def refused(argv: list[str]) -> int:
    """The exit status of a refused verify (a user error exits 2, like every other command)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


def test_a_damaged_manifest_or_a_moved_target_is_named(tmp_path, capsys):
    data = tiny_dataset(tmp_path / "d")
    assert main([str(data), "--recompute", "0"]) == 0
    assert refused([str(data)]) == 2  # recompute needs the target
    assert capsys.readouterr().err == (
        f"error: {data / 'manifest.json'}: field 'target_path' is '/nowhere/toy', which has no config.json, expected "
        "the target the dataset was extracted from; pass --recompute 0 to check integrity only\n"
    )
    text = (data / "manifest.json").read_text()
    (data / "manifest.json").write_text(text[: len(text) // 2])  # a torn write
    assert refused([str(data), "--recompute", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {data / 'manifest.json'}: not valid JSON (") and err.count("\n") == 1
    (data / "manifest.json").write_text(json.dumps({**json.loads(text), "schema_version": 0}))
    assert refused([str(data), "--recompute", "0"]) == 2
    assert "field 'schema_version' is 0, this code reads 1" in capsys.readouterr().err


def test_a_damaged_sidecar_is_a_problem_not_a_crash(tmp_path, capsys):
    data = tiny_dataset(tmp_path / "d")
    manifest = json.loads((data / "manifest.json").read_text())
    (data / "manifest.json").write_text(json.dumps({**manifest, "shards": []}))  # the sidecar is all there is
    (data / "train" / "shard-00000.json").write_text("{")
    assert main([str(data), "--recompute", "0"]) == 1
    out = capsys.readouterr().out
    assert f"PROBLEM {data / 'train' / 'shard-00000.json'}: damaged sidecar (" in out
    assert "resume rebuilds the shard" in out and out.rstrip().endswith("FAILED")


def fp8_dataset(directory: Path, dtype: str, cells: list[bytes] | None = None) -> Path:
    """A tiny transformers target saved beside an fp8 dataset of its own states (through the
    extractor's encoder and writer); ``cells`` replaces the rows' hidden_states bytes."""
    model = tiny_llama_target()  # 3 layers, hidden 32, vocab 64
    save_target(model, directory / "target")
    layers = [1, 3]
    toy_manifest(
        target_path=str(directory / "target"), layer_ids=layers, num_hidden_layers=3, hidden_size=32, dtype=dtype
    ).save(directory)
    rows = []
    for k in range(3):
        ids = torch.randint(0, 64, (7 + k,))
        with torch.no_grad():
            hs = reference_hidden_states(model, ids[:-1], layers)
        cell = encode_hidden_states(hs, dtype) if cells is None else cells[k]
        rows.append(
            {"seq_id": f"s{k}", "num_tokens": len(ids), "input_ids": ids.tolist(), "loss_mask": [1] * len(ids)}
            | {"hidden_states": cell}
        )
    write_shard(rows, directory, "train", 0, "zstd", Counter())
    finalize(directory, [("train", 0)])
    return directory


@pytest.mark.parametrize("dtype", ["float8_e4m3", "float8_e5m2"])
def test_fp8_shards_verify_against_recomputed_states_within_the_format_bound(tmp_path, capsys, dtype):
    data = fp8_dataset(tmp_path, dtype)
    assert main([str(data), "--recompute", "3"]) == 0
    out = capsys.readouterr().out
    limit = 1e-2 + 1.01 * fp8.FORMATS[dtype].row_rel_bound(32)
    assert f"over 3 sequences (limit {limit:g}):" in out and out.rstrip().endswith("OK")
    errors = [float(line.split(":")[1]) for line in out.splitlines() if line.strip().startswith("layer")]
    assert len(errors) == 2 and 0 < max(errors) <= fp8.FORMATS[dtype].row_rel_bound(32)  # quantized, in bound
    assert main([str(data), "--recompute", "3", "--max-rel-err", "1e-4"]) == 1  # the 16-bit limit would refuse it
    assert "TOO HIGH" in capsys.readouterr().out


def test_a_corrupt_fp8_row_is_named_with_its_file_and_field(tmp_path, capsys):
    good = [encode_hidden_states(torch.randn(n, 2, 32), "float8_e4m3") for n in (6, 7, 8)]
    nan_scale = bytearray(good[1])
    nan_scale[-4:] = torch.tensor([float("nan")]).numpy().tobytes()  # the last token's last scale
    negative = bytearray(good[2])
    negative[-8:-4] = torch.tensor([-1.0]).numpy().tobytes()
    data = fp8_dataset(tmp_path, "float8_e4m3", cells=[good[0][:-4], bytes(nan_scale), bytes(negative)])
    assert main([str(data), "--recompute", "0"]) == 1
    out = capsys.readouterr().out
    shard = data / "train" / "shard-00000.parquet"
    assert (
        f"PROBLEM {shard}: row 0 (sequence s0): hidden_states has {6 * 2 * 36 - 4} bytes, expected {6 * 2 * 36} = "
        "(7-1)x(2x32x1 + 2x4 scale bytes)"
    ) in out
    assert (
        f"PROBLEM {shard}: row 1 (sequence s1): hidden_states scales: 1 of 14 are NaN, inf or negative "
        "(first at token 6, captured layer 1: nan)"
    ) in out
    assert (
        f"PROBLEM {shard}: row 2 (sequence s2): hidden_states scales: 1 of 16 are NaN, inf or negative "
        "(first at token 7, captured layer 0: -1.0)"
    ) in out
    assert out.rstrip().endswith("FAILED")
