"""Online training's consumer: micro-batches from a rolling window of the most recent sequences
an extraction engine streamed (``data.mode=online``; the producer is ``data_tools.online``).

Each micro batch takes the next ``new`` sequences from the source, in prompt order (waiting for
them is the step's data wait), adds them to the window, and trains on them together with
``micro_batch - new`` older sequences drawn from the window without replacement (fewer while the
window is still filling). The draw is seeded by the run's seed and the prompt cursor, so it
needs no RNG state in the checkpoint, and which prompts enter at which step does not depend on
how fast the engine is.

The data position is the prompt cursor: the index of the next prompt whose sequence has not
entered the window (``DataPosition(epoch=pass, index=position in the pass)``, saved by the
trainer like the offline position). A resumed run starts the engine there: sequences produced
but not yet entered when the run was killed are generated again (they were never trained on).
The window itself is not checkpointed (for Kimi K3 it would be hundreds of GB): a resumed run
starts with an empty window, so its first micro batches draw from fewer old sequences than the
uninterrupted run's did; which prompts enter, and when, is the same.

Several training ranks: rank 0 reads the source and hands each rank its ``new`` sequences of
every micro batch (torch.distributed ``scatter_object_list``); each rank keeps its own window
of ``window_size`` and draws with its rank in the seed.

"Neither repeats nor skips": the prompts that entered the window, over a killed run and its
resume, are the uninterrupted run's list: every index in order, each once (a prompt too long
for the window, which offline extraction would skip too, is the only gap). The list is kept in
``<checkpoint_dir>/online_prompts.jsonl``: appended at each checkpoint, and cut back to the
checkpoint's cursor when a run resumes (entries of a killed run after its last checkpoint).
"""

from __future__ import annotations

import json
import logging
import random
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from dspark.core.atomic_files import atomic_write_text
from dspark.data.batching import Batch, DataPosition, collate
from dspark.data.shards import ShardSequence, decode_states
from dspark.data.target_topk import SequenceTopK
from dspark.formats.shard_format import DatasetError
from dspark.formats.stream import SequenceSource, StreamItem, StreamMeta

log = logging.getLogger(__name__)

PROMPT_LOG = "online_prompts.jsonl"


def row_to_sequence(row: dict[str, Any], meta: StreamMeta, dtype: torch.dtype) -> ShardSequence:
    """A streamed row (a shard row's fields, by name) -> the :class:`ShardSequence` the trainer
    reads. fp8 rows stay fp8 (values and scales, a byte per value in the window) until the batch is
    on the device (:meth:`dspark.data.batching.Batch.to`)."""
    states, scales = decode_states(
        row["hidden_states"],
        store_dtype=meta.store_dtype,
        n_layers=meta.n_layers,
        hidden=meta.hidden_size,
        out_dtype=dtype,
        keep_fp8=True,
    )
    return ShardSequence(
        seq_id=row["seq_id"],
        input_ids=torch.tensor(row["input_ids"], dtype=torch.long),
        loss_mask=torch.tensor(row["loss_mask"], dtype=torch.bool),
        hidden_states=states,
        scales=scales,
    )


class SequenceList:
    """In-memory sequences with the dataset interface the trainer's validation reads."""

    def __init__(self, seqs: list[ShardSequence]):
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> ShardSequence:
        return self.seqs[i]

    def many(self, indices: list[int]) -> list[ShardSequence]:
        return [self.seqs[i] for i in indices]


def _broadcast(obj: Any, rank: int, world: int) -> Any:
    if world == 1:
        return obj
    import torch.distributed as dist

    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def stream_meta(source: Optional[SequenceSource], rank: int, world: int) -> StreamMeta:
    """The stream's :class:`StreamMeta`, which only rank 0 (the source's holder) knows, on every rank."""
    return _broadcast(source.meta if rank == 0 and source is not None else None, rank, world)


def shared_val_rows(source: Optional[SequenceSource], rank: int, world: int) -> list[dict[str, Any]]:
    """The validation rows, read by rank 0 and given to every rank (validation shards them)."""
    return _broadcast(source.val_rows() if rank == 0 else None, rank, world)


def check_source(meta: StreamMeta, *, expect_layer_ids: list[int], expect_hidden_size: int) -> None:
    if list(meta.layer_ids) != list(expect_layer_ids) or meta.hidden_size != expect_hidden_size:
        raise DatasetError(
            f"online source captures layers {meta.layer_ids} of width {meta.hidden_size}, the drafter expects "
            f"{expect_layer_ids} of width {expect_hidden_size}"
        )


