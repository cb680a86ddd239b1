"""``python -m eval.serve``: one vLLM engine serving one speculative method over an eval set, its
spec-decode counters and outputs written as JSON (:mod:`eval.vllm_rows` holds the engine run; the
eval's vLLM rows start this command as their child process, one per method).

    python -m eval.serve --target DIR --method dspark --draft EXPORT_DIR --prompts eval_set.jsonl \
        --gamma 7 --max-model-len 8192 --out vllm_dspark.json

Wrong paths end the command with exit status 2 and one ``error:`` line before vLLM starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from dspark.config import EvalConfig, ExtractEngineConfig, TargetConfig
from dspark.core.atomic_files import atomic_write_json
from dspark.serving.methods import BY_NAME, SPECULATIVE
from eval.acceptance import AcceptanceCounts
from eval.vllm_rows import ServeSpec, serve


def input_problem(target: Path, method: str, draft: Optional[Path], prompts: Optional[Path]) -> Optional[str]:
    """What is wrong with the command's paths, checked before vLLM starts (minutes for a large
    target); None when they are usable. ``prompts`` None: not needed (``--headless``)."""
    from eval.eval_set import EvalPromptError, load_eval_set

    if not (target / "config.json").is_file():
        return f"--target {target}: no config.json there, expected the target's model directory"
    if BY_NAME[method].layout is not None and draft is None:
        return f"--method {method} needs --draft, an export directory (python -m dspark.export export CKPT --out DIR)"
    if draft is not None and not (draft / "config.json").is_file():
        return (
            f"--draft {draft}: no config.json there, expected an export directory; "
            f"python -m dspark.export export CHECKPOINT --out {draft}"
        )
    if prompts is None:
        return None
    if not prompts.is_file():
        return (
            f"--prompts {prompts}: missing file, expected an eval set JSONL; "
            f"python -m eval.prompts --tokenizer {target} --out {prompts}"
        )
    try:
        found = load_eval_set(prompts, key=None)  # named by --prompts below
    except EvalPromptError as e:
        return f"--prompts {e}"
    return None if found else f"--prompts {prompts}: no prompts in it, expected an eval set JSONL"


def main(argv: Optional[list[str]] = None) -> int:
    defaults = EvalConfig()  # the CLI defaults are the eval stage's
    p = argparse.ArgumentParser(prog="python -m eval.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="target model directory")
    p.add_argument("--method", choices=SPECULATIVE, required=True)
    p.add_argument("--draft", type=Path, default=None, help="export directory (dflash/dspark)")
    p.add_argument("--prompts", type=Path, required=True, help="eval set JSONL (eval.eval_set.save_eval_set)")
    p.add_argument("--gamma", type=int, required=True, help="num_speculative_tokens (eval.gamma)")
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--temperature", type=float, default=defaults.temperature)
    p.add_argument(
        "--max-model-len", type=int, required=True, help="the engine window (eval.engine_args.vllm_max_model_len)"
    )
    p.add_argument(
        "--cpu-kvcache-gib",
        type=int,
        default=ExtractEngineConfig().cpu_kvcache_gib,
        help="VLLM_CPU_KVCACHE_SPACE on CPU unless already set (eval.vllm_cpu_kvcache_gib)",
    )
    p.add_argument("--dtype", default=TargetConfig().dtype)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument(
        "--engine-kwargs",
        type=json.loads,
        default={},
        help='JSON for vllm.LLM, e.g. \'{"tensor_parallel_size": 16, "nnodes": 4, "node_rank": 0, '
        '"master_addr": "h0", "master_port": 29501}\'',
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="write the run's counters and outputs here (JSON)")
    where.add_argument(
        "--headless",
        action="store_true",
        help="nodes 1..n-1 of a multi-node engine: host this node's workers until node 0 is done",
    )
    a = p.parse_args(argv)
    problem = input_problem(a.target, a.method, a.draft, None if a.headless else a.prompts)
    if problem:
        p.exit(2, f"error: {problem}\n")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    spec = ServeSpec(
        a.target,
        a.method,
        a.prompts,
        a.gamma,
        a.max_model_len,
        a.cpu_kvcache_gib,
        draft=a.draft,
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        dtype=a.dtype,
        seed=a.seed,
        engine_kwargs=dict(a.engine_kwargs),
    )
    if a.headless:
        from dspark.serving.vllm_engine import run_headless_workers

        run_headless_workers(spec.llm_kwargs())
        return 0
    run = serve(spec)
    atomic_write_json(a.out, asdict(run))
    total = AcceptanceCounts(a.gamma)
    for b in run.per_bin.values():
        total.merge(AcceptanceCounts.from_dict(b))
    print(
        f"{a.method}: {total.tokens_per_step:.3f} tokens per target step over {total.num_steps} steps; tau "
        f"{total.tau:.3f} over {total.num_drafts} drafts ({100 * total.draft_share:.0f}% of steps); per position "
        f"{[round(x, 3) for x in total.accept_per_pos]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
