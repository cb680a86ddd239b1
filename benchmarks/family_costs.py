"""What each drafter family costs at a preset's shapes: trainable parameters, the training step's
model FLOPs (dspark.flops, the count pinned to torch's FlopCounterMode), and the serving cache
per token (vLLM's KV cache for a GQA drafter, its latent cache for an MLA one).

    python benchmarks/family_costs.py +experiment=kimi_k3_gb300 [--target-config FILE] [--context 100000]

Pure arithmetic: no target, no GPU. The target's text config comes from ``--target-config`` (a
config.json, its ``text_config`` when it has one), else the K2-sized stand-in below, since no K3
config.json is on this machine. Prints a Markdown table (docs/benchmarks.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

K2_SIZED_TEXT = {
    "hidden_size": 7168,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 112,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 163840,
}
"""Kimi K2's published attention sizes and vocabulary (hidden 7168 as the K3 preset's): what a
drafter as wide as the target copies when no K3 config.json is given."""
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-config", type=Path, default=None)
    ap.add_argument("--context", type=int, default=100_000, help="request length for the cache column")
    args, overrides = ap.parse_known_args(argv)
    from dataclasses import replace

    from hydra import compose, initialize_config_dir

    from dspark.config import load_config
    from dspark.families import FAMILIES
    from dspark.flops import step_flops
    from dspark.model import resolve_dims, trainable_parameter_shapes

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=overrides))
    if args.target_config is not None:
        text = json.loads(args.target_config.read_text())
        text = text.get("text_config", text)
        source = str(args.target_config)
    else:
        text, source = K2_SIZED_TEXT, "K2-sized stand-in (benchmarks/family_costs.py K2_SIZED_TEXT)"
    t = cfg.train
    ctx_layers = len(cfg.context_layer_ids())
    width = BYTES[t.dtype]
    print(
        f"target: {source}; step: {t.micro_batch_size} x {t.max_seq_len} tokens, {t.anchors_per_seq} anchors, "
        f"gamma {cfg.drafter.block_size}, {cfg.drafter.num_layers} layers, {t.dtype}\n"
    )
    print(
        "| family | vLLM class | trainable params | step model FLOPs | per prediction | cache per token and layer "
        f"| cache for a {args.context // 1000}k-token request |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, family in FAMILIES.items():
        dcfg = replace(cfg.drafter, family=name, **{k: None for k in family.config_fields})
        dims = resolve_dims(
            dcfg,
            target_config=text,
            vocab_size=int(text["vocab_size"]),
            num_context_layers=ctx_layers,
            mask_token_id=0,
        )
        params = sum(math.prod(s) for s in trainable_parameter_shapes(dcfg, dims).values())
        flops = step_flops(
            dcfg,
            dims,
            sequences=t.micro_batch_size,
            tokens=t.max_seq_len,
            anchors=t.anchors_per_seq,
            recompute_vocab_chunks=t.recompute_vocab_chunks,
        )
        per_tok = family.cache_values_per_token(dims)
        request = per_tok * width * dcfg.num_layers * args.context
        print(
            f"| {name} | {family.architectures['dspark']} | {params / 1e9:.2f} B | {flops.model / 1e12:.1f} TFLOP "
            f"| {flops.per_prediction / 1e9:.2f} GFLOP | {per_tok} values ({per_tok * width / 1024:.2f} KiB) "
            f"| {request / 1e9:.2f} GB |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
