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
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol


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
