"""Online training's hand-off: finished sequences from an extraction engine to the trainer.

The producer (``data_tools.online``: a vLLM engine on the same capture path as offline
extraction) and the consumer (``dspark.data.online``: the trainer's rolling window) meet here, in
the formats wing below both stages, so that neither imports the other (tests/test_layering.py).

A sequence travels as the row offline extraction would write to a shard (``seq_id``,
``num_tokens``, ``input_ids``, ``loss_mask``, ``hidden_states`` encoded in ``data.store_dtype``)
plus its prompt index: the position in the ordered train prompt set, counted across passes
(``index = pass * num_prompts + i``). Indexes come in increasing order; a prompt that yields no
sequence (too long for the window, skipped) leaves a gap.

:class:`BoundedBuffer` is the one-machine transport: a queue of at most ``capacity`` sequences.
A full buffer blocks the producer (a slow trainer never makes it grow); an empty one blocks the
consumer (a slow producer shows as the trainer's data wait). Across nodes the same
:class:`SequenceSource` interface is implemented over torch.distributed: the link and the
messages it carries are :mod:`dspark.formats.stream_link`, each side's loop over it
:mod:`dspark.formats.stream_remote` (docs/architecture.md, "Online training across nodes").

Several producers (``data.online.producers``: data-parallel engines, each its own job step and
link, on ports ``data.online.port + k``) split the prompts in blocks of ``data.batch_size``
counted from the cursor: producer ``k`` of ``n`` answers blocks ``k, k + n, k + 2n, ...``
(:func:`producer_blocks`) and ends each with a :data:`BLOCK_END` message. The trainer reads the
blocks back in order (block ``b`` from producer ``b % n``), so the sequences enter in the same
prompt order as from one producer, whatever each engine's speed: the cursor, the prompt log and a
resume mean the same.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterator, Optional, Protocol

from dspark.formats.frames import (
    FRAME_PREFIX,
    MAX_HEADER_BYTES,
    StreamError,
)
from dspark.formats.shard_format import (
    STORE_DTYPES,
    bytes_per_token,
    field_problem,
    layer_ids_problem,
)

log = logging.getLogger(__name__)


@dataclass
class StreamItem:
    index: int
    """The prompt's position in the train prompt order, counted across passes."""
    row: dict[str, Any]
    """The shard row offline extraction would write for it."""


VAL_ROW = -2
"""The index a validation sequence travels with."""
VAL_END = -1
"""The index of the (empty) message that ends the validation set."""
STREAM_END = -4
"""The index of a producer's last message, sent once it has seen the trainer's ``stop``."""
BLOCK_END = -3
"""The index of the message that ends one of a producer's blocks; its row: ``{"end": the index after the block}``."""


@dataclass
class StreamStats:
    """The producer's side, for the training log: how fast the engine makes sequences and how
    long it waited on a full buffer (the trainer being slower)."""

    sequences: int = 0
    tokens: int = 0
    engine_s: float = 0.0
    """Seconds inside the engine (generate + capture)."""
    blocked_s: float = 0.0
    """Seconds the producer waited on a full buffer."""
    started: float = field(default_factory=time.perf_counter)

    def as_dict(self) -> dict[str, float]:
        return {
            "sequences": self.sequences,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / max(self.engine_s, 1e-9),
            "engine_s": self.engine_s,
            "blocked_s": self.blocked_s,
        }


def _json(*types: type, minimum: Optional[int] = None) -> dict[str, Any]:
    return {"types": types, "minimum": minimum}


