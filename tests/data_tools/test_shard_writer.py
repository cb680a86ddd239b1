"""The shard writer when the disk fills up (issue #17): a clear error, nothing half written left,
and the rerun completes the dataset as an uninterrupted run would have."""

import json
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from data_tools.shard_writer import ShardWriter, complete_shard, finalize
from dspark.core.disk_space import DiskFullError
from dspark.formats.shard_format import Manifest
from tests.toy import toy_manifest

REPO = Path(__file__).resolve().parents[2]
UNITS = [("train", 0), ("train", 1)]
ROWS_PER_BATCH = 4


def rows_of(split: str, k: int) -> list[dict]:
    """8 sequences of 20 tokens, 3 layers x 64 fp32 states: about 120 KB a shard."""
    gen = torch.Generator().manual_seed(k)
    return [
        {
            "seq_id": f"{split}{k}-{r}",
            "num_tokens": 20,
            "input_ids": torch.randint(0, 100, (20,), generator=gen).tolist(),
            "loss_mask": [0] * 4 + [1] * 16,
            "hidden_states": torch.randn(19, 3, 64, generator=gen).numpy().tobytes(),
        }
        for r in range(8)
    ]


def extract_like(out: Path) -> Manifest:
    """What extraction does with the shards: skip the complete ones, write the rest in batches."""
    toy_manifest(layer_ids=[0, 1, 4], hidden_size=64, compression="none").save(out)
    for split, k in UNITS:
        if complete_shard(out, split, k) is None:
            writer = ShardWriter(out, split, k, "none")
            rows = rows_of(split, k)
            for b in range(0, len(rows), ROWS_PER_BATCH):
                writer.write(rows[b : b + ROWS_PER_BATCH])
            writer.finish(Counter())
    return finalize(out, UNITS)


def test_a_full_disk_names_the_shard_and_the_bytes_and_the_rerun_completes_the_dataset(tmp_path, small_disk):
    reference = extract_like(tmp_path / "reference")
    disk = small_disk.mount(192 * 1024)  # one shard (~120 KB) and the small files fit, two do not
    with pytest.raises(DiskFullError) as err:
        extract_like(disk)
    assert re.fullmatch(
        rf"{disk}/train: no space for shard shard-00001\.parquet \(at least [\d,]+ bytes needed, [\d,]+ bytes free\); "
        r"free space there \(or set data\.shards_dir elsewhere\) and rerun the same command: the complete shards "
        r"are kept, this one is written again",
        str(err.value),
    ), err.value
    needed, free = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) bytes", str(err.value)))
    assert needed > free > 0
    # nothing half written: no temporary file, no shard-00001 under its name, the manifest not complete
    assert sorted(p.name for p in (disk / "train").iterdir()) == ["shard-00000.json", "shard-00000.parquet"]
    manifest = json.loads((disk / "manifest.json").read_text())
    assert (manifest["complete"], [s["name"] for s in manifest["shards"]]) == (False, [])  # finalize never ran
    small_disk.resize(disk, 1024 * 1024)  # room freed
    resumed = extract_like(disk)
    assert resumed.complete and resumed.shards == reference.shards  # same rows, sizes and sha256
    assert [s.name for s in resumed.shards] == ["shard-00000", "shard-00001"]


KILL_MID_SHARD = r"""
import importlib.util, os, signal, sys
from pathlib import Path
from data_tools.shard_writer import ShardWriter

spec = importlib.util.spec_from_file_location("shard_writer_test", sys.argv[1])
test = importlib.util.module_from_spec(spec)
spec.loader.exec_module(test)
real_write = ShardWriter.write

def write(self, rows):  # the first batch of shard-00001 written, then SIGKILL
    real_write(self, rows)
    if self.name == "shard-00001":
        os.kill(os.getpid(), signal.SIGKILL)

ShardWriter.write = write
test.extract_like(Path(sys.argv[2]))
"""


def test_a_kill_mid_shard_leaves_no_shard_under_its_name_and_the_rerun_completes_the_dataset(tmp_path):
    reference = extract_like(tmp_path / "reference")
    out = tmp_path / "ds"
    cmd = [sys.executable, "-c", KILL_MID_SHARD, __file__, str(out)]
    child = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    names = sorted(p.name for p in (out / "train").iterdir())
    assert names[0].startswith(".shard-00001.parquet.tmp-")  # the half shard, only under its temporary name
    assert names[1:] == ["shard-00000.json", "shard-00000.parquet"]
    assert complete_shard(out, "train", 1) is None and not Manifest.load(out).complete
    resumed = extract_like(out)
    assert resumed.complete and resumed.shards == reference.shards
