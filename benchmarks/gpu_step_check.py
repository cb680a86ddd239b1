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
from synthetic_step import add_shape_args, build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p, steps=10)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script")
    a = p.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    report = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": vars(a),
    }
    for dtype in (torch.float32, torch.bfloat16):
        syn = build(a).to(dev, dtype)  # the same weights and batch for both dtypes
        model = syn.model
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)

        def step():
            res = syn.loss()
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
            "loss": float(first.loss.detach()),
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