@dataclass(frozen=True)
class StreamMeta:
    """What a stream of rows is, declared once: a producer sends it (:meth:`as_json`), the trainer
    checks it as data (:meth:`from_json`), and every rank decodes the rows by it."""

    layer_ids: tuple[int, ...] = field(metadata=_json(list))
    """Captured layers, final state last (as a shard manifest's ``layer_ids``)."""
    hidden_size: int = field(metadata=_json(int, minimum=1))
    store_dtype: str = field(metadata=_json(str))
    """How ``hidden_states`` is encoded (``data.store_dtype``)."""
    num_prompts: int = field(metadata=_json(int, minimum=1))
    """Train prompts in one pass."""
    max_seq_len: int = field(metadata=_json(int, minimum=1))
    """Bounds every row, so every frame the trainer accepts (``data.max_seq_len``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "layer_ids": list(self.layer_ids)}

    @classmethod
    def from_json(cls, meta: Any, where: str) -> StreamMeta:
        """A producer's description of its stream, checked as data the way a manifest is (each
        field's type and range, the layer ids, a store dtype this code decodes); one
        :class:`StreamError` naming the field. Keys it does not declare (the link's) are left."""
        names = [f.name for f in fields(cls)]
        if not isinstance(meta, dict):
            raise StreamError(f"{where}: meta is {meta!r:.60}, expected a JSON object with {sorted(names)}")
        for f in fields(cls):
            problem = field_problem("meta field ", f.name, meta.get(f.name), f.metadata["types"], f.metadata["minimum"])
            if problem:
                raise StreamError(f"{where}: {problem}")
        problem = layer_ids_problem("meta field ", meta["layer_ids"])
        if problem:
            raise StreamError(f"{where}: {problem}")
        if meta["store_dtype"] not in STORE_DTYPES:
            raise StreamError(f"{where}: meta field 'store_dtype' is {meta['store_dtype']!r}, expected one of "
                              f"{sorted(STORE_DTYPES)}")  # fmt: skip
        return cls(**{n: meta[n] for n in names})

    def frame_bound(self) -> int:
        """The largest frame this stream carries: a row of ``max_seq_len`` tokens (its states in
        the store dtype, ids as int64, the loss mask), its JSON header and the frame prefix."""
        per_token = bytes_per_token(self.store_dtype, n_layers=self.n_layers, hidden=self.hidden_size)
        return FRAME_PREFIX.size + MAX_HEADER_BYTES + self.max_seq_len * (per_token + 8 + 8)


class SequenceSource(Protocol):
    """What the online trainer reads from. One implementation per transport: in-process
    (``data_tools.online.VllmSource``), and across nodes over torch.distributed."""

    meta: StreamMeta
    """What the stream's rows are."""

    def val_rows(self) -> list[dict[str, Any]]:
        """The validation split's sequences, generated once."""
        ...

    def start(self, cursor: int) -> None:
        """Produce train sequences from prompt index ``cursor`` on."""
        ...

    def get(self) -> StreamItem:
        """The next sequence in prompt order; blocks until there is one."""
        ...

    def stats(self) -> StreamStats: ...

    def close(self) -> None:
        """Stop producing and release the engine."""
        ...


class StreamClosed(RuntimeError):
    """The buffer was closed while waiting on it."""


class BoundedBuffer:
    """A FIFO of at most ``capacity`` items between one producer thread and one consumer, with
    close (either side stops the other) and the producer's error handed to the consumer."""

    def __init__(self, capacity: int, *, poll_s: float = 0.1):
        self._q: queue.Queue = queue.Queue(maxsize=capacity)
        self._closed = threading.Event()
        self._error: Optional[BaseException] = None
        self.poll_s = poll_s
        self.capacity = capacity

    def put(self, item: Any) -> float:
        """Blocks while the buffer is full; returns the seconds it waited. Raises StreamClosed
        once the consumer has closed it."""
        t0 = time.perf_counter()
        while not self._closed.is_set():
            try:
                self._q.put(item, timeout=self.poll_s)
                return time.perf_counter() - t0
            except queue.Full:
                continue
        raise StreamClosed("the consumer closed the buffer")

    def fail(self, error: BaseException) -> None:
        """The producer died: the consumer's next get raises ``error``."""
        self._error = error
        self._closed.set()

    def get(self, timeout_s: Optional[float] = None) -> Any:
        """Blocks while the buffer is empty (up to ``timeout_s``, then returns None); raises the
        producer's error, or StreamClosed."""
        t_end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                return self._q.get(timeout=self.poll_s)
            except queue.Empty:
                if self._error is not None:
                    raise self._error
                if self._closed.is_set():
                    raise StreamClosed("the producer closed the buffer")
                if t_end is not None and time.monotonic() >= t_end:
                    return None

    def qsize(self) -> int:
        return self._q.qsize()

    def close(self) -> None:
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()


def producer_blocks(cursor: int, block: int, rank: int = 0, producers: int = 1) -> Iterator[list[int]]:
    """The prompt indexes producer ``rank`` of ``producers`` answers from ``cursor`` on: blocks of
    ``block`` consecutive indexes, every ``producers``-th block starting at its rank (all
    producers' blocks together cover every index from the cursor once)."""
    j = rank
    while True:
        start = cursor + j * block
        yield list(range(start, start + block))
        j += producers


class BlockProducer:
    """The producer loop every engine shares: a thread answers this producer's blocks of prompt
    indexes (:func:`producer_blocks`) with :meth:`capture` and puts each sequence, then the
    block's :data:`BLOCK_END`, into a :class:`BoundedBuffer` (a full buffer stops it: a slow
    trainer never makes it grow). :meth:`get` is the :class:`SequenceSource` read (sequences
    only); :meth:`next_message` also returns the block ends a link forwards to the trainer.
    Subclasses set ``meta`` (:class:`StreamMeta`) and implement :meth:`capture`."""

    meta: StreamMeta

    def __init__(self, *, block: int, buffer_size: int, rank: int = 0, producers: int = 1, poll_s: float = 0.1):
        if not 0 <= rank < producers:
            raise ValueError(f"producer rank {rank}: expected 0 <= rank < producers={producers}")
        self.block, self.rank, self.producers = block, rank, producers
        self.buffer = BoundedBuffer(buffer_size, poll_s=poll_s)
        self._stats = StreamStats()
        self._thread: Optional[threading.Thread] = None
        self.started_at: list[int] = []

    def capture(self, indexes: list[int]) -> list[tuple[int, dict[str, Any]]]:
        """(index, row) for each prompt of ``indexes`` that yields a sequence, in index order."""
        raise NotImplementedError

    def start(self, cursor: int) -> None:
        assert self._thread is None, "started twice"
        self.started_at.append(cursor)
        self._thread = threading.Thread(target=self._produce, args=(cursor,), name="online-producer", daemon=True)
        self._thread.start()

    def _produce(self, cursor: int) -> None:
        empty = 0  # prompt indexes in a row without a sequence (one producer): a whole pass is an error
        try:
            for indexes in producer_blocks(cursor, self.block, self.rank, self.producers):
                if self.buffer.closed:
                    return
                got = self.capture(indexes)
                self._stats.sequences += len(got)
                self._stats.tokens += sum(int(row["num_tokens"]) for _, row in got)
                empty = 0 if got else empty + len(indexes)
                if self.producers == 1 and empty >= self.meta.num_prompts:
                    raise ValueError(no_prompt_fits(self.meta.num_prompts, dict(getattr(self, "skipped", {}))))
                for i, row in got:
                    self._stats.blocked_s += self.buffer.put(StreamItem(i, row))
                self._stats.blocked_s += self.buffer.put(StreamItem(BLOCK_END, {"end": indexes[-1] + 1}))
        except StreamClosed:
            return
        except BaseException as e:  # handed to the reader, which raises it
            log.error("online producer stopped: %s: %s", type(e).__name__, e)
            self.buffer.fail(e)

    def next_message(self, timeout_s: Optional[float] = None) -> Optional[StreamItem]:
        """The next sequence or block end, in order (None when none came within ``timeout_s``);
        raises the producer's error."""
        return self.buffer.get(timeout_s)

    def get(self) -> StreamItem:
        while True:
            item = self.buffer.get()
            if item.index != BLOCK_END:
                return item

    def stats(self) -> StreamStats:
        return self._stats

    def stop_thread(self, *, interrupt: Any = None) -> None:
        """Close the buffer and let the thread end (``interrupt()``: called when it is still busy
        after a second, e.g. inside an engine call that would take minutes)."""
        self.buffer.close()
        if self._thread is not None:
            self._thread.join(timeout=1)
            if self._thread.is_alive() and interrupt is not None:
                interrupt()
            self._thread.join(timeout=600)
            self._thread = None


def no_prompt_fits(num_prompts: int, skipped: Optional[dict] = None) -> str:
    why = f"skipped: {skipped}" if skipped else "too long for data.max_seq_len?"
    return f"online: none of the {num_prompts} train prompts gave a sequence in a whole pass ({why})"
