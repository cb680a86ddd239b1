"""What one training sequence holds for backward at long training windows (issue #47, item 5): the
drafter's real forward (its family's layers, the heads, the draft logits) run on the meta device at
a preset's sizes, every tensor autograd saves counted once (by storage), so no GPU and no memory is
needed for K3's 7168-wide layers at 128k tokens.

    python benchmarks/long_context_memory.py +experiment=kimi_k3_gb300 [--tokens 16384 65536 131072]

Attention is counted as a memory-efficient kernel runs it on a GPU (flash / mem-efficient SDPA: it
keeps q, k, v, the mask, its output and a log-sum-exp, never the [L, S] probabilities), not as the
math path the meta device would take. The weights, gradients and Adam states are counted apart:
16 bytes a trainable parameter in bf16 mixed precision (bf16 weight and gradient, fp32 master and
two moments), divided by the data-parallel ranks under ZeRO 2/3 where the preset shards them.
Prints a Markdown table (docs/benchmarks.md quotes it).
"""

from __future__ import annotations

import argparse
import math
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

GIB = 1024**3
GB300_GIB = 288e9 / GIB  # a GB300's HBM3e: 288 GB


class _EfficientAttention(torch.autograd.Function):
    """SDPA as a memory-efficient kernel saves it: inputs, output and a log-sum-exp per query."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):  # noqa: ANN001 - autograd's signature
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, *([mask] if mask is not None else []), out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001 - never run: the meta pass only counts
        raise NotImplementedError


def _sdpa(q, k, v, attn_mask=None, scale=None, **_):  # noqa: ANN001 - F.scaled_dot_product_attention's
    if k.shape[1] != q.shape[1]:  # GQA: expanded keys/values, as the family passes them
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return _EfficientAttention.apply(q, k, v, attn_mask, scale)


def _storage(t: torch.Tensor) -> int:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage()).cdata


@contextmanager
def _counting(model: torch.nn.Module):
    """Sum the bytes of every distinct storage autograd saves inside the block, the model's own
    weights (trainable or frozen: counted with the weights) left out."""
    weights = {_storage(p) for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        if key not in weights:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        mock.patch.object(F, "scaled_dot_product_attention", _sdpa),
    ):
        yield seen


def sequence_bytes(cfg, dims, tokens: int, anchors: int, dtype: torch.dtype, device: str = "meta") -> int:  # noqa: ANN001
    """Bytes saved for backward by one sequence of ``tokens`` (its states held as the batch too);
    ``device`` meta counts without computing (tests/dspark/test_long_context_memory.py checks it
    against the same count on real CPU tensors)."""
    from dspark.model import unloaded_drafter

    model = unloaded_drafter(cfg, dims, device).to(dtype)
    with torch.device(device):
        ids = torch.zeros(1, tokens, dtype=torch.long)
        states = torch.randn(1, tokens - 1, dims.num_context_layers * dims.target_hidden_size, dtype=dtype)
        step = max(1, (tokens - 2 - cfg.block_size) // anchors)
        anchor_pos = torch.arange(1, 1 + step * anchors, step)[None].clamp(max=tokens - 2)
    with _counting(model) as seen:
        out = model(ids, states, anchor_pos)
        model.draft_logits(out.hidden, out.markov_embed)
    # the states are the batch's whether or not fc saved them (it does: counted once)
    if _storage(states) not in seen:
        seen[_storage(states)] = states.untyped_storage().nbytes()
    return sum(seen.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536, 131072])
    ap.add_argument("--ranks", type=int, default=16, help="data-parallel ranks sharding ZeRO's states")
    args, overrides = ap.parse_known_args(argv)
    from dataclasses import replace

    from family_costs import K2_SIZED_TEXT
    from hydra import compose, initialize_config_dir

    from dspark.config import load_config
    from dspark.families import FAMILIES
    from dspark.model import resolve_dims, trainable_parameter_shapes

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=overrides))
    t = cfg.train
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[t.dtype]
    stage = cfg.deepspeed.zero_optimization.stage
    print(
        f"target: K2-sized stand-in (benchmarks/family_costs.py); {t.anchors_per_seq} anchors x block "
        f"{cfg.drafter.block_size}, {cfg.drafter.num_layers} layers, {t.dtype}, ZeRO {stage} over {args.ranks} ranks\n"
    )
    print(
        "| family | trainable params | weights + grads + Adam per GPU (+ the target's frozen heads) | "
        + " | ".join(f"one {n // 1024}k sequence" for n in args.tokens)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(args.tokens))
    for name, family in FAMILIES.items():
        dcfg = replace(cfg.drafter, family=name, **{k: None for k in family.config_fields})
        dims = resolve_dims(
            dcfg,
            target_config=K2_SIZED_TEXT,
            vocab_size=int(K2_SIZED_TEXT["vocab_size"]),
            num_context_layers=len(cfg.context_layer_ids()),
            mask_token_id=0,
        )
        params = sum(math.prod(s) for s in trainable_parameter_shapes(dcfg, dims).values())
        shard = {0: (1, 1, 1), 1: (1, 1, args.ranks), 2: (1, args.ranks, args.ranks)}.get(stage, (args.ranks,) * 3)
        frozen = (2 * dims.vocab_size * dims.hidden_size + dims.target_hidden_size) * 2  # embedding, LM head, norm
        states = params * (2 / shard[0] + 2 / shard[1] + 12 / shard[2]) + frozen
        cells = [f"{sequence_bytes(dcfg, dims, n, t.anchors_per_seq, dtype) / GIB:.1f} GiB" for n in args.tokens]
        print(f"| {name} | {params / 1e9:.2f} B | {states / GIB:.1f} GiB | " + " | ".join(cells) + " |")
    print(f"\nA GB300 holds {GB300_GIB:.0f} GiB.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
