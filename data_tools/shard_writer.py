"""Shard files of one dataset directory: write a shard under a temporary name and rename it
when complete, find the complete ones on resume, and record them in ``manifest.json``.
Format: :mod:`dspark.formats.shard_format`."""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock

from dspark.core.atomic_files import atomic_path, atomic_write_text
from dspark.core.disk_space import reporting_disk_full
from dspark.core.file_reads import file_sha256
from dspark.formats.shard_format import SCHEMA, Manifest, ShardInfo, shard_name

DISK_FULL_TODO = (
    "free space there (or set data.shards_dir elsewhere) and rerun the same command: "
    "the complete shards are kept, this one is written again"
)


class ShardWriter:
    """Write one shard in batches of rows (memory holds one batch, not the shard), under a
    temporary name; ``finish`` fsyncs, renames it into place and then writes its sidecar (the
    mark of a complete shard). A failed write (a full disk: :class:`DiskFullError`) removes the
    temporary file: nothing of the shard is left."""

    def __init__(self, directory: Path, split: str, index: int, compression: str):
        self.dir = directory / split
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = shard_name(index)
        self.split = split
        self.final = self.dir / f"{self.name}.parquet"
        self._publish = contextlib.ExitStack()  # leaving it fsyncs and renames the temporary file
        self.tmp = self._publish.enter_context(atomic_path(self.final))
        self.writer = pq.ParquetWriter(
            self.tmp,
            SCHEMA,
            compression=None if compression == "none" else compression,
            use_dictionary=False,
            write_statistics=["seq_id", "num_tokens"],
        )
        self.rows = self.tokens = 0

    def write(self, rows: list[dict]) -> None:
        if rows:
            table = pa.Table.from_pylist(rows, schema=SCHEMA)
            with self._removed_on_error(more=table.nbytes):
                self.writer.write_table(table, row_group_size=16)
            self.rows += len(rows)
            self.tokens += sum(r["num_tokens"] for r in rows)

    @contextlib.contextmanager
    def _removed_on_error(self, *, more: int = 0) -> Iterator[None]:
        """Remove the temporary file when the body fails; a full disk is named with the bytes
        this shard needs so far (written + ``more``, a lower bound) and those free."""
        needed = (self.tmp.stat().st_size if self.tmp.exists() else 0) + more
        with reporting_disk_full(
            self.dir, what=f"shard {self.final.name}", needed=needed, todo=DISK_FULL_TODO, at_least=True
        ):
            try:
                yield
            except BaseException:
                with contextlib.suppress(Exception):
                    self.writer.close()
                self._publish.__exit__(*sys.exc_info())  # atomic_path removes the temporary file
                raise

    def finish(self, skipped: Counter) -> ShardInfo:
        with self._removed_on_error():
            self.writer.close()
            self._publish.close()
        info = ShardInfo(
            split=self.split,
            name=self.name,
            rows=self.rows,
            tokens=self.tokens,
            bytes=self.final.stat().st_size,
            sha256=file_sha256(self.final),
            skipped=dict(skipped),
        )
        sidecar, text = self.dir / f"{self.name}.json", json.dumps(info.__dict__)
        with reporting_disk_full(self.dir, what=sidecar.name, needed=len(text), todo=DISK_FULL_TODO):
            try:
                atomic_write_text(sidecar, text)  # the shard counts as complete from here on
            except BaseException:
                self.final.unlink(missing_ok=True)  # to be written again: give its space back now
                raise
        return info


def write_shard(
    rows: list[dict], directory: Path, split: str, index: int, compression: str, skipped: Counter
) -> ShardInfo:
    """Write a whole shard from rows in memory (tests, benchmarks)."""
    writer = ShardWriter(directory, split, index, compression)
    writer.write(rows)
    return writer.finish(skipped)


def complete_shard(directory: Path, split: str, index: int) -> Optional[ShardInfo]:
    """The sidecar of a shard whose file is present at its recorded size, else None."""
    sidecar = directory / split / f"{shard_name(index)}.json"
    if not sidecar.is_file():
        return None
    info = ShardInfo(**json.loads(sidecar.read_text()))
    shard = directory / info.path
    if not shard.is_file() or shard.stat().st_size != info.bytes:
        return None
    return info


def finalize(out: Path, units: list[tuple[str, int]]) -> Manifest:
    """Record every complete shard in manifest.json; complete=True once all units are there."""
    with FileLock(str(out / ".manifest.lock")):
        manifest = Manifest.load(out)
        infos = [complete_shard(out, s, k) for s, k in units]
        manifest.shards = [i for i in infos if i is not None]
        manifest.complete = all(i is not None for i in infos)
        with reporting_disk_full(out, what="manifest.json", needed=len(manifest.to_json()), todo=DISK_FULL_TODO):
            manifest.save(out)
    return manifest
