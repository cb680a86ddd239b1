"""A row as bytes that cannot execute: the online stream's wire format (:mod:`dspark.formats.stream`).

A frame is a fixed prefix (:data:`FRAME_PREFIX`), a JSON header naming each field's kind (int,
str, bytes, list of ints, or a numpy array of a dtype from :data:`ARRAY_DTYPES`), shape and byte
count, then the raw buffers. :func:`decode_row` runs no code of the sender's (no pickle) and
refuses anything but a well-formed frame with a :class:`StreamError` naming the message and field.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, Optional

import numpy as np

from dspark.core.errors import UserError


class StreamError(UserError):
    """A message on the link that is not one the stream carries (a malformed frame, a row
    without a shard row's fields, a size out of range): the message names which one, the field
    and what was expected. Whatever sent it is not this code's producer, or another version."""


FRAME_MAGIC = b"DSRW"
FRAME_VERSION = 1
FRAME_PREFIX = struct.Struct("<4sHI")
"""A frame's first bytes: magic, version, header bytes (little-endian). The JSON header follows,
then each buffer field's raw bytes in the header's order, nothing after the last::

    {"fields": [{"name": "seq_id", "kind": "str", "value": "..."},
                {"name": "num_tokens", "kind": "int", "value": 12},
                {"name": "input_ids", "kind": "ints", "count": 12, "bytes": 96},     int64 LE
                {"name": "hidden_states", "kind": "bytes", "bytes": 4224},
                {"name": "x", "kind": "array", "dtype": "float32", "shape": [2, 3], "bytes": 24}]}
"""
MAX_HEADER_BYTES = 1 << 20
"""A frame's JSON header (field names, kinds, sizes, ints and strings) is far below this."""
MAX_FRAME_BYTES = 1 << 36
"""The largest frame a link receives by default (64 GiB; a Kimi K3 row of 16k tokens in bf16 is
1.4 GB); a declared size above it is refused before anything is allocated."""
ARRAY_DTYPES = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")
    + ("float16", "float32", "float64")
}
"""The numpy dtypes an ``array`` field may have (stored little-endian)."""
_INT64 = np.dtype("<i8")
_INT64_RANGE = (-(2**63), 2**63 - 1)
_FIELD_KEYS = {
    "int": {"value"},
    "str": {"value"},
    "bytes": {"bytes"},
    "ints": {"count", "bytes"},
    "array": {"dtype", "shape", "bytes"},
}
"""Each field kind -> its header keys besides ``name`` and ``kind``."""


def value_kind(value: Any) -> Optional[str]:
    """The frame kind of a row value (exact types only, so a decoded row equals the sent one), or None."""
    if type(value) is int:
        return "int" if _INT64_RANGE[0] <= value <= _INT64_RANGE[1] else None
    if type(value) is str:
        return "str"
    if type(value) is bytes:
        return "bytes"
    if type(value) is list and all(type(v) is int for v in value):
        return "ints"
    if type(value) is np.ndarray and value.dtype.name in ARRAY_DTYPES:
        return "array"
    return None


def encode_row(row: dict[str, Any]) -> bytearray:
    """A row (field name -> an int64-range int, str, bytes, list of ints or numpy array of
    :data:`ARRAY_DTYPES`) -> one frame (:data:`FRAME_PREFIX`), mutable so that the link hands it
    to gloo without another copy."""
    fields, buffers = [], []
    for name, value in row.items():
        kind = value_kind(value) if type(name) is str else None
        if kind is None:
            raise TypeError(
                f"stream row field {name!r}: a {type(value).__name__} cannot travel; expected a str name and an int "
                f"(int64 range), str, bytes, list of ints or numpy array of {list(ARRAY_DTYPES)}"
            )
        if kind in ("int", "str"):
            fields.append({"name": name, "kind": kind, "value": value})
            continue
        if kind == "bytes":
            buf, extra = value, {}
        elif kind == "ints":
            buf, extra = np.asarray(value, dtype=_INT64).tobytes(), {"count": len(value)}
        else:
            buf = np.ascontiguousarray(value, dtype=ARRAY_DTYPES[value.dtype.name]).tobytes()
            extra = {"dtype": value.dtype.name, "shape": list(value.shape)}
        fields.append({"name": name, "kind": kind, **extra, "bytes": len(buf)})
        buffers.append(buf)
    header = json.dumps({"fields": fields}, separators=(",", ":")).encode()
    return bytearray().join([FRAME_PREFIX.pack(FRAME_MAGIC, FRAME_VERSION, len(header)), header, *buffers])


