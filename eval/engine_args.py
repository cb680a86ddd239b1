"""A vLLM engine's arguments for stage 3, from the run's config: the target's parallel layout with
``eval.vllm_engine_kwargs`` on top, and the window (``max_model_len``). The eval's rows, the
serving benchmark and the headless workers of a multi-node engine (``eval.run_headless``) build
theirs here, so a node started apart computes the same engine."""

from __future__ import annotations

from typing import Any, Optional

from dspark.config import RunConfig
from eval.eval_set import EvalPrompt


def engine_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """The target's parallel layout plus eval.vllm_engine_kwargs (multi-node: nnodes, master_addr...)."""
    kw: dict[str, Any] = {}
    if cfg.target.tensor_parallel_size > 1:
        kw["tensor_parallel_size"] = cfg.target.tensor_parallel_size
    if cfg.target.pipeline_parallel_size > 1:
        kw["pipeline_parallel_size"] = cfg.target.pipeline_parallel_size
    if cfg.target.trust_remote_code:
        kw["trust_remote_code"] = True
    return {**kw, **cfg.eval.vllm_engine_kwargs}


def engine_window(longest_prompt: int, answer: int, gamma: int) -> int:
    """An engine's window: the longest prompt, the answer, and one draft block on top (a last
    step verifies up to gamma + 1 tokens)."""
    return longest_prompt + answer + gamma + 1


def vllm_max_model_len(cfg: RunConfig, prompts: Optional[list[EvalPrompt]] = None) -> int:
    """The eval engines' window: eval.vllm_max_model_len, or the longest prompt (or bin) + answer
    + one draft block. Headless workers of a multi-node engine compute it from the config alone,
    so it must not depend on the prompts unless a prepared set is given."""
    e = cfg.eval
    if e.vllm_max_model_len:
        return e.vllm_max_model_len
    longest = max(p.num_tokens for p in prompts) if (e.prompts_file and prompts) else max(e.context_bins)
    return engine_window(longest, e.max_new_tokens, e.gamma)
