"""What a DSpark step costs in llama.cpp per context length, with and without the drafter's window
(issue #47, item 4): llama-server (b11434, the build scripts/setup.sh makes) serves the same
prompts with no speculation, with each drafter export as ``draft-dspark`` (Markov head on) and with
n-gram chained before it; per context bin, decode tokens/s, the speedup over no speculation (95 %
interval over the bin's prompts, paired), the draft pass per step and tokens per target step.

    python benchmarks/llama_cpp_window_cost.py --eval-set SET.jsonl --target-dir TARGET_DIR \\
        --drafter full=EXPORT_A --drafter win512=EXPORT_B [--bins 1024 7936] [--per-bin 6] [--threads 2] \\
        [--methods dspark ngram-then-dspark]

The target is the embedded SmolLM2's own Q4_1 GGUF (what a user runs), the drafters f32 GGUFs
converted by llama.cpp's own converter, the KV cache llama-server's default (f16). Run it alone:
the figures are wall clock.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eval-set", type=Path, required=True)
    ap.add_argument("--target-dir", type=Path, required=True, help="the target's HF directory (the converter's)")
    ap.add_argument("--drafter", action="append", required=True, help="NAME=EXPORT_DIR")
    ap.add_argument("--bins", type=int, nargs="+", help="the eval set's bins to serve (default: all)")
    ap.add_argument("--per-bin", type=int, default=0, help="the first N prompts of each bin (0: all)")
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--methods",
        nargs="+",
        default=["dspark", "ngram-then-dspark"],
        choices=["dspark", "ngram-then-dspark"],
        help="the rows served per drafter (none is always served: the speedup's base)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "llama_cpp_window_cost")
    args = ap.parse_args(argv)

    from dspark.export.gguf import convert_export
    from dspark.serving.llama_cpp.build import find
    from dspark.serving.methods import LLAMA_CPP_BY_NAME
    from dspark.target import embedded_gguf_path
    from eval.acceptance import AcceptanceCounts
    from eval.checks import interval_text
    from eval.eval_set import load_eval_set
    from eval.intervals import speedup_interval
    from eval.llama_cpp_rows import LlamaCppServing, serve_prompts
    from eval.report import fmt

    tree = find()
    if tree is None:
        raise SystemExit(
            "error: llama.cpp is not built (bash scripts/setup.sh, or python -m dspark.serving.llama_cpp build)"
        )
    prompts = load_eval_set(args.eval_set, key=None)
    bins = args.bins or sorted({p.bin for p in prompts})
    chosen = []
    for b in bins:
        in_bin = [p for p in prompts if p.bin == b]
        chosen += in_bin[: args.per_bin] if args.per_bin else in_bin
    ctx = max(p.num_tokens for p in chosen) + args.max_new_tokens + args.gamma + 8
    s = LlamaCppServing(tree, embedded_gguf_path(), ctx, args.gamma, args.max_new_tokens, 0.0, 0, args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {
        "none": serve_prompts(s, LLAMA_CPP_BY_NAME["none"], None, chosen, args.out / "none.log")
    }
    for spec in args.drafter:
        name, _, export_dir = spec.partition("=")
        draft = convert_export(tree, Path(export_dir), args.target_dir, "f32")
        for method in args.methods:
            rows[f"{method}:{name}"] = serve_prompts(
                s, LLAMA_CPP_BY_NAME[method], draft, chosen, args.out / f"{method}-{name}.log"
            )
    (args.out / "records.json").write_text(json.dumps({"bins": bins, "rows": rows}, indent=1) + "\n")

    def per_bin(records: list[dict], b: int) -> list[dict]:
        return [r for r in records if r["bin"] == b]

    print("| row | " + " | ".join(f"@{b}: tok/s, x none, draft ms/step, tokens/step" for b in bins) + " |")
    print("|---|" + "---|" * len(bins))
    for name, records in rows.items():
        cells = []
        for b in bins:
            recs, base = per_bin(records, b), per_bin(rows["none"], b)
            tps = sum(r["decode_tokens"] for r in recs) / max(1e-9, sum(r["decode_ms"] for r in recs) / 1000)
            base_tps = sum(r["decode_tokens"] for r in base) / max(1e-9, sum(r["decode_ms"] for r in base) / 1000)
            counts = AcceptanceCounts(args.gamma)
            for r in recs:
                counts.merge(AcceptanceCounts.from_dict(r))
            steps = max(1, counts.num_steps)
            draft_ms = sum(r["draft_ms"] for r in recs) / steps
            cells.append(
                f"{tps:.1f}, {tps / base_tps:.2f}x{interval_text(speedup_interval(recs, base), 2)}, "
                f"{draft_ms:.1f}, {fmt(counts.tokens_per_step)}"
            )
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
