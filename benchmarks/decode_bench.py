"""Decode-step costs of the reference loop (eval/reference.py) on the embedded target, fp32:

1. the target forward over k new tokens (k = 1 is a plain decode step, k = 1 + gamma a verify
   step) with a KV cache of each context length, plus the states the drafter needs;
2. one drafter proposal (block forward, the Markov head's left-to-right pass, confidence);
3. the drafter's context update for the accepted tokens.

The i.i.d. cost model predicts speedup = tau / (1 + r) with r = draft / verify, which assumes a
verify step costs what a plain step costs. This measures how far that holds on this machine:
the speedup it predicts with the measured costs is tau / ((draft + verify(1+gamma) + extend) /
plain), printed for a few tau.

    .venv/bin/python benchmarks/decode_bench.py [--contexts 1024 4096 7168] [--repeats 5]
        [--out outputs/benchmarks/decode.json]

Weights are random (costs do not depend on them); the drafter is the default DSpark preset.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 7168])
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", type=Path, default=Path("outputs/benchmarks/decode.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from hydra import compose, initialize_config_dir
    from transformers import AutoModelForCausalLM

    from dspark.config import load_config
    from dspark.recipe import build_drafter
    from dspark.target import prepare_target
    from eval.reference import DraftRunner, TargetRunner

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=["+experiment=smollm2_cpu_demo"]))
    heads, target_dir = prepare_target(cfg)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    drafter, _, _ = build_drafter(cfg, heads)
    drafter.eval()
    ctx_ids = cfg.context_layer_ids()
    g = args.gamma
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in args.contexts:
        prompt = torch.randint(1000, 20000, (n,), generator=gen).tolist()
        plain, spec = TargetRunner(model, []), TargetRunner(model, ctx_ids)
        plain.reset()
        plain.forward(prompt)
        spec.reset()
        _, states = spec.forward(prompt)

        def step(runner: TargetRunner, k: int) -> None:
            runner.forward([7] * k)
            runner.drop_last(k)  # the cache stays at n tokens

        dr = DraftRunner(drafter)
        dr.reset()
        with torch.no_grad():
            dr.extend(states)
        base_len = dr.length

        def propose() -> None:
            dr.propose(11, g, 0.0, gen)

        def extend() -> None:
            with torch.no_grad():
                dr.extend(states[-3:])  # about tau accepted tokens
            dr.kv = [(k[:, :, :base_len], v[:, :, :base_len]) for k, v in dr.kv]
            dr.length = base_len

        row = {
            "context": n,
            "plain_ms": _median_ms(lambda: step(plain, 1), args.repeats),
            "verify_ms": _median_ms(lambda: step(spec, 1 + g), args.repeats),
            "verify_1_with_states_ms": _median_ms(lambda: step(spec, 1), args.repeats),
            "draft_ms": _median_ms(propose, args.repeats),
            "extend_ms": _median_ms(extend, args.repeats),
        }
        row["verify_over_plain"] = row["verify_ms"] / row["plain_ms"]
        row["r"] = row["draft_ms"] / row["verify_ms"]
        step_ms = row["draft_ms"] + row["verify_ms"] + row["extend_ms"]
        row["predicted_speedup"] = {
            str(tau): (tau / (1 + row["r"]), tau * row["plain_ms"] / step_ms) for tau in (1.5, 2.0, 3.0, 4.0)
        }
        rows.append(row)
        print(
            f"context {n:5d}: plain {row['plain_ms']:.1f} ms | verify {1 + g} tokens {row['verify_ms']:.1f} ms "
            f"({row['verify_over_plain']:.2f}x plain) | draft {row['draft_ms']:.1f} ms (r {row['r']:.2f}) | "
            f"extend {row['extend_ms']:.1f} ms"
        )
        for tau, (iid, real) in row["predicted_speedup"].items():
            print(f"    tau {tau}: tau/(1+r) = {iid:.2f}x, with measured step costs = {real:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "gamma": g, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
