"""Read throughput of real datasets as the trainer reads them: ``dspark.data.shards.ShardDataset``
from a dataset directory into fp32 micro batches, per store dtype (issue #16: fp8 shards are half
the bytes, and their dequantization is a multiply per value somewhere).

    .venv/bin/python benchmarks/shard_read.py outputs/data/smollm2-135m-ablate-float16 \\
        outputs/data/smollm2-135m-ablate-float8_e4m3 [--split train] [--repeat 3] [--threads 1] \\
        [--device cuda --dtype bfloat16]

Per directory: Parquet bytes on disk, the Arrow cache the reader builds next to them (built once
per dataset: its time is reported apart, with the cache moved aside for the measurement and put
back after), and the steady read of every sequence of the split in micro batches of
``--micro-batch`` (memory-mapped cache -> collate -> ``Batch.to(--device, --dtype)``), best of
``--repeat``, two ways: ``host`` dequantizes fp8 as each sequence is read (the reader's
``states_dtype``), ``kept`` is the trainer's way (fp8 values and scales travel to the device,
which dequantizes in ``Batch.to``); for ``kept`` the host's share (read + collate) is reported
apart from the dequantization, which a GPU does. 16/32-bit shards read the same both ways.
With ``--device cuda`` the ``.to`` column is the copy to the GPU and, for fp8, the dequantization
there (synchronized), which is the figure that says whether the device keeps up; the host columns
stay the host's.
Prints a Markdown table.
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

from dspark.data.batching import collate  # noqa: E402
from dspark.data.shards import ShardDataset  # noqa: E402
from dspark.formats.shard_format import Manifest  # noqa: E402


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def read_all(
    ds: ShardDataset, micro_batch: int, ctx: list[int], final: int, device: str = "cpu", dtype=torch.float32
) -> tuple[float, float]:
    """(host seconds: read + collate, seconds of Batch.to(device, dtype)) over the whole split."""
    host = to = 0.0
    for start in range(0, len(ds), micro_batch):
        t0 = time.perf_counter()
        batch = collate(
            [ds.read(i) for i in range(start, min(start + micro_batch, len(ds)))],
            context_index=ctx,
            final_index=final,
            max_len=1 << 20,
        )
        t1 = time.perf_counter()
        out = batch.to(device, dtype)
        out.context_states.sum(), out.final_states.sum()  # touch every value
        sync(device)
        host, to = host + t1 - t0, to + time.perf_counter() - t1
    return host, to


def measure(directory: Path, split: str, repeat: int, micro_batch: int, device: str, dtype: torch.dtype) -> dict:
    manifest = Manifest.load(directory)
    n = len(manifest.layer_ids)
    ctx, final = list(range(n - 1)), n - 1
    cache = directory / ".arrow_cache"
    best: dict[str, tuple[float, float]] = {}
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
            for mode, reader in (("host", ds), ("kept", ShardDataset(directory, split, keep_fp8=True))):
                for _ in range(repeat):
                    host, to = read_all(reader, micro_batch, ctx, final, device, dtype)
                    if mode not in best or host + to < sum(best[mode]):
                        best[mode] = (host, to)
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
        "host_tok_s": tokens / sum(best["host"]),
        "kept_host_tok_s": tokens / best["kept"][0],
        "kept_to_tok_s": tokens / best["kept"][1],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", type=Path, help="dataset directories (manifest.json + shards)")
    p.add_argument("--split", default="train")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--device", default="cpu", help="where Batch.to puts the batch (cuda: the trainer's GPU path)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the training dtype")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = [measure(d.resolve(), args.split, args.repeat, args.micro_batch, args.device, dtype) for d in args.dirs]
    print(
        f"{args.split} split, micro batches of {args.micro_batch}, {args.threads} torch thread(s), into "
        f"{args.dtype} on {args.device}, best of {args.repeat}\n"
    )
    print(
        "| store dtype | sequences | tokens | Parquet bytes/token | Arrow cache bytes/token | cache build tok/s "
        "| host dequant: read+collate+to tok/s | kept: host read+collate tok/s | kept: dequant in .to tok/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['sequences']} | {r['tokens']:,} | {r['parquet_bytes_per_token']:,.0f} | "
            f"{r['cache_bytes_per_token']:,.0f} | {r['cache_build_tok_s']:,.0f} | {r['host_tok_s']:,.0f} | "
            f"{r['kept_host_tok_s']:,.0f} | {r['kept_to_tok_s']:,.0f} |"
        )


if __name__ == "__main__":
    main()
