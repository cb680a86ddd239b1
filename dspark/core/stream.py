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
the producer's rates); gloo carries each sequence as a header (index, size) and its pickled row.
A gloo send completes only once the receiver has posted the matching receive, and the trainer's
receiving thread posts one only when its buffer has room: the back-pressure reaches the engine.
:class:`RemoteSource` is the trainer's side.
"""

from __future__ import annotations

import datetime
import json
import logging
import pickle
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

log = logging.getLogger(__name__)


@dataclass
class StreamItem:
    index: int
    """The prompt's position in the train prompt order, counted across passes."""
    row: dict[str, Any]
    """The shard row offline extraction would write for it."""


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


class SequenceSource(Protocol):
    """What the online trainer reads from. One implementation per transport: in-process
    (``data_tools.online.VllmSource``), and across nodes over torch.distributed."""

    layer_ids: list[int]
    """Captured layers, final state last (as a shard manifest's ``layer_ids``)."""
    hidden_size: int
    store_dtype: str
    """How ``hidden_states`` is encoded (``data.store_dtype``)."""
    num_prompts: int
    """Train prompts in one pass."""

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

    def get(self) -> Any:
        """Blocks while the buffer is empty; raises the producer's error, or StreamClosed."""
        while True:
            try:
                return self._q.get(timeout=self.poll_s)
            except queue.Empty:
                if self._error is not None:
                    raise self._error
                if self._closed.is_set():
                    raise StreamClosed("the producer closed the buffer")

    def qsize(self) -> int:
        return self._q.qsize()

    def close(self) -> None:
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()


# --- across nodes: torch.distributed ------------------------------------------------------------

VAL_ROW = -2
"""The index a validation sequence travels with."""
VAL_END = -1
"""The index of the (empty) message that ends the validation set."""
TRAINER, PRODUCER = 0, 1


class StreamLink:
    """The trainer's rank 0 (``role="trainer"``, hosts the TCPStore on ``port``) and one producer
    (``role="producer"``), in a two-process gloo group of their own."""

    def __init__(self, host: str, port: int, *, role: str, timeout_s: float):
        import torch.distributed as dist

        self.rank = {"trainer": TRAINER, "producer": PRODUCER}[role]
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, 2, self.rank == TRAINER, timeout=timeout)
        self.pg = dist.ProcessGroupGloo(self.store, self.rank, 2, timeout)
        self.peer = 1 - self.rank

    def send(self, item: StreamItem) -> None:
        payload = pickle.dumps(item.row, protocol=pickle.HIGHEST_PROTOCOL) if item.row else b""
        self.pg.send([torch.tensor([item.index, len(payload)], dtype=torch.int64)], self.peer, 0).wait()
        if payload:
            self.pg.send([torch.frombuffer(bytearray(payload), dtype=torch.uint8)], self.peer, 1).wait()

    def recv(self) -> StreamItem:
        header = torch.zeros(2, dtype=torch.int64)
        self.pg.recv([header], self.peer, 0).wait()
        index, size = (int(v) for v in header)
        if not size:
            return StreamItem(index, {})
        payload = torch.empty(size, dtype=torch.uint8)
        self.pg.recv([payload], self.peer, 1).wait()
        return StreamItem(index, pickle.loads(payload.numpy().tobytes()))

    def set(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str) -> Any:
        """Blocks until the other side has set ``key`` (up to the link's timeout)."""
        return json.loads(self.store.get(key))

    def has(self, key: str) -> bool:
        return self.store.check([key])


class RemoteSource:
    """The trainer's side of a producer on other nodes (``python -m data_tools.online``): a
    :class:`SequenceSource` whose ``get`` reads what a receiving thread takes from the link into a
    :class:`BoundedBuffer`."""

    def __init__(self, host: str, port: int, *, buffer_size: int, timeout_s: float):
        log.info("online: waiting for the producer to connect to %s:%d (up to %.0f s)", host, port, timeout_s)
        self.link = StreamLink(host, port, role="trainer", timeout_s=timeout_s)
        meta = self.link.get("meta")
        self.layer_ids, self.hidden_size = list(meta["layer_ids"]), int(meta["hidden_size"])
        self.store_dtype, self.num_prompts = str(meta["store_dtype"]), int(meta["num_prompts"])
        self.buffer = BoundedBuffer(buffer_size)
        self._thread: Optional[threading.Thread] = None
        self._received = StreamStats()
        log.info("online: producer connected: %s", meta)

    def val_rows(self) -> list[dict[str, Any]]:
        rows = []
        while True:
            item = self.link.recv()
            if item.index == VAL_END:
                return rows
            rows.append(item.row)

    def start(self, cursor: int) -> None:
        self.link.set("cursor", cursor)
        self._thread = threading.Thread(target=self._receive, name="online-receiver", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        try:
            while not self.buffer.closed:
                item = self.link.recv()  # posted only when the last item found room
                self.buffer.put(item)
        except StreamClosed:
            return
        except BaseException as e:  # the producer died or the link broke: the trainer raises it
            if not self.buffer.closed:
                self.buffer.fail(RuntimeError(f"online: the producer's stream broke: {type(e).__name__}: {e}"))

    def get(self) -> StreamItem:
        return self.buffer.get()

    def stats(self) -> StreamStats:
        """The producer's numbers, as it last published them."""
        if not self.link.has("stats"):
            return StreamStats()
        d = self.link.get("stats")
        return StreamStats(
            sequences=d["sequences"], tokens=d["tokens"], engine_s=d["engine_s"], blocked_s=d["blocked_s"]
        )

    def close(self) -> None:
        """Tell the producer to stop (it ends when its send fails or it sees ``stop``)."""
        self.buffer.close()
        try:
            self.link.set("stop", True)
        except Exception:  # noqa: BLE001 - the producer or the store may be gone already
            pass
