"""Reader for the hidden-state shards that ``data_tools.extract`` writes (format in
``dspark.formats.shard_format``).

Parquet is the storage format; for training each shard is converted once into an uncompressed
Arrow IPC file (``<dataset>/.arrow_cache/``) that is memory-mapped, so a random sequence is a
few pointer lookups and its hidden states are a zero-copy torch view of the page cache. fp8
shards are read the same way and dequantized per sequence into ``states_dtype``, or, for the
trainer (``keep_fp8``), kept as fp8 values and scales until the batch reaches the device.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import torch

from dspark.core import derived_files, fp8
from dspark.data.target_topk import SequenceTopK
from dspark.formats.shard_format import (
    MANIFEST,
    SCHEMA,
    DatasetError,
    Manifest,
    ShardInfo,
    arrow_cache_source,
    cache_path,
)
from dspark.formats.shard_rows import decode_hidden_states, read_shard, split_scaled


@dataclass
class ShardSequence:
    """One training sequence. Shape symbols: T tokens, L captured layers, H target hidden."""

    seq_id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool, True on answer tokens
    hidden_states: torch.Tensor  # [T-1, L, H]; row t = state after input_ids[:t+1]; read-only view
    target_topk: Optional[SequenceTopK] = None
    """The target's cached top-k distribution (:mod:`dspark.data.target_topk`), when attached."""
    scales: Optional[torch.Tensor] = None
    """[T-1, L] fp32 when ``hidden_states`` holds fp8 values still to be dequantized (a reader
    opened with ``keep_fp8``): state = value * scale, :func:`dspark.core.fp8.dequantize`."""

    def states(self, rows: torch.Tensor | slice, layer: int) -> torch.Tensor:
        """``hidden_states[rows, layer]`` as fp32, dequantized where the values are fp8."""
        values = self.hidden_states[rows, layer]
        return values.float() if self.scales is None else fp8.dequantize(values, self.scales[rows, layer])