def decode_row(frame: bytes | bytearray | memoryview | np.ndarray, *, what: str = "frame") -> dict[str, Any]:
    """A frame -> the row :func:`encode_row` was given (same keys in the same order, types and
    values). Runs no code of the sender's; raises :class:`StreamError` naming ``what`` (the
    message), the field and what was expected for anything else."""
    mv = memoryview(frame).cast("B")
    if len(mv) < FRAME_PREFIX.size:
        raise StreamError(
            f"{what}: {len(mv)} bytes, shorter than a frame's {FRAME_PREFIX.size}-byte prefix (magic, version, "
            "header bytes)"
        )
    magic, version, header_bytes = FRAME_PREFIX.unpack_from(mv)
    if magic != FRAME_MAGIC:
        hint = " (a pickle: the sender runs an older version of this code?)" if mv[0] == 0x80 else ""
        raise StreamError(f"{what}: starts with {bytes(mv[:4])!r}, expected a frame's magic {FRAME_MAGIC!r}{hint}")
    if version != FRAME_VERSION:
        raise StreamError(
            f"{what}: frame version {version}, this code reads {FRAME_VERSION} (run the same code on the producer "
            "and the trainer)"
        )
    if header_bytes > MAX_HEADER_BYTES:
        raise StreamError(f"{what}: declares a header of {header_bytes} bytes, expected at most {MAX_HEADER_BYTES}")
    offset = FRAME_PREFIX.size + header_bytes
    if offset > len(mv):
        raise StreamError(
            f"{what}: declares a header of {header_bytes} bytes, the frame holds {len(mv) - FRAME_PREFIX.size} after "
            "its prefix (truncated)"
        )
    try:
        header = json.loads(mv[FRAME_PREFIX.size : offset].tobytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError; nesting too deep
        raise StreamError(f"{what}: the header is not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict) or set(header) != {"fields"} or not isinstance(header["fields"], list):
        raise StreamError(f"{what}: the header is {_short(header)}, expected an object with one key, 'fields' (a list)")
    row: dict[str, Any] = {}
    for i, spec in enumerate(header["fields"]):
        name, kind = _check_field(spec, i, row, what)
        where = f"{what}, field {name!r}"
        if kind in ("int", "str"):
            row[name] = spec["value"]
            continue
        size = spec["bytes"]
        if size > len(mv) - offset:
            raise StreamError(
                f"{where}: declares {size} bytes, the frame holds {len(mv) - offset} after the fields before it "
                "(truncated)"
            )
        buf, offset = mv[offset : offset + size], offset + size
        if kind == "bytes":
            row[name] = buf.tobytes()
        elif kind == "ints":
            row[name] = np.frombuffer(buf, dtype=_INT64).tolist()
        else:
            row[name] = np.frombuffer(buf, dtype=ARRAY_DTYPES[spec["dtype"]]).reshape(spec["shape"]).copy()
    if offset != len(mv):
        raise StreamError(f"{what}: {len(mv) - offset} bytes after the last field's, expected none")
    return row


def _check_field(spec: Any, i: int, row: dict[str, Any], what: str) -> tuple[str, str]:
    """(name, kind) of header field ``i`` once its keys and values are what its kind needs."""
    if not isinstance(spec, dict) or type(spec.get("name")) is not str or spec.get("kind") not in _FIELD_KEYS:
        raise StreamError(
            f"{what}: header field {i} is {_short(spec)}, expected an object with a str 'name' and a 'kind' among "
            f"{list(_FIELD_KEYS)}"
        )
    name, kind = spec["name"], spec["kind"]
    where = f"{what}, field {name!r}"
    if name in row:
        raise StreamError(f"{where}: appears twice in the header, expected each name once")
    want = {"name", "kind"} | _FIELD_KEYS[kind]
    if set(spec) != want:
        raise StreamError(f"{where}: a {kind} field with keys {sorted(spec)}, expected {sorted(want)}")
    value = spec.get("value")
    if kind == "int" and value_kind(value) != "int":
        raise StreamError(f"{where}: value {_short(value)}, expected an integer in the int64 range")
    if kind == "str" and type(value) is not str:
        raise StreamError(f"{where}: value {_short(value)}, expected a string")
    if kind in ("int", "str"):
        return name, kind
    size = _size(spec["bytes"], f"{where}: 'bytes'")
    if kind == "ints" and size != 8 * _size(spec["count"], f"{where}: 'count'"):
        raise StreamError(f"{where}: {spec['count']} int64 values in {size} bytes, expected {8 * spec['count']}")
    if kind == "array":
        if spec["dtype"] not in ARRAY_DTYPES:
            raise StreamError(f"{where}: dtype {_short(spec['dtype'])}, expected one of {list(ARRAY_DTYPES)}")
        shape = spec["shape"]
        if not isinstance(shape, list) or len(shape) > 32:
            raise StreamError(f"{where}: shape {_short(shape)}, expected a list of at most 32 sizes")
        count = math.prod(_size(n, f"{where}: shape {shape}") for n in shape)
        itemsize = ARRAY_DTYPES[spec["dtype"]].itemsize
        if count * itemsize != size:
            raise StreamError(
                f"{where}: shape {shape} of {spec['dtype']} is {count * itemsize} bytes, the header declares {size}"
            )
    return name, kind


def _size(value: Any, where: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_FRAME_BYTES:
        raise StreamError(f"{where} is {_short(value)}, expected an integer in [0, {MAX_FRAME_BYTES}]")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
