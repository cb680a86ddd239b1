"""What verifying shards where they are read costs (issue #37): each shard's size and SHA-256
against the manifest and every row through ``check_row``, once, when the reader builds the shard's
Arrow cache (``dspark.data.shards.ShardDataset._open``); a rerun finds the caches and checks nothing.

    .venv/bin/python benchmarks/shard_check_cost.py outputs/data/smollm2-135m
    .venv/bin/python benchmarks/shard_check_cost.py outputs/data/smollm2-135m --synthetic-gb 10 \\
        --synthetic-dir /tmp/synthetic10g   # the demo's shards copied to 10 GB under a manifest of their own

Per dataset, over every shard of both splits: the bytes, and the first open's parts timed one by
one as the reader runs them (read the file, hash it, parse the Parquet, check every row), then the
reader's own first open (caches moved aside, so it reads, verifies and writes them) and its rerun
(caches present: each checked against its build's record, a stat) and a rerun after every cache's
mtime changed (each hashed in full, as after a copy). The check's cost is hash + row checks; the
share is of the first open and, with ``--train-s``, of a train stage of that many seconds. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dspark.data.shards import ShardDataset  # noqa: E402
from dspark.formats.shard_format import CACHE_DIR, MANIFEST, SCHEMA, Manifest  # noqa: E402
from dspark.formats.shard_rows import check_row  # noqa: E402


def parts(directory: Path) -> dict[str, float]:
    """The first open's steps, timed apart, over every shard."""
    m = Manifest.load(directory)
    out = dict(bytes=0.0, read_s=0.0, hash_s=0.0, parse_s=0.0, rows_s=0.0)
    for info in m.shards:
        t0 = time.perf_counter()
        data = (directory / info.path).read_bytes()
        t1 = time.perf_counter()
        sha = hashlib.sha256(data).hexdigest()
        t2 = time.perf_counter()
        table = pq.read_table(pa.BufferReader(data), schema=SCHEMA)
        t3 = time.perf_counter()
        bad = [
            check_row(r, n_layers=len(m.layer_ids), hidden_size=m.hidden_size, dtype=m.dtype) for r in table.to_pylist()
        ]
        t4 = time.perf_counter()
        if sha != info.sha256 or any(bad):
            raise SystemExit(f"{directory / info.path}: does not match its manifest; not a dataset to time")
        out["bytes"] += len(data)
        for k, a, b in (("read_s", t0, t1), ("hash_s", t1, t2), ("parse_s", t2, t3), ("rows_s", t3, t4)):
            out[k] += b - a
    return out


def reader_open(directory: Path) -> tuple[float, float, float]:
    """(first open with no caches, rerun with them, rerun with every cache's mtime changed): the
    reader's own path, both splits. A rerun checks each cache against the record of its build
    (issue #48, :mod:`dspark.core.derived_files`): a stat when its (size, mtime) were confirmed, a full
    hash when not (a copied or touched dataset)."""
    cache = directory / CACHE_DIR
    aside = Path(tempfile.mkdtemp(dir=directory.parent)) / "cache"
    if cache.exists():
        shutil.move(str(cache), aside)
    try:
        t0 = time.perf_counter()
        for split in ("train", "val"):
            ShardDataset(directory, split)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for split in ("train", "val"):
            ShardDataset(directory, split)
        rerun = time.perf_counter() - t0
        for c in cache.rglob("*.arrow"):
            os.utime(c)
        t0 = time.perf_counter()
        for split in ("train", "val"):
            ShardDataset(directory, split)
        return first, rerun, time.perf_counter() - t0
    finally:
        if aside.exists():
            shutil.rmtree(cache, ignore_errors=True)
            shutil.move(str(aside), cache)
        shutil.rmtree(aside.parent, ignore_errors=True)


def synthetic(source: Path, out: Path, gb: float) -> Path:
    """``source``'s shards copied (real copies, new names) until ``gb`` GB, under a manifest that
    lists every copy with the source's size and hash: a dataset the reader verifies as any other."""
    m = json.loads((source / MANIFEST).read_text())
    shards, total, k = [], 0, 0
    out.mkdir(parents=True, exist_ok=True)
    while total < gb * 1e9:
        for s in m["shards"]:
            name = f"copy{k:03d}-{s['name']}"
            dest = out / s["split"] / f"{name}.parquet"
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not dest.is_file():
                shutil.copyfile(source / s["split"] / f"{s['name']}.parquet", dest)
            shards.append({**s, "name": name})
            total += s["bytes"]
        k += 1
    (out / MANIFEST).write_text(json.dumps({**m, "shards": shards}, indent=1))
    return out


def row(name: str, p: dict[str, float], first: float, rerun: float, touched: float, train_s: float | None) -> str:
    check = p["hash_s"] + p["rows_s"]
    gb = p["bytes"] / 1e9
    share = f"{100 * check / train_s:.1f} %" if train_s else "-"
    return (
        f"| {name} | {gb:.2f} | {p['read_s']:.1f} | {p['hash_s']:.1f} ({gb / max(p['hash_s'], 1e-9):.2f} GB/s) | "
        f"{p['parse_s']:.1f} | {p['rows_s']:.1f} | {first:.1f} | **{check:.1f}** ({100 * check / first:.0f} %) | "
        f"{share} | {rerun:.2f} | {touched:.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset", type=Path, help="a dataset directory (manifest.json and its shards)")
    ap.add_argument("--synthetic-gb", type=float, default=0.0, help="also time a copy of it grown to this many GB")
    ap.add_argument("--synthetic-dir", type=Path, default=None, help="where the copy goes (kept for a rerun)")
    ap.add_argument("--train-s", type=float, default=None, help="a train stage's seconds, for the check's share")
    args = ap.parse_args(argv)
    sets = [(args.dataset.name, args.dataset)]
    if args.synthetic_gb:
        where = args.synthetic_dir or Path(tempfile.mkdtemp()) / "synthetic"
        sets.append(
            (
                f"{args.dataset.name} x copies, {args.synthetic_gb:g} GB",
                synthetic(args.dataset, where, args.synthetic_gb),
            )
        )
    print(
        "| dataset | GB | read s | sha256 s | parse s | check_row s | first open s (reader) | the check s (share) "
        "| of --train-s | rerun s | rerun, caches touched s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, d in sets:
        first, rerun, touched = reader_open(d)
        print(row(name, parts(d), first, rerun, touched, args.train_s), flush=True)
    print("\n" + other_checks(args.train_s))
    return 0


def other_checks(train_s: float | None) -> str:
    """What a rerun's other checks of derived files cost (issue #58): the converted target's files
    against its marker, and the llama.cpp build's binaries against theirs (hashed, 21 MB)."""
    from dspark.config import TargetConfig
    from dspark.serving.llama_cpp.build import find
    from dspark.target import resolve_target

    rows = ["| check on a rerun | s (median of 5) | share of --train-s |", "|---|---|---|"]
    for what, fn in (
        ("the converted target (stat each file, hash where its mtime moved)", lambda: resolve_target(TargetConfig())),
        ("the llama.cpp build (hash every file of bin/)", find),
    ):
        fn()  # a first use records what an older marker lacks
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        med = sorted(times)[2]
        rows.append(
            f"| {what} | {med:.3f} | {100 * med / train_s:.3f} % |" if train_s else f"| {what} | {med:.3f} | - |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
