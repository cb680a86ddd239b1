"""Online training's hand-off: finished sequences from an extraction engine to the trainer.

The producer (``data_tools.online``: a vLLM engine on the same capture path as offline
extraction) and the consumer (``dspark.online``: the trainer's rolling window) meet here, in
the core, so that neither imports the other (tests/test_layering.py).

A sequence travels as the row offline extraction would write to a shard (``seq_id``,
``num_tokens``, ``input_ids``, ``loss_mask``, ``hidden_states`` encoded in ``data.store_dtype``)
plus its prompt index: the position in the ordered train prompt set, counted across passes
(``index = pass * num_prompts + i``). Indexes come in increasing order; a prompt that yields no
sequence (too long for the window, skipped) leaves a gap.

:class:`BoundedBuffer` is the one-machine transport: a queue of at most ``capacity`` sequences.
A full buffer blocks the producer (a slow trainer never makes it grow); an empty one blocks the
consumer (a slow producer shows as the trainer's data wait). Across nodes the same
:class:`SequenceSource` interface is implemented over torch.distributed (docs/architecture.md,
"Online training across nodes").

Across nodes (``data.online.trainer_addr`` set) the producer is its own job step
(``python -m data_tools.online``, on the extraction nodes) and :class:`StreamLink` carries the
sequences to the trainer's rank 0 over torch.distributed: a two-process gloo group of its own
(the trainer's DeepSpeed group is untouched) on a TCPStore that the trainer hosts. The store
carries the control values (the producer's description of its stream, the trainer's cursor,
the producer's rates); gloo carries each sequence as a header (index, size) and its row as a
frame (:func:`~dspark.core.frames.encode_row`): a fixed prefix, a JSON header naming each field's kind, dtype from an
allow-list, shape and byte count, then the raw buffers. Decoding a frame runs no code of the
sender's (no pickle): :func:`~dspark.core.frames.decode_row` and :meth:`StreamLink.recv` refuse, with a
:class:`StreamError` naming the message and field, anything but a well-formed frame of the
messages the stream carries (docs/faults.md, "What trusts its input"). A gloo send completes
only once the receiver has posted the matching receive, and the trainer's receiving thread posts
one only when its buffer has room: the back-pressure reaches the engine.
:class:`RemoteSource` is the trainer's side.

Several producers (``data.online.producers``: data-parallel engines, each its own job step and
link, on ports ``data.online.port + k``) split the prompts in blocks of ``data.batch_size``
counted from the cursor: producer ``k`` of ``n`` answers blocks ``k, k + n, k + 2n, ...`` and
ends each with a :data:`BLOCK_END` message. The trainer reads the blocks back in order (block
``b`` from producer ``b % n``), so the sequences enter in the same prompt order as from one
producer, whatever each engine's speed: the cursor, the prompt log and a resume mean the same.
"""

from __future__ import annotations

import datetime
import json
import logging
import queue
import socket
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterator, Optional, Protocol

import pyarrow as pa
import torch

