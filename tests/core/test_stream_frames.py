"""The online stream's frames (dspark/formats/frames.py, dspark/formats/stream_link.py): rows round-trip
exactly, and nothing but a well-formed frame of a message the stream carries is accepted; no
sender's code ever runs."""

import json
import os
import pickle
import threading

import numpy as np
import pytest
import torch

from dspark.core.errors import UserError
from dspark.formats.frames import (
    FRAME_MAGIC,
    FRAME_PREFIX,
    FRAME_VERSION,
    MAX_HEADER_BYTES,
    StreamError,
    decode_row,
    encode_row,
)
from dspark.formats.shard_rows import encode_hidden_states
from dspark.formats.stream import BLOCK_END, STREAM_END, VAL_END, VAL_ROW, StreamItem
from dspark.formats.stream_link import StreamLink, check_message

LAYERS, HIDDEN = 3, 8


def shard_row(n_tokens: int = 10, store_dtype: str = "float32") -> dict:
    """A row as ``data_tools.extract.capture_rows`` builds it."""
    g = torch.Generator().manual_seed(n_tokens)
    return {
        "seq_id": "0123456789abcdef",
        "num_tokens": n_tokens,
        "input_ids": torch.randint(0, 150_000, (n_tokens,), generator=g).tolist(),
        "loss_mask": [0] * 4 + [1] * (n_tokens - 4),
        "hidden_states": encode_hidden_states(torch.randn(n_tokens - 1, LAYERS, HIDDEN, generator=g), store_dtype),
    }


