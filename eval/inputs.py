"""What every vLLM run of stage 3 starts from, built from the run's config: its output directory's
claim, the eval set, and the engine's arguments and window. ``eval.run`` (the eval),
``eval.serve_bench`` (the serving benchmark) and ``eval.run_headless`` (nodes 1..n-1) read them
here, so no stage imports another; the exports they serve come from the export stage's record
(:func:`dspark.export.stage.read_exports`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from dspark.config import RunConfig
from dspark.core.errors import UserError
from dspark.core.files import foreign_listing
from eval.eval_set import EvalPrompt, eval_set_sha256, load_eval_set, save_eval_set
from eval.prompts import build_eval_set

log = logging.getLogger(__name__)


def warn_past_training_window(cfg: RunConfig, attention_window: Optional[int], trained: Optional[int]) -> None:
    """A full-attention drafter evaluated on prompts longer than it was trained on reads context
    farther back than any distance it has seen: say so, with the two ways out (issue #47).
    ``trained``: the train.max_seq_len it was trained on (the export stage's record; None where
    its checkpoint does not say, as for a speculators directory)."""
    longest = max(cfg.eval.context_bins)
    if attention_window is None and isinstance(trained, int) and longest > trained:
        log.warning(
            "eval: the drafter attends over the whole context (drafter.attention_window=null) and was trained on "
            "windows of train.max_seq_len=%d tokens; the eval's prompts reach %d tokens, where it reads context %.0fx "
            "farther back than it was trained on and acceptance may fade. Train with drafter.attention_window "
            "(served as a sliding window by vLLM and llama.cpp) or on windows as long as the served context "
            '(docs/guide.md, "Long context")',
            trained,
            longest,
            longest / trained,
        )


class OutDirInUseError(UserError):
    """An output directory that holds what no earlier run of this stage wrote."""


OUT_DIR_MARKER = ".dspark-output"
"""The file a stage writes first into an output directory it created or found empty: that
directory is then its own (an earlier run's) and may be written into again."""


def claim_out_dir(out_dir: Path, *, key: str, stage: str, earlier: tuple[str, ...]) -> None:
    """Refuse ``out_dir`` unless it is missing, empty, or an earlier output of ``stage`` (its
    marker, or written before markers existed: one of ``earlier`` and nothing it does not write
    is checked by the marker alone). Creates nothing: :func:`make_out_dir` does, after the run's
    inputs are checked, so a refused run leaves no directory behind."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not out_dir.is_dir():
        raise OutDirInUseError(f"{key}={out_dir}: a file, expected a directory for the {stage}'s output or nothing")
    shown = foreign_listing(out_dir, (OUT_DIR_MARKER, *earlier))
    if shown is None:
        return
    raise OutDirInUseError(
        f"{key}={out_dir}: holds {shown}, which no earlier {stage} wrote (no {OUT_DIR_MARKER}); refusing to write "
        f"into it: set {key} to a new or empty directory"
    )


def make_out_dir(out_dir: Path) -> None:
    """Create ``out_dir`` (already claimed) and mark it as this stage's output."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / OUT_DIR_MARKER).touch()


def eval_set(cfg: RunConfig, heads: Any, out_dir: Path) -> tuple[list[EvalPrompt], Path]:
    """The prompts (a prepared set, e.g. your own traffic, or one built per context bin), saved
    as ``out_dir/eval_set.jsonl`` for the vLLM engines (``out_dir`` is created once they are
    known good). A prompts file is only read: when it is that very file (a rerun on an earlier
    eval's set), the set is saved as ``eval_set.used.jsonl`` beside it instead."""
    e = cfg.eval
    if e.prompts_file:  # checked line by line against the target before anything is exported or served
        prompts = load_eval_set(
            Path(e.prompts_file).expanduser(),
            vocab_size=heads.vocab_size,
            window=int(heads.config.get("max_position_embeddings") or 0),
            max_new_tokens=e.max_new_tokens,
        )
    else:
        prompts = build_eval_set(
            heads.tokenizer,
            context_bins=e.context_bins,
            prompts_per_bin=e.prompts_per_bin,
            max_new_tokens=e.max_new_tokens,
            window=int(heads.config.get("max_position_embeddings") or 0),
            source=e.source,
            aa_lcr_csv=e.aa_lcr_csv,
            aa_lcr_texts=e.aa_lcr_texts,
            seed=e.seed,
        )
    prompts_file = out_dir / "eval_set.jsonl"
    given = Path(e.prompts_file).expanduser() if e.prompts_file else None
    if given is not None and prompts_file.exists() and prompts_file.resolve() == given.resolve():
        prompts_file = out_dir / "eval_set.used.jsonl"  # the input stays as the user gave it
    make_out_dir(out_dir)
    save_eval_set(prompts, prompts_file)
    log.info(
        "eval set: %d prompts in bins %s -> %s (sha256 %s)",
        len(prompts),
        sorted({p.bin for p in prompts}),
        prompts_file,
        eval_set_sha256(prompts)[:12],
    )
    return prompts, prompts_file


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
