"""Whether the rows agree: each row's greedy outputs against a reference's token for token, and
llama.cpp's rows against their reference-loop twins prompt by prompt (tokens, accepted drafts)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dspark.config import ConfigError, RunConfig
from dspark.core.file_reads import read_json
from eval.results import DrafterResult, outputs_equal

log = logging.getLogger(__name__)


def greedy_outputs_equal(cfg: RunConfig, drafters: list[DrafterResult]) -> dict[str, dict[str, Any]]:
    """Per row, how many prompts' greedy outputs equal the reference's token for token: the
    outputs of ``eval.reference_outputs`` (another run, e.g. vLLM on CPU), else this run's first
    vLLM row. Every method here is lossless, so under greedy decoding each should reproduce the
    target's own text; a prompt that differs shows where two numerics part (fp32 on CPU and GPU,
    a verify of 8 tokens against one). Empty when sampling or when there is no reference."""
    if cfg.eval.temperature > 0:
        return {}
    if cfg.eval.reference_outputs:
        path = Path(cfg.eval.reference_outputs).expanduser()
        expected = "expected the JSON that python -m eval.serve --out writes, with 'outputs' (prompt id -> token ids)"
        if not path.is_file():
            raise ConfigError(f"eval.reference_outputs={path}: no such file; {expected}")
        data = read_json(path, expected=expected, error=ConfigError)
        outputs = data.get("outputs") if isinstance(data, dict) else None
        if not isinstance(outputs, dict):
            raise ConfigError(f"eval.reference_outputs={path}: {expected}")
        reference = {str(k): v for k, v in outputs.items()}
        source = str(path)
    else:
        first = next((d for d in drafters if d.runner == "vllm" and d.per_prompt), None)
        if first is None:
            return {}
        reference = {str(p["prompt_id"]): p["output_ids"] for p in first.per_prompt if p.get("output_ids") is not None}
        source = f"vLLM {first.name} in this run"
    out = {}
    for d in drafters:
        equal, total = outputs_equal(d.per_prompt, reference)
        if total:
            out[d.name] = {"equal": equal, "prompts": total, "reference": source}
            log.info("eval: %s: %d of %d prompts' greedy outputs equal %s's", d.name, equal, total, source)
    return out


LLAMA_CPP_TWINS = (
    ("llama.cpp-dspark", "dspark"),
    ("llama.cpp-ngram-then-dspark", "ngram-then-dspark"),
    ("llama.cpp-markov-off", "markov-off"),
)
"""llama.cpp rows and their twins in the reference loop (the exact acceptance instrument)."""


def llama_cpp_parity(drafters: list[DrafterResult]) -> dict[str, dict[str, Any]]:
    """Per llama.cpp row with a reference-loop twin, per prompt: are the generated tokens equal
    (and where they first differ), and the accepted tokens, drafts and steps of each side. Under
    greedy decoding both are lossless, so the tokens should be equal where the targets' numerics
    are; the accepted tokens then say whether the two drafters are the same drafter."""
    by = {d.name: d for d in drafters}
    out = {}
    for name, twin in LLAMA_CPP_TWINS:
        if name not in by or twin not in by:
            continue
        ref = {str(p["prompt_id"]): p for p in by[twin].per_prompt}
        rows = []
        for p in by[name].per_prompt:
            r = ref.get(str(p["prompt_id"]))
            if r is None or r.get("output_ids") is None:
                continue
            a, b = p["output_ids"], r["output_ids"]
            diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if diff is None and len(a) != len(b):
                diff = min(len(a), len(b))
            rows.append(
                {
                    "prompt_id": p["prompt_id"],
                    "bin": p["bin"],
                    "tokens_equal": diff is None,
                    "first_difference": diff,
                    "accepted": [p["num_accepted"], r["num_accepted"]],
                    "drafts": [p["num_drafts"], r["num_drafts"]],
                    "steps": [p["num_steps"], r["num_steps"]],
                }
            )
        out[name] = {
            "reference": twin,
            "prompts": len(rows),
            "tokens_equal": sum(r["tokens_equal"] for r in rows),
            "accepted_equal": sum(r["accepted"][0] == r["accepted"][1] for r in rows),
            "per_prompt": rows,
        }
        log.info(
            "eval: %s against the reference loop's %s: tokens equal on %d of %d prompts, accepted tokens on %d",
            name,
            twin,
            out[name]["tokens_equal"],
            len(rows),
            out[name]["accepted_equal"],
        )
    return out