def frame(header, *buffers: bytes, magic=FRAME_MAGIC, version=FRAME_VERSION, header_bytes=None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(text) if header_bytes is None else header_bytes
    return FRAME_PREFIX.pack(magic, version, n) + text + b"".join(buffers)


def one(*buffers: bytes, **spec) -> bytes:
    """A frame of one field named x (its header keys besides the name: ``spec``)."""
    return frame({"fields": [{"name": "x", **spec}]}, *buffers)


def same(a: dict, b: dict) -> bool:
    """Equal keys in the same order, types and values (arrays: dtype, shape, values)."""
    if list(a) != list(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if type(x) is not type(y):
            return False
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
                return False
        elif isinstance(x, list):
            if [type(v) for v in x] != [type(v) for v in y] or x != y:
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("store_dtype", ["float32", "bfloat16", "float8_e4m3"])
def test_a_shard_row_round_trips_exactly(store_dtype):
    row = shard_row(store_dtype=store_dtype)
    got = decode_row(encode_row(row))
    assert same(got, row) and type(got["num_tokens"]) is int and all(type(v) is int for v in got["input_ids"])
    check_message(StreamItem(0, got), "test")  # the fields a sequence has


def test_control_messages_and_every_field_kind_round_trip():
    for row in ({}, {"end": 7}, {"end": -(2**63)}):
        assert same(decode_row(encode_row(row)), row)
    arrays = {name: (np.arange(6) % 2).astype(name).reshape(2, 3) for name in ("bool", "uint8", "int64", "float16")}
    row = {
        "big": 2**63 - 1,
        "text": "naïve \u2603",
        "empty_bytes": b"",
        "empty_ints": [],
        "negative": [-1, 2**62],
        "scalar": np.array(1.5),
        "be": np.arange(4, dtype=">i4"),  # sent little-endian
        **arrays,
        "strided": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],
    }
    got = decode_row(encode_row(row))
    assert list(got) == list(row) and got["big"] == 2**63 - 1 and got["text"] == row["text"]
    assert got["empty_bytes"] == b"" and got["empty_ints"] == [] and got["negative"] == [-1, 2**62]
    assert got["scalar"].shape == () and float(got["scalar"]) == 1.5
    assert got["be"].tolist() == [0, 1, 2, 3] and got["be"].dtype == np.dtype("<i4")
    for name, a in {**arrays, "strided": row["strided"]}.items():
        assert got[name].dtype == a.dtype and np.array_equal(got[name], a)


@pytest.mark.parametrize(
    "value",
    [True, 2**63, 1.5, None, [1, True], [1, 2.0], (1, 2), bytearray(b"x"), np.int64(3), np.array(["a"]), {"a": 1}],
    ids=repr,
)
def test_what_would_not_round_trip_exactly_is_refused_when_sent(value):
    with pytest.raises(TypeError, match=r"stream row field 'x': a \w+ cannot travel"):
        encode_row({"x": value})


class Marker:
    """Unpickling it would create a file: the proof that a receiver ran the sender's code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_that_would_run_code_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"seq_id": Marker(str(marker))}, protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(StreamError, match=r"msg 3: starts with b'\\x80.*expected a frame's magic b'DSRW' \(a pickle"):
        decode_row(payload, what="msg 3")
    hidden = frame({"fields": [{"name": "p", "kind": "bytes", "bytes": len(payload)}]}, payload)
    assert decode_row(hidden) == {"p": payload}  # inside a frame a pickle is just bytes, never loaded
    assert not marker.exists()
    assert issubclass(StreamError, UserError)


ONE_BYTES = {"fields": [{"name": "hidden_states", "kind": "bytes", "bytes": 4}]}


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", r"0 bytes, shorter than a frame's 10-byte prefix"),
        (b"garbage!!!garbage", r"starts with b'garb', expected a frame's magic"),
        (frame(ONE_BYTES, b"abcd", version=2), r"frame version 2, this code reads 1"),
        (frame(ONE_BYTES, b"abcd", header_bytes=MAX_HEADER_BYTES + 1), r"header of 1048577 bytes, expected at most"),
        (frame(ONE_BYTES, header_bytes=500), r"declares a header of 500 bytes, the frame holds \d+ after its prefix"),
        (frame(b"{not json"), r"the header is not UTF-8 JSON"),
        (frame(b"\xff\xfe"), r"the header is not UTF-8 JSON"),
        (frame(b"[" * 100_000 + b"]" * 100_000), r"the header is not UTF-8 JSON"),
        (frame([1, 2]), r"the header is \[1, 2\], expected an object with one key, 'fields'"),
        (frame({"fields": [], "code": "x"}), r"expected an object with one key, 'fields'"),
        (one(kind="pickle"), r"header field 0 is .*a 'kind' among"),
        (frame({"fields": [{"name": 3, "kind": "int", "value": 1}]}), r"header field 0 is .*a str 'name'"),
        (one(kind="int", value=1, extra=0), r"field 'x': a int field with keys"),
        (one(kind="int", value=True), r"field 'x': value True, expected an int"),
        (one(kind="int", value=2**64), r"field 'x': value \d+, expected an int"),
        (one(kind="int", value=1.0), r"field 'x': value 1.0, expected an int"),
        (one(kind="str", value=1), r"field 'x': value 1, expected a string"),
        (
            frame({"fields": [{"name": "x", "kind": "int", "value": 1}, {"name": "x", "kind": "int", "value": 2}]}),
            r"field 'x': appears twice",
        ),
        (one(kind="bytes", bytes=-1), r"field 'x': 'bytes' is -1, expected an i"),
        (one(kind="bytes", bytes=2**40), r"'bytes' is 1099511627776, expected"),
        (frame(ONE_BYTES, b"ab"), r"field 'hidden_states': declares 4 bytes, the frame holds 2 .*\(truncated\)"),
        (frame(ONE_BYTES, b"abcdEXTRA"), r"5 bytes after the last field's, expected none"),
        (frame({"fields": []}, b"x"), r"1 bytes after the last field's, expected none"),
        (one(b"\0" * 16, kind="ints", count=3, bytes=16), r"field 'x': 3 int64 values in 16 bytes, expected 24"),
        (one(b"\0" * 8, kind="array", dtype="object", shape=[1], bytes=8), r"dtype 'object', expected one of \['bool'"),
        (
            one(kind="array", dtype="float32", shape=[2, 3], bytes=20),
            r"field 'x': shape \[2, 3\] of float32 is 24 bytes, the header declares 20",
        ),
        (
            one(kind="array", dtype="float32", shape=[-1], bytes=4),
            r"field 'x': shape \[-1\] is -1, expected an integer",
        ),
        (one(b"abcd", kind="array", dtype="uint8", shape="4", bytes=4), r"field 'x': shape '4', expected a list"),
    ],
)
def test_a_malformed_frame_is_refused_naming_what_is_wrong(data, match):
    with pytest.raises(StreamError, match=r"^msg 7\b.*" + match):
        decode_row(data, what="msg 7")


@pytest.mark.parametrize(
    "index, row, match",
    [
        (5, {"seq_id": "a"}, r"fields \{'seq_id': 'str'\}, expected \{'seq_id': 'str', 'num_tokens': 'int'"),
        (VAL_ROW, {**shard_row(), "num_tokens": "10"}, r"index -2\): fields .*'num_tokens': 'str'"),
        (BLOCK_END, {"end": [1]}, r"fields \{'end': 'ints'\}, expected \{'end': 'int'\}"),
        (VAL_END, {"end": 1}, r"expected \{\}"),
        (-5, {}, r"index -5, expected a prompt index >= 0 or a control index \[-4, -3, -2, -1\]"),
    ],
)
def test_a_message_without_its_fields_is_refused(index, row, match):
    with pytest.raises(StreamError, match=match):
        check_message(StreamItem(index, row), "msg")


def test_over_the_real_link_rows_arrive_whole_and_a_pickle_is_refused(tmp_path):
    """Both ends of a StreamLink (gloo on localhost): a sequence and a block end arrive as sent;
    then a hand-made message carrying a code-running pickle, and one declaring a huge frame, are
    refused by the trainer's recv without allocating or unpickling."""
    from dspark.core.ports import free_port

    port, marker, rows = free_port(), tmp_path / "pwned", [shard_row(12), {"end": 3}, {}]
    evil = pickle.dumps({"seq_id": Marker(str(marker))})
    links = {}

    def producer():
        links["p"] = link = StreamLink("127.0.0.1", port, role="producer", timeout_s=30)
        for index, row in zip((4, BLOCK_END, STREAM_END), rows):
            link.send(StreamItem(index, row))
        link.pg.send([torch.tensor([5, len(evil)], dtype=torch.int64)], link.peer, 0).wait()
        link.pg.send([torch.frombuffer(bytearray(evil), dtype=torch.uint8)], link.peer, 1).wait()
        link.pg.send([torch.tensor([6, 2**62], dtype=torch.int64)], link.peer, 0).wait()

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    trainer = StreamLink("127.0.0.1", port, role="trainer", timeout_s=30, max_frame_bytes=1 << 30)
    got = [trainer.recv() for _ in rows]
    assert [g.index for g in got] == [4, BLOCK_END, STREAM_END] and all(same(g.row, r) for g, r in zip(got, rows))
    with pytest.raises(StreamError, match=rf"message 4 on the link at 127.0.0.1:{port}: starts with b'\\x80"):
        trainer.recv()
    with pytest.raises(StreamError, match=r"message 5 .*\(index 6\): declares a frame of 4611686018427387904 bytes"):
        trainer.recv()
    t.join(30)
    assert not t.is_alive() and not marker.exists()
    assert os.listdir(tmp_path) == []  # nothing else written either


def _meta(**change):
    return {"layer_ids": [1, 8, 15], "hidden_size": 576, "store_dtype": "float32", "num_prompts": 10,
            "max_seq_len": 1024, **change}  # fmt: skip


@pytest.mark.parametrize(
    "meta, message",
    [
        ([1, 2], r"meta is \[1, 2\], expected a JSON object"),
        (
            {k: v for k, v in _meta().items() if k != "max_seq_len"},
            r"meta field 'max_seq_len' is None, expected an integer",
        ),
        (_meta(hidden_size="576"), r"meta field 'hidden_size' is '576', expected an integer"),
        (_meta(layer_ids=[1, -2]), r"meta field 'layer_ids' is \[1, -2\], expected a list of integers >= 0"),
        (_meta(max_seq_len=0), r"meta field 'max_seq_len' is 0, expected an integer >= 1"),
        (_meta(store_dtype="int4"), r"meta field 'store_dtype' is 'int4', expected one of"),
    ],
    ids=["list", "missing", "type", "layers", "range", "dtype"],
)
def test_a_producers_meta_is_checked_as_data(meta, message):
    from dspark.formats.stream import StreamMeta

    with pytest.raises(StreamError, match=message):
        StreamMeta.from_json(meta, "online: producer 0")
    got = StreamMeta.from_json({**_meta(), "producer": 0}, "p")  # the link's own keys are not the stream's
    assert got.as_json() == _meta() and got.n_layers == 3 and got.layer_ids == (1, 8, 15)


def test_the_link_is_bounded_by_its_stream_binds_its_address_and_names_what_is_missing(tmp_path):
    """Issue #37: a producer announcing a 16 GiB frame made the trainer reserve it (the bound was
    64 GiB, not the stream's ~14 MB); non-JSON meta gave a traceback; a missing producer a raw
    DistStoreError; the store listened on every interface even with trainer_addr=127.0.0.1."""
    import psutil

    from dspark.core.ports import free_port
    from dspark.formats.stream import StreamMeta
    from dspark.formats.stream_remote import RemoteSource

    bound = StreamMeta.from_json(_meta(), "p").frame_bound()
    assert bound == FRAME_PREFIX.size + (1 << 20) + 1024 * (3 * 576 * 4 + 16) and bound < 16 << 20
    port = free_port()

    def producer():
        link = StreamLink("127.0.0.1", port, role="producer", timeout_s=30)
        link.store.set("meta", b"{not json")
        link.set("meta2", _meta())
        link.pg.send([torch.tensor([5, 16 << 30], dtype=torch.int64)], link.peer, 0).wait()

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    trainer = StreamLink("127.0.0.1", port, role="trainer", timeout_s=30)
    listening = {c.laddr for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
    assert {a.ip for a in listening} == {"127.0.0.1"}  # not 0.0.0.0 nor ::
    with pytest.raises(StreamError, match=rf"the link at 127.0.0.1:{port} carries 'meta' that is not JSON"):
        trainer.get("meta")
    trainer.max_frame_bytes = StreamMeta.from_json(trainer.get("meta2"), "p").frame_bound()
    huge = rf"declares a frame of {16 << 30} bytes, expected {FRAME_PREFIX.size} to {bound}"
    with pytest.raises(StreamError, match=huge):
        trainer.recv()
    t.join(30)
    with pytest.raises(
        StreamError, match=r"no producer connected to 127.0.0.1:\d+ within data.online.connect_timeout_s=1"
    ):
        RemoteSource("127.0.0.1", free_port(), buffer_size=2, timeout_s=1)