from dspark.core.config import ConfigError
from dspark.core.frames import (
    FRAME_PREFIX,
    MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    StreamError,
    decode_row,
    encode_row,
    value_kind,
)
from dspark.core.shard_format import (
    SCHEMA,
    STORE_DTYPES,
    bytes_per_token,
    check_row,
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


# --- across nodes: torch.distributed ------------------------------------------------------------

TRAINER, PRODUCER = 0, 1


def _frame_kind(t: pa.DataType) -> str:
    if pa.types.is_string(t):
        return "str"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_list(t) and pa.types.is_integer(t.value_type):
        return "ints"
    assert pa.types.is_large_binary(t), f"no frame kind for the shard column type {t}"
    return "bytes"


MESSAGE_FIELDS = {
    "row": {f.name: _frame_kind(f.type) for f in SCHEMA},
    BLOCK_END: {"end": "int"},
    VAL_END: {},
    STREAM_END: {},
}
"""The fields (name -> frame kind) of each message the link carries: a train (index >= 0) or
validation (:data:`VAL_ROW`) sequence has a shard row's columns; the others are control messages."""


def message_fields(index: int, what: str) -> dict[str, str]:
    """The fields a message with this index has (:data:`MESSAGE_FIELDS`); refuses an index the
    stream does not use."""
    want = MESSAGE_FIELDS.get("row" if index >= 0 or index == VAL_ROW else index)
    if want is None:
        raise StreamError(
            f"{what}: index {index}, expected a prompt index >= 0 or a control index "
            f"{sorted([VAL_ROW, *(k for k in MESSAGE_FIELDS if k != 'row')])}"
        )
    return want


def check_message(item: StreamItem, what: str) -> None:
    """Refuse a decoded message whose fields are not those its index says (:data:`MESSAGE_FIELDS`)."""
    want = message_fields(item.index, what)
    got = {name: value_kind(value) for name, value in item.row.items()}
    if got != want:
        raise StreamError(f"{what} (index {item.index}): fields {got}, expected {want}")


class StreamLink:
    """The trainer's rank 0 (``role="trainer"``, hosts the TCPStore on ``port``) and one producer
    (``role="producer"``), in a two-process gloo group of their own. A message is a header tensor
    (index, frame bytes) and the frame (:func:`~dspark.core.frames.encode_row`); :meth:`recv` refuses one that is not
    a frame of a message the stream carries, and a declared size above ``max_frame_bytes`` before
    allocating it."""

    def __init__(self, host: str, port: int, *, role: str, timeout_s: float, max_frame_bytes: int = MAX_FRAME_BYTES):
        import torch.distributed as dist

        self.rank = {"trainer": TRAINER, "producer": PRODUCER}[role]
        timeout = datetime.timedelta(seconds=timeout_s)
        self._listener = listen_on(host, port) if self.rank == TRAINER else None
        try:
            self.store = dist.TCPStore(
                host,
                port,
                2,
                self.rank == TRAINER,
                timeout=timeout,
                # the store listens on data.online.trainer_addr's interface only, not on every one
                master_listen_fd=self._listener.fileno() if self._listener is not None else None,
            )
        except dist.DistError as e:  # the other side never came
            if self.rank == TRAINER:
                raise StreamError(
                    f"online: no producer connected to {host}:{port} within data.online.connect_timeout_s="
                    f"{timeout_s:g} s ({type(e).__name__}); start it (python -m data_tools.online ... with "
                    f"data.online.trainer_addr={host}) or raise data.online.connect_timeout_s"
                ) from None
            raise StreamError(
                f"online: no trainer store at {host}:{port} within data.online.connect_timeout_s={timeout_s:g} s "
                f"({type(e).__name__}); start the trainer first, or raise data.online.connect_timeout_s"
            ) from None
        self.pg = dist.ProcessGroupGloo(self.store, self.rank, 2, timeout)
        self.peer = 1 - self.rank
        self.where, self.max_frame_bytes, self.received = f"{host}:{port}", max_frame_bytes, 0
        self.timeout_s = timeout_s

    def send(self, item: StreamItem) -> None:
        """Send one item; it completes when the peer has taken it."""
        frame = encode_row(item.row)
        self.pg.send([torch.tensor([item.index, len(frame)], dtype=torch.int64)], self.peer, 0).wait()
        self.pg.send([torch.frombuffer(frame, dtype=torch.uint8)], self.peer, 1).wait()

    def recv(self) -> StreamItem:
        header = torch.zeros(2, dtype=torch.int64)
        self.pg.recv([header], self.peer, 0).wait()
        index, size = (int(v) for v in header)
        self.received += 1
        what = f"online: message {self.received} on the link at {self.where}"
        message_fields(index, what)
        if not FRAME_PREFIX.size <= size <= self.max_frame_bytes:
            raise StreamError(
                f"{what} (index {index}): declares a frame of {size} bytes, expected {FRAME_PREFIX.size} to "
                f"{self.max_frame_bytes}"
            )
        payload = torch.empty(size, dtype=torch.uint8)
        self.pg.recv([payload], self.peer, 1).wait()
        item = StreamItem(index, decode_row(payload.numpy(), what=what))
        check_message(item, what)
        return item

    def set(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str) -> Any:
        """Blocks until the other side has set ``key`` (up to the link's timeout); a value that is
        not JSON is a :class:`StreamError` naming the key."""
        import torch.distributed as dist

        try:
            raw = self.store.get(key)
        except dist.DistError:
            raise StreamError(
                f"online: {key!r} did not arrive on the link at {self.where} within data.online.connect_timeout_s="
                f"{self.timeout_s:g} s; the other side connected but did not send it (start it again, or raise "
                "data.online.connect_timeout_s)"
            ) from None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StreamError(f"online: the link at {self.where} carries {key!r} that is not JSON ({e})") from None

    def has(self, key: str) -> bool:
        return self.store.check([key])


class RemoteSource:
    """The trainer's side of the producers on other nodes (``python -m data_tools.online``): a
    :class:`SequenceSource` over one link per producer (ports ``port .. port + producers - 1``),
    each read by a thread into its own :class:`BoundedBuffer`, merged back into prompt order
    block by block (module docstring)."""

    def __init__(self, host: str, port: int, *, buffer_size: int, timeout_s: float, producers: int = 1):
        log.info(
            "online: waiting for %d producer(s) to connect to %s:%d..%d (up to %.0f s)",
            producers,
            host,
            port,
            port + producers - 1,
            timeout_s,
        )
        self.links, said, metas = [], [], []
        for k in range(producers):
            self.links.append(StreamLink(host, port + k, role="trainer", timeout_s=timeout_s))
            said.append(self.links[-1].get("meta"))
            metas.append(StreamMeta.from_json(said[-1], f"online: producer {k} on {host}:{port + k}"))
            # the largest frame this stream can carry, not the link's default bound
            self.links[-1].max_frame_bytes = metas[-1].frame_bound()
        check_producers(said, metas, producers, port)
        self.meta = meta = metas[0]
        self.buffers = [BoundedBuffer(buffer_size) for _ in range(producers)]
        self._threads: list[threading.Thread] = []
        self._block = 0  # the next block, read from producer block % producers
        self._last = -1  # the last index handed out (or the cursor - 1)
        log.info("online: producer connected (%d in all): %s", producers, meta)

    def val_rows(self) -> list[dict[str, Any]]:
        """Producer 0's validation rows (the others send only the end of the set)."""
        rows = []
        for k in range(len(self.links)):
            while True:
                item = self._recv(k, expect=(VAL_ROW, VAL_END))
                if item.index == VAL_END:
                    break
                if k:
                    raise RuntimeError(f"online: producer {k} sent a validation row; only producer 0 makes them")
                rows.append(item.row)
        return rows

    def _recv(self, k: int, *, expect: tuple[int, ...]) -> StreamItem:
        """Producer k's next message, refused (:class:`StreamError`) unless its index is among
        ``expect`` (a prompt index >= 0 where ``expect`` holds 0) and a sequence's row has the
        byte counts of the stream's layers, width and dtype (``shard_format.check_row``)."""
        item = self.links[k].recv()
        kind = 0 if item.index >= 0 else item.index
        if kind not in expect:
            raise StreamError(
                f"online: producer {k} sent a message with index {item.index} where the stream has one of {expect} "
                "(0: a prompt index >= 0)"
            )
        if kind in (0, VAL_ROW):
            m = self.meta
            n_layers = m.n_layers
            bad = check_row(item.row, n_layers=n_layers, hidden_size=m.hidden_size, dtype=m.store_dtype)
            if bad:
                raise StreamError(
                    f"online: producer {k} sent sequence {item.row['seq_id']!r} (index {item.index}) that does not fit "
                    f"its stream ({n_layers} layers x {m.hidden_size}, {m.store_dtype}): {bad}"
                )
        return item

    def start(self, cursor: int) -> None:
        self._last = cursor - 1
        for k, link in enumerate(self.links):
            link.set("cursor", cursor)
            t = threading.Thread(target=self._receive, args=(k,), name=f"online-receiver-{k}", daemon=True)
            t.start()
            self._threads.append(t)

    def _receive(self, k: int) -> None:
        """Producer k's messages into its buffer; a receive is posted only when the last item
        found room (the back-pressure). Once the trainer closed the source, what the producer
        still sends is taken and dropped up to its :data:`STREAM_END` (it would otherwise wait
        in a send that no receive takes, until the link's timeout)."""
        buffer, link = self.buffers[k], self.links[k]
        try:
            while True:
                item = self._recv(k, expect=(0, BLOCK_END, STREAM_END))
                if item.index == STREAM_END:
                    return
                if not buffer.closed:
                    try:
                        buffer.put(item)
                    except StreamClosed:
                        pass
        except StreamError as e:  # not what this code's producer sends: a rerun would not help
            if not buffer.closed:
                buffer.fail(e)
        except BaseException as e:  # the producer died or the link broke: the trainer raises it
            if not buffer.closed:
                why = f"{type(e).__name__}: {e}"
                try:
                    if link.has("error"):  # the producer's own error, if it could say it
                        why = f"{link.get('error')} (then the link broke: {why})"
                except Exception:  # noqa: BLE001 - the store is this process's; keep the link's error
                    pass
                buffer.fail(producer_failed(k, why))

    def get(self) -> StreamItem:
        """The next sequence in prompt order: block ``b``'s sequences come from producer
        ``b % producers``, up to its block end."""
        while True:
            k = self._block % len(self.links)
            item = self.buffers[k].get(timeout_s=1.0)
            if item is None:  # nothing yet: has the producer said it failed? (its process may linger)
                if self.links[k].has("error"):
                    raise producer_failed(k, self.links[k].get("error"))
                continue
            if item.index != BLOCK_END:
                self._last = item.index
                return item
            self._block += 1
            if item.row["end"] - 1 - self._last >= self.meta.num_prompts:
                raise ValueError(no_prompt_fits(self.meta.num_prompts))

    def stats(self) -> StreamStats:
        """The producers' numbers, as each last published them, together: sequences and tokens
        summed, engine and blocked seconds the longest (the engines run side by side)."""
        parts = []
        for link in self.links:
            if link.has("stats"):
                d = link.get("stats")
                parts.append(StreamStats(d["sequences"], d["tokens"], d["engine_s"], d["blocked_s"]))
        return StreamStats(
            sequences=sum(p.sequences for p in parts),
            tokens=sum(p.tokens for p in parts),
            engine_s=max((p.engine_s for p in parts), default=0.0),
            blocked_s=max((p.blocked_s for p in parts), default=0.0),
        )

    def close(self, wait_s: float = 30) -> None:
        """Tell the producers to stop and wait (up to ``wait_s``) until each has sent its end:
        a receiving thread still inside a gloo receive when the process exits aborts it."""
        for buffer in self.buffers:
            buffer.close()
        for link in self.links:
            try:
                link.set("stop", True)
            except Exception:  # noqa: BLE001 - the producer or the store may be gone already
                pass
        t_end = time.monotonic() + wait_s
        for k, t in enumerate(self._threads):
            t.join(max(0.0, t_end - time.monotonic()))
            if t.is_alive():
                log.warning("online: producer %d did not end its stream within %.0f s of the stop", k, wait_s)


def producer_failed(k: int, why: str) -> RuntimeError:
    return RuntimeError(
        f"online: producer {k} failed: {why}; rerun the job (trainer and producers) to resume from the last checkpoint"
    )


def listen_on(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``'s interface (the TCPStore's, handed to it by descriptor): a
    trainer at 127.0.0.1 is not reachable from other machines. A port in use is one error."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise StreamError(
            f"online: cannot listen on {host}:{port} ({e.strerror}); another run holds data.online.port={port}, or "
            "data.online.trainer_addr is not this machine's"
        ) from None
    sock.listen(128)
    return sock