class OnlineBatches:
    """Endless micro-batches from a :class:`SequenceSource`, resumable from a DataPosition.
    ``source`` on rank 0 only; ``meta`` on every rank."""

    def __init__(
        self,
        source: Optional[SequenceSource],
        *,
        meta: StreamMeta,
        micro_batch: int,
        new_per_batch: int,
        window_size: int,
        seed: int,
        context_index: list[int],
        final_index: int,
        max_len: int,
        dtype: torch.dtype,
        position: Optional[DataPosition] = None,
        log_dir: Optional[Path] = None,
        target_topk: Optional[Callable[[ShardSequence], SequenceTopK]] = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not 1 <= new_per_batch <= micro_batch <= window_size:
            raise ValueError(f"expected 1 <= new {new_per_batch} <= micro batch {micro_batch} <= window {window_size}")
        self.source, self.mb, self.new, self.seed = source, micro_batch, new_per_batch, seed
        self.rank, self.world, self.num_prompts, self.meta, self.dtype = rank, world_size, meta.num_prompts, meta, dtype
        self.collate_kw = dict(context_index=context_index, final_index=final_index, max_len=max_len)
        self.window: deque[ShardSequence] = deque(maxlen=window_size)
        self.target_topk = target_topk
        self.pos = position or DataPosition()
        self.cursor = self.pos.epoch * meta.num_prompts + self.pos.index
        self.entered: list[dict[str, Any]] = []  # since the last flush to the prompt log (rank 0)
        self.log_path = None if log_dir is None or rank != 0 else Path(log_dir) / PROMPT_LOG
        if self.log_path is not None:
            self._cut_log()
        if rank == 0:
            assert source is not None, "rank 0 reads the stream"
            source.start(self.cursor)
        log.info(
            "online: from prompt %d (pass %d), %d new + %d from a window of %d per micro batch",
            self.cursor,
            self.pos.epoch,
            self.new,
            self.mb - self.new,
            window_size,
        )

    def _cut_log(self) -> None:
        """Keep the entries before the cursor: those the checkpoint we resume from trained on."""
        assert self.log_path is not None
        if not self.log_path.is_file():
            return
        lines = self.log_path.read_text().splitlines()
        keep = [ln for ln in lines if ln.strip() and json.loads(ln)["index"] < self.cursor]
        if len(keep) != len(lines):
            log.info(
                "online: %d entries after the checkpoint's cursor dropped from %s",
                len(lines) - len(keep),
                self.log_path,
            )
            atomic_write_text(self.log_path, "".join(ln + "\n" for ln in keep))

    def _take(self) -> StreamItem:
        """Rank 0: the next sequence in prompt order, logged as entered."""
        assert self.source is not None
        item: StreamItem = self.source.get()
        if item.index < self.cursor:
            raise RuntimeError(f"online source sent prompt {item.index}, expected {self.cursor} or later")
        self.entered.append({"index": item.index, "seq_id": item.row["seq_id"]})
        self.cursor = item.index + 1
        return item

    def _fetch(self) -> list[StreamItem]:
        """This rank's new sequences for one micro batch (rank 0 takes every rank's and scatters)."""
        if self.world == 1:
            return [self._take() for _ in range(self.new)]
        import torch.distributed as dist

        chunks = None
        if self.rank == 0:
            items = [self._take() for _ in range(self.new * self.world)]
            chunks = [(items[r * self.new : (r + 1) * self.new], self.cursor) for r in range(self.world)]
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, chunks, src=0)
        items, self.cursor = mine[0]
        return items

    def _sequence(self, item: StreamItem) -> ShardSequence:
        seq = row_to_sequence(item.row, self.meta, self.dtype)
        if self.target_topk is not None:
            seq.target_topk = self.target_topk(seq)
        return seq

    def next(self) -> Batch:
        old = list(self.window)
        rng = random.Random(f"online:{self.seed}:{self.rank}:{self.cursor}")
        new = [self._sequence(item) for item in self._fetch()]
        drawn = rng.sample(old, min(self.mb - self.new, len(old)))
        self.window.extend(new)
        self.pos = DataPosition(self.cursor // self.num_prompts, self.cursor % self.num_prompts)
        return collate(new + drawn, **self.collate_kw)

    def flush_log(self) -> None:
        """Append what entered since the last call to the prompt log (before a checkpoint is written)."""
        if self.log_path is None or not self.entered:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write("".join(json.dumps(e) + "\n" for e in self.entered))
        self.entered = []

    def stats(self) -> Optional[dict[str, float]]:
        return None if self.source is None else self.source.stats().as_dict()


def read_prompt_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
