"""Where llama.cpp's greedy text parts from the reference loop's, how close was the target's call?

An eval with llama.cpp's rows and the reference loop (``eval.reference=true``) records each row's
generated tokens per prompt. Both decode greedily and losslessly, so the texts differ only where
the two targets' numerics pick another argmax. This finds each llama.cpp row's first difference
from the reference loop's text, runs the reference target (fp32, PyTorch, one forward over prompt
+ the common prefix) and prints the logit of the token each side chose there: a margin far below
the logits' scale is a near-tie that another summation order can flip, not a drafter's bug (a
drafter cannot change a greedy target's text at all). Rows without a drafter (``llama.cpp-none``,
``llama.cpp-ngram``) that part at the same token settle it.

    .venv/bin/python benchmarks/parity_margins.py \\
        outputs/eval/smollm2-135m/markov256-llama_cpp/f32-g7-pNone-df32

Results in docs/benchmarks.md ("llama.cpp ... third session").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def first_differences(results: dict) -> list[tuple[str, str, int, int, int]]:
    """(row, prompt id, token index, the reference's token, the row's token) for each llama.cpp
    row's first difference from the reference loop's text, first row first per (prompt, index)."""
    rows = {d["name"]: d for d in results["drafters"]}
    ref = next((d for d in results["drafters"] if d["runner"] == "reference"), None)
    if ref is None:
        raise SystemExit("error: the eval has no reference-loop row (run it with eval.reference=true)")
    ref_out = {p["prompt_id"]: p.get("output_ids") for p in ref["per_prompt"]}
    out, seen = [], set()
    for name, d in rows.items():
        if d["runner"] != "llama.cpp":
            continue
        for p in d["per_prompt"]:
            a, b = p.get("output_ids"), ref_out.get(p["prompt_id"])
            if a is None or b is None:
                continue
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if k is not None and (p["prompt_id"], k) not in seen:
                seen.add((p["prompt_id"], k))
                out.append((name, p["prompt_id"], k, b[k], a[k]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("eval_dir", type=Path, help="an eval's out_dir: results.json and eval_set.jsonl")
    args = ap.parse_args(argv)
    results = json.loads((args.eval_dir / "results.json").read_text())
    prompts = {}
    for line in (args.eval_dir / "eval_set.jsonl").read_text().splitlines():
        j = json.loads(line)
        prompts[j["prompt_id"]] = j["prompt_token_ids"]
    diffs = first_differences(results)
    if not diffs:
        print("every llama.cpp row wrote the reference loop's text on every prompt")
        return 0
    import torch
    from transformers import AutoModelForCausalLM

    ref_out = {
        p["prompt_id"]: p["output_ids"]
        for p in next(d for d in results["drafters"] if d["runner"] == "reference")["per_prompt"]
    }
    model = AutoModelForCausalLM.from_pretrained(results["conditions"]["target_path"], dtype=torch.float32).eval()
    print("| prompt | token | first row to part | reference: token, logit | llama.cpp: token, logit | margin |")
    print("|---|---|---|---|---|---|")
    for name, pid, k, ours, theirs in diffs:
        with torch.no_grad():
            logits = model(torch.tensor([prompts[pid] + ref_out[pid][:k]])).logits[0, -1]
        a, b = float(logits[ours]), float(logits[theirs])
        print(f"| {pid} | {k} | {name} | {ours}, {a:.4f} | {theirs}, {b:.4f} | {a - b:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
