"""Check a hidden-state dataset: every shard re-read, and a sample recomputed with transformers.

    python -m data_tools.verify outputs/data/smollm2-135m [--recompute 4] [--max-rel-err 1e-4]

Integrity: each planned shard is present inside the dataset (not a link out of it), matches the
size, sha256, rows and tokens its manifest entry (or sidecar) records, has the declared schema,
every row has consistent lengths and byte counts, and no value is NaN/inf; the same check
training makes (:func:`dspark.formats.shard_rows.read_shard`).
Numerics: on ``--recompute`` sampled sequences, the target is rerun in transformers and the
max relative error per captured layer (||stored - ref|| / ||ref|| per sequence) is printed;
above ``--max-rel-err`` the command fails. fp8 shards are dequantized first, and their scales
must be finite and >= 0; their default limit adds the format's error bound. Exit status 0
only when everything holds, 1 when a check fails, 2 (one ``error:`` line) when the directory
is not a dataset this code reads.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Optional

import torch

from dspark.core import derived_files, fp8
from dspark.core.errors import exit_on_user_error
from dspark.core.layer_ids import reference_hidden_states
from dspark.formats.shard_format import (
    MANIFEST,
    SPLITS,
    TOPK_NAME,
    DatasetError,
    Manifest,
    ShardInfo,
    arrow_cache_source,
    cache_path,
    stale_caches,
    topk_source,
)
from dspark.formats.shard_rows import decode_hidden_states, read_shard


def read_sidecar(path: Path) -> ShardInfo:
    try:
        return ShardInfo(**json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
        raise ValueError(f"{path}: damaged sidecar ({e})") from None


def default_limit(manifest: Manifest) -> float:
    """The relative error a correct dataset stays under: 1e-4 for float32; 1e-2 for 16-bit (their
    rounding plus vLLM's kernels against transformers'); for fp8, that 1e-2 plus the format's
    bound per row (triangle inequality: ||q(x) - ref|| <= ||q(x) - x|| + ||x - ref||, with
    ||x|| <= 1.01 ||ref||)."""
    if manifest.dtype == "float32":
        return 1e-4
    if manifest.dtype in fp8.FORMATS:
        return 1e-2 + 1.01 * fp8.FORMATS[manifest.dtype].row_rel_bound(manifest.hidden_size)
    return 1e-2


def check_shards(directory: Path, manifest: Manifest) -> tuple[list[str], list[dict]]:
    """Return (problems, sample pool of the rows that passed: file, row, ids and the raw
    ``hidden_states`` cell, decoded when recomputed)."""
    problems: list[str] = []
    pool: list[dict] = []
    recorded = {info.path: info for info in manifest.shards}
    sidecars = {
        f"{p.parent.name}/{p.stem}.parquet": p for s in SPLITS for p in sorted((directory / s).glob("shard-*.json"))
    }
    on_disk = {f"{p.parent.name}/{p.name}" for s in SPLITS for p in (directory / s).glob("shard-*.parquet")}
    for path in sorted(set(recorded) | set(sidecars) | on_disk):
        file = directory / path
        try:
            info = recorded.get(path) or (read_sidecar(sidecars[path]) if path in sidecars else None)
        except ValueError as e:
            problems.append(f"{e}; resume rebuilds the shard")
            continue
        if info is None:
            problems.append(f"{file}: shard without a sidecar (unfinished write?); resume rebuilds it")
            continue
        source = MANIFEST if path in recorded else "its sidecar"
        table, problem, bad_rows = read_shard(directory, info, manifest, recorded_in=source)
        if table is None:  # the file itself, the same decision training makes
            problems.append(f"{problem}; resume rebuilds it")
            continue
        problems.extend(bad_rows.values())
        for i, row in enumerate(table.to_pylist()):
            if i in bad_rows:
                continue
            hs = decode_hidden_states(
                row["hidden_states"],
                dtype=manifest.dtype,
                n_layers=len(manifest.layer_ids),
                hidden=manifest.hidden_size,
            )
            if not torch.isfinite(hs).all():
                problems.append(f"{file}: row {i} ({row['seq_id']}): NaN/inf in hidden_states")
                continue
            pool.append({"file": file, "row": i, "ids": row["input_ids"], "cell": row["hidden_states"]})
    if not manifest.complete:
        problems.append(f"{directory / 'manifest.json'}: field 'complete' is false; some planned shards are missing")
    return problems, pool


def damaged_caches(directory: Path, manifest: Manifest) -> list[tuple[Path, str]]:
    """Every derived file the dataset holds for this manifest (the shards' Arrow caches, the
    target's top-k caches, the token counts), hashed in full against the record of its build
    (:mod:`dspark.core.derived_files`): (path, why) for each that training would not reuse."""
    checks: list[tuple[Path, Optional[str]]] = [
        (cache_path(directory, info), arrow_cache_source(info)) for info in manifest.shards
    ]
    checks = [(p, src) for p, src in checks if p.is_file()]
    by_name = {(info.split, info.name, info.sha256[:12]): info for info in manifest.shards}
    for path in sorted((directory / derived_files.TOPK_DIR).rglob("*.safetensors")):
        m = TOPK_NAME.match(path.name)  # bound to the shard its name says it was built from
        info = by_name.get((path.parent.name, m["shard"], m["sha"])) if m else None
        src = topk_source(info, k=int(m["k"]), rule=m["rule"], head_id=m["head"]) if m and info else None
        checks.append((path, src))
    checks += [(p, None) for p in sorted((directory / derived_files.COUNTS_DIR).rglob("*.safetensors"))]
    out = []
    for path, src in checks:
        why = derived_files.problem(path, full=True, source=src)
        if why:
            out.append((path, why))
    return out


def recompute_errors(manifest: Manifest, pool: list[dict], n: int, seed: int = 0) -> dict[int, float]:
    """Max relative error per layer id over ``n`` sampled sequences, against transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(manifest.target_path, dtype=torch.float32)
    model.eval()
    worst = {i: 0.0 for i in manifest.layer_ids}
    for item in random.Random(seed).sample(pool, min(n, len(pool))):
        ids = torch.tensor(item["ids"][:-1])
        ref = reference_hidden_states(model, ids, manifest.layer_ids)  # [T-1, L, H]
        stored = decode_hidden_states(
            item["cell"], dtype=manifest.dtype, n_layers=len(manifest.layer_ids), hidden=manifest.hidden_size
        ).float()
        for j, layer in enumerate(manifest.layer_ids):
            err = ((stored[:, j] - ref[:, j]).norm() / ref[:, j].norm().clamp_min(1e-12)).item()
            worst[layer] = max(worst[layer], err)
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_tools.verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", type=Path, help="dataset directory (holds manifest.json)")
    ap.add_argument(
        "--recompute", type=int, default=4, metavar="N", help="sequences to recompute with transformers (0: skip)"
    )
    ap.add_argument(
        "--max-rel-err",
        type=float,
        default=None,
        help="fail above this relative error (default 1e-4 for float32 shards, 1e-2 for 16-bit, "
        "1e-2 + the format's bound for fp8: about 0.073 for e4m3, 0.136 for e5m2)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = ap.parse_args(argv)
    with exit_on_user_error():  # a missing or unreadable manifest, a target that is gone: rc 2
        manifest = Manifest.load(args.directory)
        if args.recompute and not (Path(manifest.target_path) / "config.json").is_file():
            raise DatasetError(
                f"{args.directory / MANIFEST}: field 'target_path' is {manifest.target_path!r}, which has no "
                "config.json, expected the target the dataset was extracted from; pass --recompute 0 to check "
                "integrity only"
            )
    problems, pool = check_shards(args.directory, manifest)
    stale = stale_caches(args.directory, manifest)
    for cache in stale:  # built from other bytes than the manifest's shards, or before shards were verified
        derived_files.remove(cache)
    if stale:
        print(f"dropped {len(stale)} Arrow cache(s) no verified shard of this manifest produced: " + ", ".join(
            str(c.relative_to(args.directory)) for c in stale[:5]) + (" ..." if len(stale) > 5 else ""))  # fmt: skip
    rows = len(pool)
    for cache, why in damaged_caches(args.directory, manifest):
        derived_files.remove(cache)
        print(f"dropped {cache}: {why}; the next run rebuilds it from its verified source")
    print(f"{args.directory}: {len(manifest.shards)} shards in manifest, {rows} rows decoded, {len(problems)} problems")
    for p in problems:
        print(f"  PROBLEM {p}")
    errors: dict[int, float] = {}
    limit = args.max_rel_err if args.max_rel_err is not None else default_limit(manifest)
    if args.recompute and pool and manifest.layer_ids:  # token-id shards have no states to recompute
        errors = recompute_errors(manifest, pool, args.recompute)
        print(f"max relative error per layer over {min(args.recompute, rows)} sequences (limit {limit:g}):")
        for layer, err in errors.items():
            print(f"  layer {layer:>4}: {err:.3e}{'  TOO HIGH' if err > limit else ''}")
    if args.json:
        args.json.write_text(
            json.dumps({"rows": rows, "problems": problems, "max_rel_err": errors, "limit": limit}, indent=2)
        )
    ok = not problems and all(e <= limit for e in errors.values())
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