def decode_states(
    cell: memoryview | bytes,
    *,
    store_dtype: str,
    n_layers: int,
    hidden: int,
    out_dtype: torch.dtype,
    keep_fp8: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One row's ``hidden_states`` cell, for a shard reader and the online stream alike: (states
    [T-1, L, H], None), or with ``keep_fp8`` and an fp8 store dtype (fp8 values, their scales)
    as :attr:`ShardSequence.scales` says."""
    layout = dict(n_layers=n_layers, hidden=hidden)
    if keep_fp8 and store_dtype in fp8.FORMATS:
        return split_scaled(cell, dtype=store_dtype, **layout)
    return decode_hidden_states(cell, dtype=store_dtype, out_dtype=out_dtype, **layout), None


class ShardDataset:
    """Random access by sequence over one split of a dataset directory. ``states_dtype`` is what
    fp8 shards dequantize into (the training dtype); 16/32-bit shards return their stored dtype
    as zero-copy views, which the trainer casts with the batch. ``keep_fp8``: fp8 shards return
    their values and scales as zero-copy views too (:attr:`ShardSequence.scales`), so the batch
    carries a byte per value to the device, which dequantizes it (:meth:`Batch.to`); the host
    then never spends a multiply per value (about 5k K3 tokens/s per core, the data loader's
    bottleneck at K3 width). ``limit``: only the first ``limit`` sequences of the split
    (``data.train_sequences``)."""

    def __init__(
        self,
        directory: str | Path,
        split: str = "train",
        *,
        require_complete: bool = True,
        states_dtype: torch.dtype = torch.float32,
        keep_fp8: bool = False,
        limit: Optional[int] = None,
    ):
        self.directory = Path(directory)
        self.states_dtype = states_dtype
        self.keep_fp8 = keep_fp8
        self.manifest = Manifest.load(self.directory)
        if require_complete and not self.manifest.complete:
            raise DatasetError(
                f"{self.directory / 'manifest.json'}: field 'complete' is false; finish or resume extraction first "
                "(the same command with stages=[extract] resumes it)"
            )
        self.split = split
        self.shards = [s for s in self.manifest.shards if s.split == split]
        self._batches: list[pa.RecordBatch] = []
        self._starts: list[int] = []  # global index of each batch's first row
        self._batch_shard: list[tuple[ShardInfo, int]] = []  # each batch's shard and its first row there
        total = 0
        for info in self.shards:
            first = 0
            for batch in self._open(info):
                self._batches.append(batch)
                self._starts.append(total)
                self._batch_shard.append((info, first))
                total += batch.num_rows
                first += batch.num_rows
        self._len = total if limit is None else min(total, limit)
        self.n_layers = len(self.manifest.layer_ids)
        self.hidden_size = self.manifest.hidden_size
        self.target_topk: Optional[list[SequenceTopK]] = None
        """Set by the trainer (:class:`dspark.data.target_topk.TargetTopK`): attached to every sequence read."""

    def _open(self, info: ShardInfo) -> list[pa.RecordBatch]:
        """The shard's memory-mapped Arrow cache, built once from the Parquet file after that file's
        size and SHA-256 matched the manifest and every row passed :func:`check_row` (the cache's
        name carries the verified hash, so only a verified shard produces one), and checked before
        each reuse as :mod:`dspark.core.derived_files` says: its size and SHA-256 recorded at build, a
        damaged cache rebuilt from the shard with a warning."""

        def build(tmp: Path) -> None:
            table = self._read_shard(info)
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
                writer.write_table(table, max_chunksize=16)

        cache = derived_files.reuse_or_build(
            cache_path(self.directory, info), build, what="Arrow cache", source=arrow_cache_source(info)
        )
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(cache), "r"))
            return [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except (pa.ArrowException, OSError) as e:
            raise DatasetError(
                f"{cache}: damaged Arrow cache ({type(e).__name__}: {e}); delete {cache.parent.parent} (it is rebuilt "
                "from the shards) and run again"
            ) from e

    def _read_shard(self, info: ShardInfo) -> pa.Table:
        """One Parquet shard, checked by :func:`~dspark.formats.shard_rows.read_shard` (the check
        ``data_tools.verify`` makes); any problem is a :class:`DatasetError` that says how to check
        the dataset and rebuild the shard."""
        table, problem, bad_rows = read_shard(self.directory, info, self.manifest)
        problem = problem or next(iter(bad_rows.values()), None)
        if problem:
            shard = self.directory / info.path
            raise DatasetError(
                f"{problem}. Check the dataset: python -m data_tools.verify {self.directory} --recompute 0; "
                f"re-extract the shard: delete {shard} and run stages=[extract] again with the same settings "
                "(complete shards are kept)"
            )
        assert table is not None
        return table

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> ShardSequence:
        seq = self.read(index)
        if self.target_topk is not None:
            seq.target_topk = self.target_topk[index]
        return seq

    def many(self, indices: list[int]) -> list[ShardSequence]:
        """The sequences at ``indices`` (what a micro batch reads)."""
        return [self[i] for i in indices]

    def tokens(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [T] int64, loss_mask [T] bool) of a sequence, its states not decoded (what
        counting tokens reads: :mod:`dspark.data.draft_vocab`)."""
        batch, row = self._locate(index)
        ids = batch.column("input_ids")[row].values.to_numpy(zero_copy_only=True)
        mask = batch.column("loss_mask")[row].values.to_numpy(zero_copy_only=True)
        return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(bool))

    def _locate(self, index: int) -> tuple[pa.RecordBatch, int]:
        if not 0 <= index < self._len:
            raise IndexError(f"sequence {index} out of range for {self._len} in {self.directory}/{self.split}")
        b = bisect.bisect_right(self._starts, index) - 1
        return self._batches[b], index - self._starts[b]

    def read(self, index: int) -> ShardSequence:
        """The sequence as stored (no cached target distribution attached)."""
        batch, row = self._locate(index)
        b = bisect.bisect_right(self._starts, index) - 1
        hs = batch.column("hidden_states")
        offsets = np.frombuffer(hs.buffers()[1], dtype=np.int64, count=len(hs) + 1, offset=hs.offset * 8)
        data = hs.buffers()[2]
        start, end = int(offsets[row]), int(offsets[row + 1])
        ids = batch.column("input_ids")[row].values.to_numpy(zero_copy_only=True)
        mask = batch.column("loss_mask")[row].values.to_numpy(zero_copy_only=True)
        scales = None
        if not self.n_layers:  # token-id shards: ids and loss mask only (data.mode=colocated reads them)
            states = torch.empty(len(ids) - 1, 0, self.hidden_size, dtype=self.states_dtype)
        else:
            states, scales = decode_states(
                memoryview(data)[start:end],
                store_dtype=self.manifest.dtype,
                n_layers=self.n_layers,
                hidden=self.hidden_size,
                out_dtype=self.states_dtype,
                keep_fp8=self.keep_fp8,
            )
        if scales is None and not bool(torch.isfinite(states).all()):  # fp8 kept as bytes: scales checked at build
            info, first = self._batch_shard[b]
            bad = ~torch.isfinite(states)
            token, layer, _ = (int(i) for i in bad.nonzero()[0])
            raise DatasetError(
                f"{self.directory / info.path}: row {first + row} (sequence {batch.column('seq_id')[row].as_py()}): "
                f"{int(bad.sum())} non-finite hidden-state values (first at token {token}, captured layer {layer}); "
                f"the target produced them or the shard was altered before its cache was built. Check it: "
                f"python -m data_tools.verify {self.directory} --recompute 4"
            )
        return ShardSequence(
            seq_id=batch.column("seq_id")[row].as_py(),
            input_ids=torch.from_numpy(ids.astype(np.int64)),
            loss_mask=torch.from_numpy(mask.astype(bool)),
            hidden_states=states,
            scales=scales,
        )

    def rank_indices(
        self, *, rank: int, world_size: int, seed: int = 0, epoch: int = 0, shuffle: bool = True
    ) -> list[int]:
        """This data-parallel rank's sequence indices for an epoch: one permutation shared by all
        ranks (seeded by seed and epoch), cut to a multiple of world_size, then strided."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        order = list(range(self._len))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        usable = (self._len // world_size) * world_size
        return order[:usable][rank::world_size]

    def iter_rank(
        self, *, rank: int, world_size: int, seed: int = 0, epoch: int = 0, start: int = 0
    ) -> Iterator[ShardSequence]:
        """Sequences for one rank and epoch, from position ``start`` (resume mid-epoch)."""
        for i in self.rank_indices(rank=rank, world_size=world_size, seed=seed, epoch=epoch)[start:]:
            yield self[i]


def require_dataset(directory: str | Path) -> Path:
    """``data.shards_dir`` holds a dataset (its manifest): checked before training writes anything."""
    directory = Path(directory).expanduser()
    if not (directory / MANIFEST).is_file():
        raise DatasetError(
            f"data.shards_dir={directory}: no dataset there (no {MANIFEST}), expected the shards the extract stage "
            "writes; run stages=[extract] first (the same command with stages=[extract,train]), or set "
            "data.shards_dir to an extracted dataset"
        )
    return directory


_EXTRACT_AGAIN = "extract for this target and these layers into a new data.shards_dir (stages=[extract,train])"


def check_dataset(
    ds: ShardDataset, *, expect_layer_ids: Optional[list[int]] = None, expect_hidden_size: Optional[int] = None
) -> ShardDataset:
    """Check a dataset was captured for the layers/width the drafter expects."""
    m, where = ds.manifest, ds.directory / "manifest.json"
    if expect_layer_ids is not None and list(m.layer_ids) != list(expect_layer_ids):
        raise DatasetError(
            f"{where}: field 'layer_ids' is {m.layer_ids}, the config expects {expect_layer_ids}; {_EXTRACT_AGAIN}"
        )
    if expect_hidden_size is not None and m.hidden_size != expect_hidden_size:
        raise DatasetError(
            f"{where}: field 'hidden_size' is {m.hidden_size}, the config expects {expect_hidden_size}; "
            + _EXTRACT_AGAIN
        )
    return ds


def open_dataset(directory: str | Path, split: str = "train", **expect: Optional[list[int] | int]) -> ShardDataset:
    """Open a split and check it (``expect_layer_ids``, ``expect_hidden_size``)."""
    return check_dataset(ShardDataset(directory, split), **expect)  # type: ignore[arg-type]
