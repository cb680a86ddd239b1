"""One drafter training step on a GPU, bf16 against fp32: the model and loss as the trainer runs
them (no DeepSpeed, no target download: random frozen heads of the target's shape).

    python benchmarks/gpu_step_check.py --hidden 576 --vocab 49152 --seq 512 --batch 2 --anchors 16

Prints the step time per dtype and the bf16/fp32 loss terms for the same weights and batch, so
a refactor of the model or loss can be checked on CUDA in one command. Needs a CUDA device
(``--device cpu`` only smoke-tests the script).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dspark.core.config import DSparkConfig
from dspark.loss import LossConfig, dspark_loss
from dspark.model import DSparkDrafter, resolve_dims, sample_anchors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--context-layers", type=int, default=5)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script")
    a = p.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    h, v = a.hidden, a.vocab
    cfg = DSparkConfig()
    dims = resolve_dims(
        cfg,
        target_config={"hidden_size": h, "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads},
        vocab_size=v,
        num_context_layers=a.context_layers,
        mask_token_id=0,
    )
    heads = dict(embed_tokens=torch.randn(v, h) * 0.02, lm_head=torch.randn(v, h) * 0.02, target_norm=torch.ones(h))
    ids = torch.randint(0, v, (a.batch, a.seq))
    mask = torch.zeros(a.batch, a.seq, dtype=torch.bool)
    mask[:, a.seq // 4 :] = True
    lengths = torch.full((a.batch,), a.seq)
    ctx = torch.randn(a.batch, a.seq - 1, a.context_layers * h)
    final = torch.randn(a.batch, a.seq - 1, h)
    anchors, valid = sample_anchors(mask, lengths, a.anchors, torch.Generator().manual_seed(0))
    lcfg = LossConfig(ce_weight=0.1, tv_weight=0.9, confidence_weight=1.0, position_decay=4.0)
    report = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": vars(a),
    }
    state = None
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(1)
        model = DSparkDrafter(cfg, dims, **heads, target_norm_eps=1e-6)
        if state is None:
            state = {k: t.clone() for k, t in model.state_dict().items()}
        model.load_state_dict(state)
        model = model.to(dev, dtype)
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
        batch = [t.to(dev) for t in (ids, mask, lengths, anchors, valid)] + [ctx.to(dev, dtype), final.to(dev, dtype)]
        d_ids, d_mask, d_len, d_anc, d_valid, d_ctx, d_final = batch

        def step():
            out = model(d_ids, d_ctx, d_anc)
            res = dspark_loss(
                model,
                out,
                input_ids=d_ids,
                final_states=d_final,
                anchor_positions=d_anc,
                valid_anchors=d_valid,
                loss_mask=d_mask,
                lengths=d_len,
                cfg=lcfg,
            )
            res.loss.backward()
            return res

        first = step()  # warm-up, and the loss of the shared initial weights
        opt.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        name = str(dtype).removeprefix("torch.")
        report[name] = {
            "step_ms": 1e3 * (time.perf_counter() - t0) / a.steps,
            "loss": float(first.loss),
            "ce": float(first.ce),
            "tv": float(first.tv),
            "predictions": first.num_positions,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
        }
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
    report["bf16_vs_fp32_loss_rel"] = (
        abs(report["bfloat16"]["loss"] - report["float32"]["loss"]) / report["float32"]["loss"]
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
