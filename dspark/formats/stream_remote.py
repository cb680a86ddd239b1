"""Online training across nodes: the trainer's :class:`RemoteSource` and the producer's
:func:`stream_to_trainer`, one :class:`~dspark.formats.stream_link.StreamLink` per producer.

Across nodes (``data.online.trainer_addr`` set) the producer is its own job step
(``python -m data_tools.online``, on the extraction nodes) and the link carries its sequences to
the trainer's rank 0. :class:`RemoteSource` is the trainer's side: a
:class:`~dspark.formats.stream.SequenceSource` that reads each producer's link into its own buffer
and merges the producers' blocks back into prompt order (:mod:`dspark.formats.stream`, "Several
producers").
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from dspark.config import ConfigError
from dspark.formats.frames import StreamError
from dspark.formats.shard_rows import check_row
from dspark.formats.stream import (
    BLOCK_END,
    STREAM_END,
    VAL_END,
    VAL_ROW,
    BlockProducer,
    BoundedBuffer,
    StreamClosed,
    StreamItem,
    StreamMeta,
    StreamStats,
    no_prompt_fits,
)
from dspark.formats.stream_link import StreamLink

log = logging.getLogger(__name__)


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
        byte counts of the stream's layers, width and dtype (``shard_rows.check_row``)."""
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
