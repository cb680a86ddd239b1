"""The gloo link between the online trainer's rank 0 and one producer on another node, and the
messages it may carry.

:class:`StreamLink` is a two-process gloo group of its own (the trainer's DeepSpeed group is
untouched) on a TCPStore that the trainer hosts. The store carries the control values (the
producer's description of its stream, the trainer's cursor, the producer's rates); gloo carries
each sequence as a header (index, size) and its row as a frame
(:func:`~dspark.formats.frames.encode_row`): a fixed prefix, a JSON header naming each field's kind,
dtype from an allow-list, shape and byte count, then the raw buffers. Decoding a frame runs no
code of the sender's (no pickle): :func:`~dspark.formats.frames.decode_row` and
:meth:`StreamLink.recv` refuse, with a :class:`StreamError` naming the message and field, anything
but a well-formed frame of the messages the stream carries (:data:`MESSAGE_FIELDS`;
docs/faults.md, "What trusts its input"). A gloo send completes only once the receiver has posted
the matching receive, and the trainer's receiving thread posts one only when its buffer has room:
the back-pressure reaches the engine.

Each side's loop over the link is :mod:`dspark.formats.stream_remote`.
"""

from __future__ import annotations

import datetime
import json
import socket
from typing import Any

import pyarrow as pa
import torch

from dspark.formats.frames import FRAME_PREFIX, MAX_FRAME_BYTES, StreamError, decode_row, encode_row, value_kind
from dspark.formats.shard_format import SCHEMA
from dspark.formats.stream import BLOCK_END, STREAM_END, VAL_END, VAL_ROW, StreamItem

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
    (index, frame bytes) and the frame (:func:`~dspark.formats.frames.encode_row`); :meth:`recv` refuses one that is not
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
