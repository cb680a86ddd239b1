"""Re-store an extracted dataset in another store dtype, without the target or vLLM: fp8 halves a
bf16/fp16 dump already on disk (issue #16), and two datasets that differ only in the store
dtype hold the very same sequences (what the fp8-vs-fp16 training comparison needs).

    python -m data_tools.convert SRC DST --store-dtype float8_e4m3 [--compression zstd]

Every shard of SRC is read in row groups, its states decoded to fp32 and encoded again through
the extractor's own encoder (``encode_hidden_states``), then written by the extractor's shard
writer: the same names, rows and order, with new sizes and hashes in DST's manifest. Everything
else in the manifest (target, layers, prompt set and its settings) is SRC's, so a training or
extraction run pointed at DST with ``data.store_dtype`` set to the new dtype takes it as its
own. Quantizing a 16-bit dump adds its rounding (about 2e-3 relative) under fp8's (about 2e-2).

Resumable like extraction: a rerun keeps DST's complete shards and writes the rest; a DST made
from another source or in another format is refused. Exit status 0 when DST is complete, 2 with
one ``error:`` line for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import pyarrow.parquet as pq
from tqdm import tqdm

from data_tools.extract import open_dataset_dir
from data_tools.shard_writer import ShardWriter, complete_shard, finalize
from dspark.core.errors import exit_on_user_error
from dspark.formats.shard_format import COMPRESSIONS, STORE_DTYPES, DatasetError, Manifest, scale_granularity_of
from dspark.formats.shard_rows import decode_hidden_states, encode_hidden_states


def convert(src: Path, dst: Path, *, store_dtype: str, compression: Optional[str] = None) -> Manifest:
    """Write DST as SRC re-stored in ``store_dtype``; returns DST's (complete) manifest."""
    src, dst = Path(src), Path(dst)
    if store_dtype not in STORE_DTYPES:
        raise DatasetError(f"--store-dtype {store_dtype!r}: expected one of {', '.join(STORE_DTYPES)}")
    source = Manifest.load(src)
    if not source.complete:
        raise DatasetError(f"{src / 'manifest.json'}: field 'complete' is false; finish or resume its extraction first")
    if src.resolve() == dst.resolve():
        raise DatasetError(f"{dst}: the destination is the source; pass another directory")
    header = dataclasses.replace(
        source,
        dtype=store_dtype,
        scale_granularity=scale_granularity_of(store_dtype),
        compression=compression or source.compression,
        shards=[],
        complete=False,
    )
    dst.mkdir(parents=True, exist_ok=True)
    open_dataset_dir(dst, header)  # a DST made differently is refused, nothing in it touched
    units = [(info.split, int(info.name.rsplit("-", 1)[1])) for info in source.shards]
    todo = [(info, unit) for info, unit in zip(source.shards, units) if complete_shard(dst, *unit) is None]
    n_layers, hidden = len(source.layer_ids), source.hidden_size
    t0, tokens = time.perf_counter(), 0
    with tqdm(total=sum(info.tokens for info, _ in todo), unit="tok", unit_scale=True, desc="convert") as bar:
        for info, (split, index) in todo:
            for stale in (dst / split).glob(f".{info.name}.parquet.tmp-*"):
                stale.unlink()  # a killed conversion's half shard
            writer = ShardWriter(dst, split, index, header.compression)
            for batch in pq.ParquetFile(src / info.path).iter_batches(batch_size=16):
                rows = batch.to_pylist()
                for row in rows:
                    states = decode_hidden_states(
                        row["hidden_states"], dtype=source.dtype, n_layers=n_layers, hidden=hidden
                    )
                    row["hidden_states"] = encode_hidden_states(states, store_dtype)
                writer.write(rows)
                bar.update(sum(r["num_tokens"] for r in rows))
            writer.finish(Counter(info.skipped))
            tokens += info.tokens
    manifest = finalize(dst, units)
    seconds = time.perf_counter() - t0
    mb_out, mb_in = (sum(s.bytes for s in m.shards) / 1e6 for m in (manifest, source))
    print(
        f"{dst}: {len(manifest.shards)} shards, {sum(s.tokens for s in manifest.shards):,} tokens in {store_dtype} "
        f"({mb_out:,.1f} MB, from {mb_in:,.1f} MB in {source.dtype}); {len(todo)} converted in {seconds:.1f} s"
        + (f" ({tokens / seconds:,.0f} tok/s)" if todo and seconds > 0 else "")
    )
    return manifest


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m data_tools.convert", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1]
    )
    p.add_argument("src", type=Path, help="a complete dataset directory (manifest.json + shards)")
    p.add_argument("dst", type=Path, help="where to write the converted dataset (resumed if it exists)")
    p.add_argument("--store-dtype", required=True, choices=list(STORE_DTYPES))
    p.add_argument(
        "--compression", default=None, choices=COMPRESSIONS, help="Parquet compression (default: the source's)"
    )
    args = p.parse_args(argv)
    with exit_on_user_error():
        convert(args.src, args.dst, store_dtype=args.store_dtype, compression=args.compression)
    return 0


if __name__ == "__main__":
    sys.exit(main())
