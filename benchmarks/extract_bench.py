"""Extraction benchmark on the embedded target (one run, one machine):

1. capture throughput (vLLM prefill with hidden-state capture, packing and shard write) against
   plain vLLM prefill of the same prompts, same engine settings and environment;
2. bytes per token on disk against the raw floor (n_layers x hidden x bytes per value);
3. shard read MB/s and ms per random sequence on one core, through dspark.data.shards.

    .venv/bin/python benchmarks/extract_bench.py [--prompts 64] [--out outputs/benchmarks/extract.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort, the object is dropped anyway
        pass
    del llm
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("outputs/benchmarks/extract.json"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    # vLLM's CPU auto-binding reserves more cores when a KV connector is configured, so the two
    # engines would run on different core sets: pin both to the same one (core 1; core 0 is
    # left to the engine-core scheduler and this driver).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from data_tools.extract import Request, capture_rows, engine_kwargs, make_engine
    from data_tools.prompts import bundled_conversations, dedupe_and_split
    from data_tools.shard_writer import finalize, write_shard
    from dspark.config import DataConfig, TargetConfig
    from dspark.data.shards import ShardDataset
    from dspark.formats.shard_format import Manifest
    from dspark.target import resolve_target

    spec = TargetConfig()
    path = resolve_target(spec).path
    tok = AutoTokenizer.from_pretrained(str(path))
    convs = dedupe_and_split(bundled_conversations(), val_fraction=0.0)["train"][: args.prompts]
    seqs = []
    for c in convs:
        text = tok.apply_chat_template(
            [{"role": r, "content": t} for r, t in c.messages], tokenize=False, add_generation_prompt=True
        )
        seqs.append(tok(text, add_special_tokens=False).input_ids[:1024])
    n_tokens = sum(len(s) for s in seqs)
    capture_ids = spec.capture_layer_ids(30)
    data = DataConfig(max_seq_len=1100, seed=0, temperature=0.0, store_dtype="float32")
    work = Path(tempfile.mkdtemp(prefix="dspark-bench-"))
    kw = engine_kwargs(spec, path, capture_ids, data, work / "req")
    plain_kw = {k: v for k, v in kw.items() if k not in ("speculative_config", "kv_transfer_config")}
    results: dict = {
        "prompts": len(seqs),
        "prompt_tokens": n_tokens,
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")},
    }

    # 1. plain prefill
    llm = LLM(**plain_kw)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": s} for s in seqs[:4]], sp, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": s} for s in seqs], sp, use_tqdm=False)
    plain_s = time.perf_counter() - t0
    _shutdown(llm)

    # 1b. prefill with capture, packing rows and writing the shard
    llm = make_engine(kw, data)
    reqs = [Request(f"{i:016x}", s, [], 1) for i, s in enumerate(seqs)]
    capture_rows(llm, reqs[:4], data, n_layers=len(capture_ids), hidden=576)  # warm-up
    t0 = time.perf_counter()
    rows = capture_rows(llm, reqs, data, n_layers=len(capture_ids), hidden=576)
    capture_only_s = time.perf_counter() - t0
    ds_dir = work / "ds"
    ds_dir.mkdir()
    write_shard(rows, ds_dir, "train", 0, "zstd", Counter())
    capture_s = time.perf_counter() - t0
    _shutdown(llm)
    results["capture"] = {
        "plain_prefill_tok_s": n_tokens / plain_s,
        "capture_tok_s": n_tokens / capture_only_s,
        "capture_and_write_tok_s": n_tokens / capture_s,
        "ratio_capture_vs_plain": plain_s / capture_only_s,
        "ratio_capture_and_write_vs_plain": plain_s / capture_s,
    }

    # 2. bytes per token
    stored_tokens = sum(r["num_tokens"] for r in rows)
    results["bytes_per_token"] = {}
    for dtype, nbytes in (("float32", 4), ("float16", 2), ("bfloat16", 2)):
        conv = (
            rows
            if dtype == "float32"
            else [
                {
                    **r,
                    "hidden_states": torch.frombuffer(bytearray(r["hidden_states"]), dtype=torch.float32)
                    .to({"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype])
                    .view(torch.uint8)
                    .numpy()
                    .tobytes(),
                }
                for r in rows
            ]
        )
        for comp in ("none", "zstd"):
            d = work / f"b-{dtype}-{comp}"
            info = write_shard(conv, d, "train", 0, comp, Counter())
            floor = len(capture_ids) * 576 * nbytes
            results["bytes_per_token"][f"{dtype}/{comp}"] = {
                "bytes_per_token": info.bytes / stored_tokens,
                "raw_floor": floor,
                "ratio": info.bytes / stored_tokens / floor,
            }

    # 3. reads on one core, from the default format (float32, zstd)
    Manifest(
        target="smollm2-135m",
        target_path=str(path),
        revision=None,
        architecture="LlamaForCausalLM",
        tokenizer_sha256="",
        chat_template_sha256="",
        layer_ids=capture_ids,
        num_hidden_layers=30,
        hidden_size=576,
        dtype="float32",
        compression="zstd",
    ).save(ds_dir)
    finalize(ds_dir, [("train", 0)])
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    ds = ShardDataset(ds_dir)
    results["read"] = {"first_open_with_arrow_cache_build_s": time.perf_counter() - t0}
    order = list(range(len(ds))) * 5
    random.Random(0).shuffle(order)
    nbytes = 0
    t0 = time.perf_counter()
    for i in order:
        hs = ds[i].hidden_states.clone()  # what a collate does: the bytes are really read
        nbytes += hs.numel() * hs.element_size()
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in order:
        ds[i]
    lookup_s = time.perf_counter() - t0
    results["read"].update(
        {
            "MB_s": nbytes / read_s / 1e6,
            "ms_per_random_sequence": read_s / len(order) * 1e3,
            "ms_per_lookup_zero_copy": lookup_s / len(order) * 1e3,
            "mean_sequence_MB": nbytes / len(order) / 1e6,
        }
    )
    shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