def check_producers(said: list[dict[str, Any]], metas: list[StreamMeta], producers: int, port: int) -> None:
    """Every producer says which one it is (``said``: its raw meta) and describes the same stream."""
    for k, (raw, meta) in enumerate(zip(said, metas)):
        who = (raw.get("producer", 0), raw.get("producers", 1))
        if who != (k, producers):
            raise ConfigError(
                f"online: the producer on port {port + k} is producer {who[0]} of {who[1]}, the trainer expects "
                f"producer {k} of data.online.producers={producers} (the same data.online.producers on both sides, "
                f"data.online.producer_rank=k on port data.online.port + k)"
            )
        first, this = metas[0].as_json(), meta.as_json()
        diff = {key: (first[key], this[key]) for key in first if this[key] != first[key]}
        if diff:
            raise ConfigError(
                f"online: producer {k} streams {', '.join(f'{key}={b}' for key, (_, b) in diff.items())}, producer 0 "
                f"{', '.join(f'{key}={a}' for key, (a, _) in diff.items())}: expected the same target, layers, "
                "store dtype, prompt set and data.max_seq_len"
            )


def stream_to_trainer(source: BlockProducer, host: str, port: int, *, timeout_s: float) -> int:
    """A producer's side of the link (``python -m data_tools.online``): connect to the trainer's
    rank 0 on ``port + source.rank``, describe the stream, send the validation set (producer 0
    only), then this producer's blocks from the cursor the trainer sends, until the trainer
    closes the link (it finished, or was stopped: a rerun of both resumes from its checkpoint)."""
    link = StreamLink(host, port + source.rank, role="producer", timeout_s=timeout_s)
    link.set("meta", {**source.meta.as_json(), "producer": source.rank, "producers": source.producers})
    if source.rank == 0:
        for row in source.val_rows():
            link.send(StreamItem(VAL_ROW, row))
    link.send(StreamItem(VAL_END, {}))
    cursor = int(link.get("cursor"))
    log.info("online producer %d of %d: the trainer starts at prompt %d", source.rank, source.producers, cursor)
    source.start(cursor)
    while True:
        try:
            item = source.next_message(timeout_s=0.5)
        except BaseException as e:  # the engine failed: the trainer reads why from the store
            link.set("error", f"{type(e).__name__}: {e}")
            try:  # and the stream's end, so its receiving thread ends (taken once the trainer reaches it)
                link.send(StreamItem(STREAM_END, {}))
            except Exception:  # noqa: BLE001 - the trainer is gone
                pass
            raise
        try:
            if link.has("stop"):  # looked at twice a second, also while the engine is busy
                log.info("online producer %d: the trainer is done; stopping", source.rank)
                link.send(StreamItem(STREAM_END, {}))  # the trainer's receiver takes sends up to this one
                return 0
            if item is None:
                continue
            link.send(item)
            link.set("stats", source.stats().as_dict())
        except Exception as e:  # noqa: BLE001 - the trainer closed the link or exited
            log.info("online producer %d: the trainer closed the link (%s: %s); done", source.rank, type(e).__name__, e)
            return 0
