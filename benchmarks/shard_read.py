"""Read throughput of real datasets as the trainer reads them: ``dspark.shards.ShardDataset``
from a dataset directory into the training dtype, per store dtype (issue #16: fp8 shards are half
the bytes but must be dequantized on the host).

    .venv/bin/python benchmarks/shard_read.py outputs/data/smollm2-135m-ablate-float16 \\
        outputs/data/smollm2-135m-ablate-float8_e4m3 [--split train] [--repeat 3] [--threads 1]

Per directory: Parquet bytes on disk, the Arrow cache the reader builds next to them (built once
per dataset: its time is reported apart, with the cache moved aside for the measurement and put
back after), and the steady read of every sequence of the split (memory-mapped cache -> fp32
tensors), best of ``--repeat``. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dspark.core.shard_format import Manifest  # noqa: E402
from dspark.shards import ShardDataset  # noqa: E402


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def measure(directory: Path, split: str, repeat: int) -> dict:
    manifest = Manifest.load(directory)
    cache = directory / ".arrow_cache"
    with tempfile.TemporaryDirectory(dir=directory.parent) as aside:
        kept = Path(aside) / "arrow_cache"
        if cache.exists():
            shutil.move(str(cache), kept)
        try:
            t0 = time.perf_counter()
            ds = ShardDataset(directory, split, states_dtype=torch.float32)
            build_s = time.perf_counter() - t0
            cache_bytes = dir_bytes(cache / split)
            tokens = sum(len(ds.read(i).input_ids) - 1 for i in range(len(ds)))
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                for i in range(len(ds)):
                    ds.read(i).hidden_states.sum()  # touch every value: a lazy view would read nothing
                best = min(best, time.perf_counter() - t0)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
            if kept.exists():
                shutil.move(str(kept), cache)
    parquet = sum(s.bytes for s in manifest.shards if s.split == split)
    return {
        "dir": directory.name,
        "dtype": manifest.dtype,
        "sequences": len(ds),
        "tokens": tokens,
        "parquet_bytes_per_token": parquet / tokens,
        "cache_bytes_per_token": cache_bytes / tokens,
        "cache_build_tok_s": tokens / build_s,
        "read_tok_s": tokens / best,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", type=Path, help="dataset directories (manifest.json + shards)")
    p.add_argument("--split", default="train")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(d.resolve(), args.split, args.repeat) for d in args.dirs]
    print(f"{args.split} split, {args.threads} torch thread(s), read into float32, best of {args.repeat}\n")
    print(
        "| store dtype | sequences | tokens | Parquet bytes/token | Arrow cache bytes/token "
        "| cache build tok/s | read tok/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['sequences']} | {r['tokens']:,} | {r['parquet_bytes_per_token']:,.0f} | "
            f"{r['cache_bytes_per_token']:,.0f} | {r['cache_build_tok_s']:,.0f} | {r['read_tok_s']:,.0f} |"
        )


if __name__ == "__main__":
    main()
