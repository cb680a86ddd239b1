"""What fp8 shards cost and lose: bytes per token, reconstruction error per captured layer and
quantize/dequantize throughput, measured on an existing dataset's states (read-only).

    .venv/bin/python benchmarks/shard_fp8.py outputs/data/smollm2-135m-ablate [--sequences 8] \\
        [--split train] [--repeat 3] [--threads 1]

The first N sequences of the split are read straight from the Parquet shards (no Arrow cache is
written next to them) and converted in memory to each store dtype through the extractor's own
encoder (``dspark.formats.shard_rows.encode_hidden_states``). Bytes per token are the raw cell
(fp8: values + one fp32 scale per token and layer) against the bf16 floor, and after zstd in a
Parquet file of the same rows. The error is ||x - x_hat|| / ||x|| per token against the states as
stored (fp32 shards give the exact error; 16-bit ones the error on top of their own rounding).

A last table answers where the fp8 scale should live (issue #16: per token and layer, or per
channel): the same e4m3/e5m2 rounding with one scale per (sequence, layer) tensor, per (sequence,
layer, channel), per (token, layer) as stored, and per token after dividing each channel by its
amax over the sequence (the two combined). It is measured here, in memory; the shards store the
per-token form only.
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dspark.core import fp8  # noqa: E402
from dspark.formats.shard_format import SCHEMA, Manifest, bytes_per_token  # noqa: E402
from dspark.formats.shard_rows import decode_hidden_states, encode_hidden_states  # noqa: E402

FORMATS = ("bfloat16", "float16", "float8_e4m3", "float8_e5m2")


def read_rows(directory: Path, split: str, n: int) -> list[dict]:
    """The first ``n`` rows of a split, from its shards in manifest order."""
    manifest = Manifest.load(directory)
    rows: list[dict] = []
    for info in (s for s in manifest.shards if s.split == split):
        for batch in pq.ParquetFile(directory / info.path).iter_batches(batch_size=16):
            rows += batch.to_pylist()[: n - len(rows)]
            if len(rows) == n:
                return rows
    return rows


def zstd_bytes(rows: list[dict], cells: list[bytes]) -> int:
    """Size of a zstd Parquet file of these rows with ``cells`` as hidden_states (the writer's settings)."""
    buf = io.BytesIO()
    table = [{**r, "hidden_states": c} for r, c in zip(rows, cells)]
    pq.write_table(pa.Table.from_pylist(table, schema=SCHEMA), buf, compression="zstd", use_dictionary=False)
    return buf.tell()


def timed(fn, repeat: int) -> float:
    """Best wall time of ``repeat`` calls (the machine is shared: the best is the least disturbed)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def rel_error(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """||x - y|| / ||x|| per row of H: [T, L, H] -> [T, L]."""
    return (x - y).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)


def measure(dtype: str, states: list[torch.Tensor], rows: list[dict], repeat: int, layer_ids: list[int]) -> dict:
    n_layers, hidden = states[0].shape[1:]
    tokens = sum(s.shape[0] for s in states)
    cells = [encode_hidden_states(s, dtype) for s in states]
    decoded = [decode_hidden_states(c, dtype=dtype, n_layers=n_layers, hidden=hidden).float() for c in cells]
    rel = torch.cat([rel_error(x, y) for x, y in zip(states, decoded)])
    out = {
        "dtype": dtype,
        "bytes_per_token": bytes_per_token(dtype, n_layers=n_layers, hidden=hidden),
        "zstd_bytes_per_token": zstd_bytes(rows, cells) / tokens,
        "err_mean": {layer: rel[:, j].mean().item() for j, layer in enumerate(layer_ids)},
        "err_max": {layer: rel[:, j].max().item() for j, layer in enumerate(layer_ids)},
    }
    enc = timed(lambda: [encode_hidden_states(s, dtype) for s in states], repeat)
    dec = timed(lambda: [decode_hidden_states(c, dtype=dtype, n_layers=n_layers, hidden=hidden) for c in cells], repeat)
    # 16-bit decoding is a zero-copy view; time the cast to fp32 the trainer would do instead
    if dtype not in fp8.FORMATS:
        dec = timed(
            lambda: [decode_hidden_states(c, dtype=dtype, n_layers=n_layers, hidden=hidden).float() for c in cells],
            repeat,
        )
    out["encode_tok_s"], out["decode_tok_s"] = tokens / enc, tokens / dec
    return out


GRANULARITIES = {
    "tensor": "sequence x layer",
    "channel": "sequence x layer x channel",
    "token": "token x layer (stored)",
    "token+channel": "token x layer, channels pre-divided",
}
"""Where one fp32 scale lives -> how the table names it."""


def quantize_at(x: torch.Tensor, fmt: fp8.Fp8Format, granularity: str) -> tuple[torch.Tensor, int]:
    """One sequence's states [T, L, H] rounded through ``fmt`` with scales at ``granularity``:
    (reconstruction [T, L, H], bytes of fp32 scales). ``token`` is the stored format; every form
    rounds through ``fp8.quantize``, over rows of a token (``token*``) or of a whole layer."""
    t, n_layers, hidden = x.shape
    channel = None
    if granularity in ("channel", "token+channel"):
        channel = x.abs().amax(dim=0, keepdim=True)  # [1, L, H]: each channel's largest magnitude
        channel = torch.where(channel > 0, channel, torch.ones_like(channel))
        x = x / channel
    per_token = granularity in ("token", "token+channel")
    rows = x if per_token else x.transpose(0, 1).reshape(n_layers, t * hidden)  # a row: one scale
    q, scale = fp8.quantize(rows, fmt)
    y = fp8.dequantize(q, scale)
    if not per_token:
        y = y.reshape(n_layers, t, hidden).transpose(0, 1)
    if channel is not None:
        y = y * channel
    return y, (scale.numel() + (channel.numel() if channel is not None else 0)) * fp8.SCALE_BYTES


def measure_granularity(name: str, granularity: str, states: list[torch.Tensor]) -> dict:
    fmt = fp8.FORMATS[name]
    errs, scale_bytes = [], 0
    for x in states:
        y, nbytes = quantize_at(x, fmt, granularity)
        errs.append(rel_error(x, y))
        scale_bytes += nbytes
    rel = torch.cat(errs)
    return {
        "format": name,
        "granularity": granularity,
        "scale_bytes_per_token": scale_bytes / rel.shape[0],
        "err_mean": rel.mean().item(),
        "err_p99": rel.flatten().quantile(0.99).item(),
        "err_max": rel.max().item(),
        "first_token_err": torch.stack([e[0] for e in errs]).mean().item(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path, help="dataset directory (manifest.json); only read")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--split", default="train")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads for the throughput columns")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    manifest = Manifest.load(args.directory)
    n_layers, hidden = len(manifest.layer_ids), manifest.hidden_size
    rows = read_rows(args.directory, args.split, args.sequences)
    states = [
        decode_hidden_states(r["hidden_states"], dtype=manifest.dtype, n_layers=n_layers, hidden=hidden).float()
        for r in rows
    ]
    tokens = sum(s.shape[0] for s in states)
    floor = bytes_per_token("bfloat16", n_layers=n_layers, hidden=hidden)
    print(
        f"{args.directory} ({manifest.target}, stored {manifest.dtype}): {len(rows)} {args.split} sequences, "
        f"{tokens} tokens, {n_layers} captured layers x {hidden}; {args.threads} torch thread(s)\n"
    )
    results = [measure(d, states, rows, args.repeat, manifest.layer_ids) for d in FORMATS]
    print("| store dtype | bytes/token | vs bf16 | zstd bytes/token | vs bf16 zstd | encode tok/s | decode tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    bf16_zstd = results[0]["zstd_bytes_per_token"]
    for r in results:
        print(
            f"| {r['dtype']} | {r['bytes_per_token']} | {r['bytes_per_token'] / floor:.3f} | "
            f"{r['zstd_bytes_per_token']:.0f} | {r['zstd_bytes_per_token'] / bf16_zstd:.3f} | "
            f"{r['encode_tok_s']:,.0f} | {r['decode_tok_s']:,.0f} |"
        )
    print(f"\nRelative error ||x - x_hat|| / ||x|| per token against the stored {manifest.dtype} states, mean / max:\n")
    print("| layer id | " + " | ".join(r["dtype"] for r in results) + " |")
    print("|---:|" + "---:|" * len(results))
    for layer in manifest.layer_ids:
        cells = " | ".join(f"{r['err_mean'][layer]:.2e} / {r['err_max'][layer]:.2e}" for r in results)
        print(f"| {layer} | {cells} |")
    bounds = ", ".join(f"{f.name} {f.row_rel_bound(hidden):.4f}" for f in fp8.FORMATS.values())
    print(f"\nStated bound per token (dspark/core/fp8.py): {bounds}.")

    print(
        f"\nWhere the scale lives: relative error per token against the stored {manifest.dtype} states, "
        "all captured layers, and the fp32 scales' bytes per token (values: "
        f"{n_layers * hidden} bytes/token in every row):\n"
    )
    print("| format | one scale per | scale B/token | mean | p99 | max | first token mean |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in fp8.FORMATS:
        for g, per in GRANULARITIES.items():
            r = measure_granularity(name, g, states)
            print(
                f"| {name} | {per} | {r['scale_bytes_per_token']:.1f} | {r['err_mean']:.2e} | {r['err_p99']:.2e} | "
                f"{r['err_max']:.2e} | {r['first_token_err']:.2e} |"
            )


if __name__ == "__main__":
    main()
