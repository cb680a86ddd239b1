"""Where a training step's time goes, by part of the drafter, forward and backward.

    python benchmarks/train_profile.py                       # the demo's step: 2 x 512 tokens, 16 anchors
    python benchmarks/train_profile.py --anchors 64 --json outputs/benchmarks/profile.json

Times the trainer's own model and loss (SmolLM2-135M's shapes, random frozen heads: no target
or shards needed) with wall-clock hooks on the drafter's modules: the context projection
(fc + hidden_norm), the decoder layers (+ final norm), the LM head for the draft distribution
(with grad) and for the target distribution (without, with the target's final norm), the
Markov head and the confidence head. What the hooks do not cover is the rest of the loss
(softmaxes, CE/TV, gathers, the embedding of the blocks) and is reported as such; the
optimizer step is timed on its own. Work done in backward (gradients, and the loss chunks
recomputed under activation checkpointing) counts as that part's backward. Median over
``--steps`` after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from synthetic_step import add_shape_args, build

from dspark.model import DSparkDrafter

CTX, LAYERS = "context projection (fc + hidden_norm)", "decoder layers (+ final norm)"
DRAFT_HEAD, TARGET = "draft LM head (with grad)", "target distribution (final norm + LM head, no grad)"
MARKOV, CONF = "Markov head (W1 embedding, W2 output)", "confidence head"
REST, OPT = "rest of the loss and glue (softmaxes, CE/TV, gathers, block embedding)", "optimizer step (AdamW)"


class PartTimer:
    """Wall-clock time per part and phase from forward and full-backward hooks."""

    def __init__(self, model: DSparkDrafter):
        self.time: dict[tuple[str, str], float] = defaultdict(float)
        self.phase = "forward"
        self._start: dict[tuple[int, str], float] = {}
        parts = [
            (model.fc, CTX),
            (model.hidden_norm, CTX),
            *[(m, LAYERS) for m in model.layers],
            (model.norm, LAYERS),
            (model.lm_head, None),
            (model.target_norm, TARGET),
        ]
        if model.markov_head is not None:
            parts += [(m, MARKOV) for m in model.markov_head.children()]
        if model.confidence_head is not None:
            parts += [(model.confidence_head["proj"], CONF)]
        for mod, part in parts:
            mod.register_forward_pre_hook(self._begin(mod, "f"))
            mod.register_forward_hook(self._end(mod, "f", part))
            mod.register_full_backward_pre_hook(self._begin(mod, "b"))
            mod.register_full_backward_hook(self._end(mod, "b", part))

    def _begin(self, mod, kind):  # noqa: ANN001, ANN202
        def hook(*_):
            self._start[(id(mod), kind)] = time.perf_counter()

        return hook

    def _end(self, mod, kind, part):  # noqa: ANN001, ANN202
        def hook(*_):
            start = self._start.pop((id(mod), kind), None)
            if start is None:
                return
            name = part or (DRAFT_HEAD if torch.is_grad_enabled() or kind == "b" else TARGET)  # lm_head: both
            self.time[(name, self.phase)] += time.perf_counter() - start

        return hook


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p, steps=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fused-adamw", action="store_true", help="torch's fused AdamW kernel (CPU and CUDA)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # fc's input needs no grad: fine
    syn = build(args)
    model = syn.model
    timer = PartTimer(model)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=args.fused_adamw or None)
    rows: list[dict[tuple[str, str], float]] = []
    predictions = 0
    for step in range(args.steps + 1):
        timer.time.clear()
        timer.phase = "forward"
        t0 = time.perf_counter()
        res = syn.loss()
        t1 = time.perf_counter()
        timer.phase = "backward"
        res.loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        row = dict(timer.time)
        row[(REST, "forward")] = (t1 - t0) - sum(v for (_, ph), v in timer.time.items() if ph == "forward")
        row[(REST, "backward")] = (t2 - t1) - sum(v for (_, ph), v in timer.time.items() if ph == "backward")
        row[(OPT, "step")] = t3 - t2
        row[("total", "step")] = t3 - t0
        predictions = res.num_positions
        if step > 0:
            rows.append(row)
    keys = sorted({k for r in rows for k in r})
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    total = med[("total", "step")]
    order = [CTX, LAYERS, DRAFT_HEAD, TARGET, MARKOV, CONF, REST, OPT]
    print(
        f"step {1e3 * total:.0f} ms for {predictions} predictions ({predictions / total:.0f} predictions/s), "
        f"{args.batch} x {args.seq} tokens, {args.anchors} anchors, {args.threads} threads, "
        f"target {'top-' + str(args.topk) if args.topk else 'full'}, recompute {not args.no_recompute}, "
        f"fused AdamW {args.fused_adamw}"
    )
    print(f"{'part':<72} {'forward ms':>10} {'backward ms':>11} {'share':>6}")
    report = {
        "args": vars(args) | {"json": str(args.json)},
        "step_ms": 1e3 * total,
        "predictions": predictions,
        "parts": {},
    }
    for part in order:
        f = med.get((part, "forward"), 0.0)
        bw = med.get((part, "backward"), 0.0) + med.get((part, "step"), 0.0)
        report["parts"][part] = {"forward_ms": 1e3 * f, "backward_ms": 1e3 * bw, "share": (f + bw) / total}
        print(f"{part:<72} {1e3 * f:>10.1f} {1e3 * bw:>11.1f} {100 * (f + bw) / total:>5.1f}%")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
