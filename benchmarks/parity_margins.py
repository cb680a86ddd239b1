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

With ``--llama-cpp-target GGUF`` (issue #49) both targets are teacher-forced through the reference
loop's text, prompt and answer: PyTorch in one forward, llama.cpp one token a call through
``llama-server`` (f32 caches for an f32 GGUF: ``dspark.serving.llama_cpp.server.server_spec``), reading
llama.cpp's own log-probabilities of its top ``--n-probs`` tokens at every answer position. Per
prompt it prints max and p99 |delta log-prob| over those tokens (a log-prob is a logit less one
log-sum-exp per position, so the margin between two tokens is a logit margin on each side), the
positions whose argmax differs, and, at each first difference, the margin on each side.

Results in docs/benchmarks.md ("Parity"); the runs (issue #36's third session, issue #49's f32
caches) in docs/history.md.
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
    ap.add_argument(
        "--llama-cpp-target",
        help="the target GGUF to teacher-force through llama.cpp: a file, or f32/f16/bf16/q8_0 (converted once "
        "from the eval's target directory into the cache, as eval.llama_cpp_target does)",
    )
    ap.add_argument("--n-probs", type=int, default=8, help="llama.cpp's top tokens compared per position")
    args = ap.parse_args(argv)
    results = json.loads((args.eval_dir / "results.json").read_text())
    prompts = {}
    for line in (args.eval_dir / "eval_set.jsonl").read_text().splitlines():
        j = json.loads(line)
        prompts[j["prompt_id"]] = j["prompt_token_ids"]
    diffs = first_differences(results)
    if args.llama_cpp_target is not None:
        return teacher_forced(results, prompts, diffs, args.llama_cpp_target, args.n_probs, args.eval_dir)
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


def teacher_forced(
    results: dict, prompts: dict, diffs: list, gguf: Path, n_probs: int, out_dir: Path
) -> int:  # pragma: no cover - needs llama.cpp's build (run by hand; figures in docs/benchmarks.md)
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from dspark.config import GGUF_TYPES
    from dspark.serving.llama_cpp.build import ensure_built
    from dspark.serving.llama_cpp.server import llama_server, next_token_logprobs, server_spec
    from dspark.serving.methods import LLAMA_CPP_BY_NAME
    from dspark.serving.server_lifecycle import choose_port

    if str(gguf) in GGUF_TYPES:
        from dspark.export.gguf import target_gguf
        from dspark.target import cache_root

        gguf = target_gguf(ensure_built(), Path(results["conditions"]["target_path"]), str(gguf), cache=cache_root())
    gguf = Path(gguf)
    ref = next(d for d in results["drafters"] if d["runner"] == "reference")
    texts = {p["prompt_id"]: (prompts[p["prompt_id"]], p["output_ids"]) for p in ref["per_prompt"]}
    ctx = max(len(a) + len(b) for a, b in texts.values()) + 8
    model = AutoModelForCausalLM.from_pretrained(results["conditions"]["target_path"], dtype=torch.float32).eval()
    spec = server_spec(gguf, LLAMA_CPP_BY_NAME["none"], 1, ctx)
    print(f"llama.cpp target {gguf}, caches {spec.kv_cache_type or 'f16 (default)'}; top {n_probs} per position")
    # a position is listed where the two argmaxes differ, or where a llama.cpp row of the eval parted from
    # the reference text; the margin is (reference token - other token) on each side, so opposite signs
    # are an argmax flip between the engines and equal signs are a token both engines chose
    print("| prompt | positions | max abs d log-prob | p99 | flipped or parted at | margins (torch / llama.cpp) |")
    print("|---|---|---|---|---|---|")
    first = {(pid, k): (ours, theirs) for _, pid, k, ours, theirs in diffs}
    every: list[float] = []
    host = "127.0.0.1"
    with llama_server(
        ensure_built(),
        spec,
        host=host,
        port=choose_port(host, 0, setting="the port"),
        log_path=out_dir / "llama.cpp" / "teacher_forced.log",
        timeout_s=600,
        what="llama.cpp teacher forcing",
        timeout_key="--llama-cpp-target",
    ) as server:
        for pid, (prompt, answer) in texts.items():
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([prompt + answer])).logits[0].double(), -1)
            deltas, flips, notes = [], [], []
            for k in range(len(answer)):
                theirs = next_token_logprobs(server, prompt + answer[:k], n_probs=n_probs)
                ours = lp[len(prompt) + k - 1]
                deltas += [abs(v - float(ours[t])) for t, v in theirs.items()]
                t_arg, l_arg = int(ours.argmax()), max(theirs, key=theirs.get)
                if t_arg != l_arg or (pid, k) in first:
                    a, b = first.get((pid, k), (t_arg, l_arg))
                    tm = float(ours[a] - ours[b])
                    lm = theirs.get(a, float("nan")) - theirs.get(b, float("nan"))
                    flips.append(str(k))
                    notes.append(f"{k}: {tm:.4f} / {lm:.4f}")
            every += deltas
            d = np.asarray(deltas)
            print(
                f"| {pid} | {len(answer)} | {d.max():.4f} | {np.percentile(d, 99):.4f} | "
                f"{', '.join(flips) or 'none'} | {'; '.join(notes) or '-'} |",
                flush=True,
            )
    d = np.asarray(every)
    print(
        f"all prompts: {d.size} log-probs, max {d.max():.4f}, p99 {np.percentile(d, 99):.4f}, median {np.median(d):.5f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
