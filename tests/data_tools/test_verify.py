"""`python -m data_tools.verify` on bad input: rc 2 and an `error:` line naming the file; a damaged
shard or sidecar is a problem in the report (rc 1). The numeric check runs in test_extract_vllm.py."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

from data_tools.shard_writer import finalize, write_shard
from data_tools.verify import main
from dspark.core.shard_format import Manifest

REPO = Path(__file__).resolve().parents[2]


def tiny_dataset(directory: Path) -> Path:
    Manifest(
        target="toy",
        target_path="/nowhere/toy",
        revision=None,
        architecture="LlamaForCausalLM",
        tokenizer_sha256="t",
        chat_template_sha256="c",
        layer_ids=[1, 4],
        num_hidden_layers=4,
        hidden_size=8,
        dtype="float32",
        compression="none",
    ).save(directory)
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


def test_a_damaged_manifest_or_a_moved_target_is_named(tmp_path, capsys):
    data = tiny_dataset(tmp_path / "d")
    assert main([str(data), "--recompute", "0"]) == 0
    assert main([str(data)]) == 2  # recompute needs the target
    assert capsys.readouterr().err == (
        f"error: {data / 'manifest.json'}: field 'target_path' is '/nowhere/toy', which has no config.json, expected "
        "the target the dataset was extracted from; pass --recompute 0 to check integrity only\n"
    )
    text = (data / "manifest.json").read_text()
    (data / "manifest.json").write_text(text[: len(text) // 2])  # a torn write
    assert main([str(data), "--recompute", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {data / 'manifest.json'}: not valid JSON (") and err.count("\n") == 1
    (data / "manifest.json").write_text(json.dumps({**json.loads(text), "schema_version": 0}))
    assert main([str(data), "--recompute", "0"]) == 2
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
