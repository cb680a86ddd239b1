"""Where a training step's time goes, by part of the drafter, forward and backward, with its FLOPs.

    python benchmarks/train_profile.py                       # the demo's step: 2 x 512 tokens, 16 anchors
    python benchmarks/train_profile.py --anchors 64 --json outputs/benchmarks/profile.json
    python benchmarks/train_profile.py --device cuda --dtype bfloat16 \\
        --micro-batch 8 --window 8192 --anchors 128 --colocated-target   # the GPU preset's step

Times the trainer's own model and loss (SmolLM2-135M's shapes, random frozen heads: no target
or shards needed). First the step as the trainer runs it (median over ``--steps`` after the
warm-up): its time, predictions/s, model FLOPs (:mod:`dspark.flops`, per prediction too), the
FLOP/s and MFU over the device's dense peak (a known GPU in bf16/fp16, or ``--peak-tflops``).
Then the same steps again with wall-clock hooks on the drafter's modules, for the parts: the
context projection (fc + hidden_norm), the decoder layers (+ final norm), the LM head for the
draft distribution (with grad) and for the target distribution (without, with the target's final
norm), the Markov head and the confidence head; with ``--colocated-target`` a random target of
the SmolLM2-135M decoder's shape computes the batch's states first, as ``data.mode=colocated``
does (out to the host and back included). What the hooks do not cover is the rest of the loss
(softmaxes, CE/TV, gathers, the embedding of the blocks) and is reported as such; the optimizer
step is timed on its own. Work done in backward (gradients, and the loss chunks recomputed under
activation checkpointing) counts as that part's backward. On CUDA the hooks synchronize the
device, so the parts add up to a somewhat slower step than the first one. ``--compile`` runs the
drafter's forward under ``torch.compile`` and skips the parts (hooks and compile do not mix).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import torch
from synthetic_step import SyntheticStep, add_shape_args, build

from dspark.data.colocated import TOKENS_PER_CALL
from dspark.flops import TargetShape, peak_flops, step_flops
from dspark.model import DSparkDrafter
from dspark.optim import build_optimizer
from dspark.precision import resolve_autocast

CTX, LAYERS = "context projection (fc + hidden_norm)", "decoder layers (+ final norm)"
DRAFT_HEAD, TARGET = "draft LM head (with grad)", "target distribution (final norm + LM head, no grad)"
MARKOV, CONF = "Markov head (W1 embedding, W2 output)", "confidence head"
COLOCATED = "colocated target forward (no grad; states to the host and back)"
REST, OPT = "rest of the loss and glue (softmaxes, CE/TV, gathers, block embedding)", "optimizer step (AdamW)"
ORDER = [COLOCATED, CTX, LAYERS, DRAFT_HEAD, TARGET, MARKOV, CONF, REST, OPT]
#: each profiled part -> the dspark.flops parts it runs
FLOP_PARTS = {
    COLOCATED: ["colocated target (no grad)"],
    CTX: ["context projection (fc)"],
    LAYERS: ["context K/V (every layer)", "draft layers: projections + MLP", "draft layers: attention"],
    DRAFT_HEAD: ["draft LM head"],
    TARGET: ["target LM head (no grad)"],
    MARKOV: ["Markov head"],
    CONF: ["confidence head"],
}
#: SmolLM2-135M's decoder (the colocated target): layers, MLP width; width and heads are --hidden, --heads
TARGET_LAYERS, TARGET_INTERMEDIATE = 30, 1536


class PartTimer:
    """Wall-clock time per part and phase from forward and full-backward hooks (``sync``: the
    device's, so that asynchronous work is charged to the part that queued it)."""

    def __init__(self, model: DSparkDrafter, sync: Callable[[], None]):
        self.time: dict[tuple[str, str], float] = defaultdict(float)
        self.phase, self.sync = "forward", sync
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
            self.sync()
            self._start[(id(mod), kind)] = time.perf_counter()

        return hook

    def _end(self, mod, kind, part):  # noqa: ANN001, ANN202
        def hook(*_):
            start = self._start.pop((id(mod), kind), None)
            if start is None:
                return
            self.sync()
            name = part or (DRAFT_HEAD if torch.is_grad_enabled() or kind == "b" else TARGET)  # lm_head: both
            self.time[(name, self.phase)] += time.perf_counter() - start

        return hook


class RandomTarget:
    """A random Llama decoder of the target's shape that computes the batch's context and final
    states from its token ids, in calls of at most ``TOKENS_PER_CALL`` tokens and out to the host,
    as :class:`dspark.data.colocated.ColocatedTarget` does; they go back to the device as a batch does."""

    def __init__(self, args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
        from transformers import LlamaConfig, LlamaModel

        config = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.target_intermediate,
            num_hidden_layers=args.target_layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=max(8192, args.seq),
        )
        self.decoder = LlamaModel(config).to(device, dtype).eval().requires_grad_(False)
        self.shape = TargetShape.of(config.to_dict())
        step = max(1, args.target_layers // args.context_layers)
        self.layers = [min(i * step + 1, args.target_layers - 1) for i in range(args.context_layers)]

    @torch.no_grad()
    def states(self, syn: SyntheticStep) -> None:
        ids = syn.batch["input_ids"][:, :-1]
        per_call = max(1, TOKENS_PER_CALL // ids.shape[1])
        ctx, final = [], []
        for s in range(0, len(ids), per_call):
            res = self.decoder(input_ids=ids[s : s + per_call], output_hidden_states=True, use_cache=False)
            hs = res.hidden_states
            ctx.append(torch.cat([hs[i] for i in self.layers], dim=-1).cpu())
            final.append(hs[-1].cpu())  # (the final norm's output: the real one hooks its input; same cost)
        device, dtype = syn.batch["context_states"].device, syn.batch["context_states"].dtype
        syn.batch["context_states"] = torch.cat(ctx).to(device, dtype)
        syn.batch["final_states"] = torch.cat(final).to(device, dtype)


def device_peak(args: argparse.Namespace, device: torch.device) -> tuple[Optional[float], str]:
    """(peak FLOP/s, where it comes from): ``--peak-tflops``, else dspark.flops' table for a GPU."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "--peak-tflops"
    if device.type != "cuda":
        return None, "no known peak for a CPU; --peak-tflops gives one"
    name = torch.cuda.get_device_name(device)
    peak = peak_flops(name, args.dtype)
    return peak, (f"{name}, {args.dtype} dense" if peak else f"{name} in {args.dtype}: not in dspark.flops.PEAK_FLOPS")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p, steps=5)
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="train.dtype")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fused-adamw", action="store_true", help="torch's fused AdamW kernel (CPU and CUDA)")
    p.add_argument("--compile", action="store_true", help="torch.compile the drafter's forward (no parts)")
    p.add_argument("--autocast", choices=("off", "bfloat16"), default="off", help="train.autocast (fp32 weights)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw", help="train.optimizer")
    p.add_argument(
        "--colocated-target", action="store_true", help="data.mode=colocated: a target forward computes the states"
    )
    p.add_argument("--target-layers", type=int, default=TARGET_LAYERS)
    p.add_argument("--target-intermediate", type=int, default=TARGET_INTERMEDIATE)
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, for MFU where none is known")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # fc's input needs no grad: fine
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    syn = build(args).to(device, dtype)
    model = syn.model
    target = RandomTarget(args, device, dtype) if args.colocated_target else None
    opt = build_optimizer(
        model,
        SimpleNamespace(
            optimizer=args.optimizer,
            lr=1e-4,
            weight_decay=0.0,
            muon_lr=0.02,
            muon_momentum=0.95,
            muon_weight_decay=0.1,
            fused_optimizer=args.fused_adamw,
        ),
    )
    autocast = resolve_autocast(args.autocast, device, args.dtype)
    if args.compile:
        model.compile()
    warmup = 2 if args.compile else 1

    def step(timer: Optional[PartTimer]) -> tuple[dict[tuple[str, str], float], int]:
        """One step as the trainer runs it; (times by part and phase, predictions)."""
        times: dict[tuple[str, str], float] = {}
        sync()
        t0 = time.perf_counter()
        if target is not None:
            target.states(syn)
            sync()
        t1 = time.perf_counter()
        if timer is not None:
            timer.time.clear()
            timer.phase = "forward"
        with autocast.context():
            res = syn.loss()
        sync()
        t2 = time.perf_counter()
        if timer is not None:
            timer.phase = "backward"
        res.loss.backward()
        sync()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t4 = time.perf_counter()
        if timer is not None:
            times = dict(timer.time)
            times[(REST, "forward")] = (t2 - t1) - sum(v for (_, ph), v in timer.time.items() if ph == "forward")
            times[(REST, "backward")] = (t3 - t2) - sum(v for (_, ph), v in timer.time.items() if ph == "backward")
        times[(COLOCATED, "forward")] = t1 - t0
        times[(OPT, "step")] = t4 - t3
        times[("total", "step")] = t4 - t0
        return times, res.num_positions

    def median_of(rows: list[dict[tuple[str, str], float]]) -> dict[tuple[str, str], float]:
        keys = sorted({k for r in rows for k in r})
        return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    plain = [step(None) for _ in range(warmup + args.steps)][warmup:]
    predictions = plain[-1][1]
    total = median_of([t for t, _ in plain])[("total", "step")]
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    flops = step_flops(
        model.cfg,
        model.dims,
        sequences=args.batch,
        tokens=args.seq,
        anchors=args.anchors,
        predictions=predictions,
        target_topk=bool(args.topk),
        recompute_vocab_chunks=not args.no_recompute,
        colocated_target=target.shape if target is not None else None,
    )
    peak, peak_source = device_peak(args, device)
    tflops = flops.model / total / 1e12
    mfu = flops.model / total / peak if peak else None
    print(
        f"step {1e3 * total:.0f} ms for {predictions} predictions ({predictions / total:.0f} predictions/s), "
        f"{args.batch} x {args.seq} tokens, {args.anchors} anchors, {args.device} {args.dtype}, "
        f"{args.threads} threads, target {'top-' + str(args.topk) if args.topk else 'full'}, "
        f"recompute {not args.no_recompute}, fused AdamW {args.fused_adamw}, compile {args.compile}, "
        f"autocast {autocast.label}, optimizer {args.optimizer}, "
        f"colocated target {args.colocated_target}" + (f", peak memory {peak_mem:.1f} GiB" if peak_mem else "")
    )
    print(
        f"model FLOPs {flops.model / 1e9:.1f} G a step"
        + (f" ({flops.executed / 1e9:.1f} G executed with the recomputed chunks), " if flops.recompute else ", ")
        + f"{flops.per_prediction / 1e6:.1f} MFLOP per prediction; {tflops:.3g} TFLOP/s, "
        + (f"MFU {100 * mfu:.1f}% of {peak / 1e12:.0f} TFLOP/s ({peak_source})" if mfu else f"MFU n/a ({peak_source})")
    )
    report = {
        "args": vars(args) | {"json": str(args.json)},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "step_ms": 1e3 * total,
        "predictions": predictions,
        "predictions_per_s": predictions / total,
        "flops": {
            "model": flops.model,
            "executed": flops.executed,
            "per_prediction": flops.per_prediction,
            "parts": {k: list(v) for k, v in flops.parts.items()},
            "recomputed": flops.recomputed,
        },
        "tflops_per_s": tflops,
        "mfu": mfu,
        "peak_flops": peak,
        "peak_memory_gib": peak_mem,
        "parts": {},
    }
    if not args.compile:
        timer = PartTimer(model, sync)
        med = median_of([step(timer)[0] for _ in range(warmup + args.steps)][warmup:])
        hooked = med[("total", "step")]
        print(f"parts (with hooks: step {1e3 * hooked:.0f} ms)")
        print(f"{'part':<72} {'forward ms':>10} {'backward ms':>11} {'share':>6} {'GFLOP':>8} {'TFLOP/s':>8}")
        for part in ORDER if args.colocated_target else ORDER[1:]:
            f = med.get((part, "forward"), 0.0)
            bw = med.get((part, "backward"), 0.0) + med.get((part, "step"), 0.0)
            gflop = sum(flops.executed_by_part(k) for k in FLOP_PARTS.get(part, [])) / 1e9
            rate = gflop / (f + bw) / 1e3 if gflop and f + bw > 0 else None
            report["parts"][part] = {
                "forward_ms": 1e3 * f,
                "backward_ms": 1e3 * bw,
                "share": (f + bw) / hooked,
                "gflop_executed": gflop,
                "tflops_per_s": rate,
            }
            print(
                f"{part:<72} {1e3 * f:>10.1f} {1e3 * bw:>11.1f} {100 * (f + bw) / hooked:>5.1f}% {gflop:>8.3g} "
                + (f"{rate:>8.3g}" if rate else f"{'-':>8}")
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
