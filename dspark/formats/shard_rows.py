"""A shard's rows (the format: :mod:`dspark.formats.shard_format`): a row's ``hidden_states`` cell
encoded and decoded (16/32-bit values as raw bytes, fp8 values followed by their per-token,
per-layer fp32 scales), a decoded row checked (as the stream checks each row it receives), and
a shard file read and checked against what its manifest records (:func:`read_shard`, the one
decision training and ``data_tools.verify`` both use).

Imports pyarrow, torch and the stdlib only, so it runs in a vLLM-only environment.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pyarrow.parquet as pq
import torch

from dspark.config import TORCH_DTYPES
from dspark.core import fp8
from dspark.formats.shard_format import MANIFEST, SCHEMA, STORE_DTYPES, Manifest, ShardInfo, bytes_per_token


def read_shard(
    directory: Path, info: ShardInfo, manifest: "Manifest", *, recorded_in: str = MANIFEST
) -> tuple[Optional[pa.Table], Optional[str], dict[int, str]]:
    """One shard read and checked against what ``info`` records, the one decision training and
    ``data_tools.verify`` both use: (table, file problem, {row: problem}). The file's problem
    (missing, a link out of the dataset, size or SHA-256 differing, not Parquet of this schema,
    row or token counts differing) comes with no table; otherwise each row failing
    :func:`check_row` has its problem.
    The bytes are hashed and parsed once, so what was checked is what is read. ``recorded_in``
    names where ``info`` came from (the manifest, or verify's sidecar of a shard it lacks)."""
    directory = Path(directory)
    shard = directory / info.path
    if not shard.is_file():
        return None, f"{shard}: missing file, listed in {recorded_in}", {}
    if directory.resolve() not in shard.resolve().parents:
        return None, f"{shard}: a link to {shard.resolve()}, outside the dataset {directory}", {}
    data = shard.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    if len(data) != info.bytes or sha != info.sha256:
        return (
            None,
            f"{shard}: {len(data)} bytes with sha256 {sha[:16]}, but {recorded_in} records {info.bytes} bytes with "
            f"sha256 {info.sha256[:16]}: truncated or altered on disk",
            {},
        )
    try:
        table = pq.read_table(pa.BufferReader(data), schema=SCHEMA)
    except (pa.ArrowException, OSError) as e:
        return None, f"{shard}: cannot be read as a Parquet shard ({type(e).__name__}: {e}); truncated or damaged", {}
    if table.num_rows != info.rows:
        return None, f"{shard}: {table.num_rows} rows, but {recorded_in} records {info.rows}", {}
    tokens = int(pa.compute.sum(table.column("num_tokens")).as_py() or 0)
    if tokens != info.tokens:
        return None, f"{shard}: {tokens} tokens, but {recorded_in} records {info.tokens}", {}
    rows = {}
    for i, row in enumerate(table.to_pylist()):
        bad = check_row(row, n_layers=len(manifest.layer_ids), hidden_size=manifest.hidden_size, dtype=manifest.dtype)
        if bad:
            rows[i] = f"{shard}: row {i} (sequence {row['seq_id']}): {bad}"
    return table, None, rows


def check_row(row: dict[str, Any], *, n_layers: int, hidden_size: int, dtype: str) -> Optional[str]:
    """Return what is wrong with one decoded row, or None: lengths, the byte count of
    ``hidden_states`` and, for fp8 rows, that every scale is finite and >= 0."""
    t = row["num_tokens"]
    if len(row["input_ids"]) != t or len(row["loss_mask"]) != t:
        return f"input_ids/loss_mask length {len(row['input_ids'])}/{len(row['loss_mask'])} != num_tokens {t}"
    per_token = bytes_per_token(dtype, n_layers=n_layers, hidden=hidden_size)
    expected = (t - 1) * per_token
    if len(row["hidden_states"]) != expected:
        layout = f"{n_layers}x{hidden_size}x{STORE_DTYPES[dtype]}"
        if dtype in fp8.FORMATS:
            layout = f"({layout} + {n_layers}x{fp8.SCALE_BYTES} scale bytes)"
        return f"hidden_states has {len(row['hidden_states'])} bytes, expected {expected} = ({t}-1)x{layout}"
    if dtype in fp8.FORMATS:
        _, scales = split_scaled(row["hidden_states"], dtype=dtype, n_layers=n_layers, hidden=hidden_size)
        bad = ~torch.isfinite(scales) | (scales < 0)
        if bad.any():
            token, layer = (int(i) for i in bad.nonzero()[0])
            return (
                f"hidden_states scales: {int(bad.sum())} of {scales.numel()} are NaN, inf or negative "
                f"(first at token {token}, captured layer {layer}: {float(scales[token, layer])})"
            )
    return None


def encode_hidden_states(states: torch.Tensor, dtype: str) -> bytes:
    """[T-1, L, H] states -> the bytes of a row's ``hidden_states`` cell in ``dtype`` (fp8:
    quantized per token and layer, values then scales)."""
    if dtype not in fp8.FORMATS:
        return states.to(TORCH_DTYPES[dtype]).contiguous().view(torch.uint8).numpy().tobytes()
    values, scales = fp8.quantize(states, fp8.FORMATS[dtype])
    return values.contiguous().view(torch.uint8).numpy().tobytes() + scales.contiguous().numpy().tobytes()


def _view(buf: memoryview | bytes | pa.Buffer, dtype: torch.dtype) -> torch.Tensor:
    """Bytes -> a flat tensor sharing them (the result must not be written)."""
    if not len(buf):
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():  # torch warns that the buffer is read-only; we never write it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memoryview(buf), dtype=dtype)  # type: ignore[arg-type]


def split_scaled(
    buf: memoryview | bytes | pa.Buffer, *, dtype: str, n_layers: int, hidden: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 cell -> (values [T-1, L, H] fp8, scales [T-1, L] fp32), both views of ``buf``
    (the scales are copied only when the cell does not start 4-byte aligned)."""
    fmt = fp8.FORMATS[dtype]
    n = len(buf) // (n_layers * (hidden + fp8.SCALE_BYTES))
    mem = memoryview(buf)  # type: ignore[arg-type]
    values = _view(mem[: n * n_layers * hidden], torch.uint8).view(fmt.torch_dtype)
    scales = _view(mem[n * n_layers * hidden :], fp8.SCALE_DTYPE)
    if scales.numel() and scales.data_ptr() % fp8.SCALE_BYTES:
        scales = scales.clone()
    return values.view(n, n_layers, hidden), scales.view(n, n_layers)


def decode_hidden_states(
    buf: memoryview | bytes | pa.Buffer,
    *,
    dtype: str,
    n_layers: int,
    hidden: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A row's ``hidden_states`` cell -> [T-1, L, H]. 16/32-bit dtypes: a view of the bytes in the
    stored dtype, without copying (the result must not be written; the trainer casts it).
    fp8 dtypes: dequantized into a new tensor of ``out_dtype`` (fp8 is a storage format only)."""
    if dtype in fp8.FORMATS:
        values, scales = split_scaled(buf, dtype=dtype, n_layers=n_layers, hidden=hidden)
        return fp8.dequantize(values, scales, out_dtype)
    if not n_layers:  # a token-id shard's empty cell (its row count is the sequence's, not the cell's)
        return torch.empty(0, 0, hidden, dtype=TORCH_DTYPES[dtype])
    return _view(buf, TORCH_DTYPES[dtype]).view(-1, n_layers, hidden)
