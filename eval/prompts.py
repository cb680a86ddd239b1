"""AA-LCR-style long-context eval prompts, sized to the target's window in context-length bins.

Two sources share one prompt layout (AA-LCR's: the documents, then the question; see README "Glossary"):

* ``aa_lcr``: the real AA-LCR release (its CSV and extracted texts), read by :func:`~eval.prompt_documents.load_aa_lcr`.
* ``offline``: built on any machine from text CPython ships. The prose of the language reference
  (``pydoc_data.topics``) comes first; bins larger than all of it continue with the source of a
  few stdlib sub-packages. The training prompts (``data_tools.prompts.bundled_conversations``)
  come from top-level ``Lib/*.py`` files and installed packages' descriptions, so eval
  documents do not appear in training data (the one topic that repeats a module docstring is
  left out). The same interpreter gives the same set; another Python version gives another,
  which :func:`~eval.eval_set.eval_set_sha256` tells apart.

* ``fixed_passage``: the long-context set that tells length from content (issue #47). Prompt i of
  every bin asks the same question about the same answer-bearing passage (a language-reference
  topic cut to :data:`~eval.prompt_bins.PASSAGE_TOKENS`), among distractor documents taken in one seeded order from
  the rest of the offline pool (each cut to :data:`~eval.prompt_bins.DISTRACTOR_TOKENS`, the last one to fill the
  bin): a larger bin only adds more of the same distractors, so tokens/step over the bins measures
  the context length, not what the documents are. The passage stands first, in the middle or last
  (prompt i % 3), as AA-LCR's documents come in several orders. Prompts pair across bins by their
  index (``fixed-s{seed}-b{bin}-{i}``).

Sizing rule, for the ``offline`` and ``aa_lcr`` sources: a prompt in bin b has at most b tokens with the chat template
applied, and at least max(previous bin + 1, 0.75 b), so bins really differ in length. Its
documents are cut to one token cap c, the largest for which the prompt fits: documents shorter
than c stay whole, longer ones keep their first c tokens (a cut at a token boundary). Every
document of a set thus keeps a share, because the questions need all of them, and the
question is never cut.

This module builds a set (:func:`build_eval_set`, and ``python -m eval.prompts``); beside it,
:mod:`eval.prompt_documents` reads the documents (the AA-LCR release, the offline pool),
:mod:`eval.prompt_bins` fills one bin per source, and :mod:`eval.eval_set` is the set as a file
(:class:`~eval.eval_set.EvalPrompt`, its writer, checked reader and hash).
"""

from __future__ import annotations

import argparse
import logging
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from dspark.core.target_dir import read_text_config
from eval.eval_set import EvalPrompt, EvalPromptError, PathLike, eval_set_sha256, load_eval_set, save_eval_set
from eval.out_dir import make_out_dir
from eval.prompt_bins import DocumentTokens, OfflinePool, aa_lcr_bin, fixed_passage_set, offline_bin
from eval.prompt_documents import LcrQuestion, load_aa_lcr, reference_topics, subpackage_sources

if TYPE_CHECKING:
    from dspark.config import RunConfig

log = logging.getLogger(__name__)

MIN_FILL = 0.75
"""A prompt in bin b has at least this fraction of b tokens."""
SOURCES = ("offline", "aa_lcr", "fixed_passage")


# --- the eval set -------------------------------------------------------------------------------


def check_bins(context_bins: Sequence[int], *, max_new_tokens: int, window: int) -> None:
    """Bins must increase, and each must leave room for the answer in the target's window."""
    bins = list(context_bins)
    if not bins or any(not isinstance(b, int) or b <= 0 for b in bins) or bins != sorted(set(bins)):
        raise EvalPromptError(f"context_bins must be strictly increasing positive token counts, got {bins}")
    for b in bins:
        if b + max_new_tokens > window:
            raise EvalPromptError(
                f"context bin {b} + max_new_tokens {max_new_tokens} = {b + max_new_tokens} "
                f"exceeds the target's window {window}; use bins <= {window - max_new_tokens}"
            )


def build_eval_set(
    tokenizer: Any,
    *,
    context_bins: Sequence[int],
    prompts_per_bin: int,
    max_new_tokens: int,
    window: int,
    source: str = "offline",
    aa_lcr_csv: PathLike | None = None,
    aa_lcr_texts: PathLike | None = None,
    seed: int = 0,
) -> list[EvalPrompt]:
    """Eval prompts for each bin, in bin order (see the module docstring for the sizing rule).

    Offline sets are drawn per (seed, bin, index); AA-LCR questions are taken in one seeded
    order for every bin, so bins share questions where their documents are long enough.
    """
    check_bins(context_bins, max_new_tokens=max_new_tokens, window=window)
    if source not in SOURCES:
        raise EvalPromptError(f"eval source is {source!r}; expected one of {list(SOURCES)}")
    if prompts_per_bin < 1:
        raise EvalPromptError(f"prompts_per_bin must be at least 1, got {prompts_per_bin}")
    tokens = DocumentTokens(tokenizer)
    lowers = [max(previous + 1, math.ceil(MIN_FILL * b)) for previous, b in zip([0, *context_bins], context_bins)]
    if source == "fixed_passage":
        return fixed_passage_set(tokens, list(context_bins), lowers, prompts_per_bin, seed)
    pool: OfflinePool = ([], [])
    questions: list[LcrQuestion] = []
    if source == "offline":
        pool = (reference_topics(), subpackage_sources())
    else:
        if aa_lcr_csv is None or aa_lcr_texts is None:
            raise EvalPromptError("source 'aa_lcr' needs aa_lcr_csv and aa_lcr_texts")
        questions = load_aa_lcr(aa_lcr_csv, aa_lcr_texts)
        random.Random(f"aa_lcr:{seed}").shuffle(questions)
    prompts: list[EvalPrompt] = []
    for b, lower in zip(context_bins, lowers):
        if source == "offline":
            prompts += offline_bin(tokens, pool, b, lower, prompts_per_bin, seed)
        else:
            prompts += aa_lcr_bin(tokens, questions, b, lower, prompts_per_bin)
    return prompts


# --- command line -------------------------------------------------------------------------------


def _window_from_config(model_dir: Path) -> int:
    """``max_position_embeddings`` from config.json (or its text_config, for wrapper models)."""
    window = read_text_config(model_dir).get("max_position_embeddings")
    if not window:
        raise EvalPromptError(f"{model_dir / 'config.json'}: no max_position_embeddings; pass --window")
    return int(window)


def _table(prompts: Sequence[EvalPrompt], bins: Sequence[int]) -> str:
    rows = [f"{'bin':>8} {'prompts':>7} {'min':>8} {'mean':>8} {'max':>8} {'docs':>5}"]
    for b in bins:
        n = [p.num_tokens for p in prompts if p.bin == b]
        docs = [len(p.document_names) for p in prompts if p.bin == b]
        if not n:
            rows.append(f"{b:>8} {0:>7}")
            continue
        rows.append(f"{b:>8} {len(n):>7} {min(n):>8} {sum(n) / len(n):>8.0f} {max(n):>8} {sum(docs) / len(docs):>5.1f}")
    return "\n".join(rows)


# --- the run's set ---------------------------------------------------------------------------------


def run_eval_set(cfg: RunConfig, heads: Any, out_dir: Path) -> tuple[list[EvalPrompt], Path]:
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


def main(argv: Sequence[str] | None = None) -> None:
    from dspark.config import EvalConfig

    defaults = EvalConfig()  # one home for the eval defaults: the config schema
    parser = argparse.ArgumentParser(description="Build AA-LCR-style eval prompts per context bin.")
    parser.add_argument("--tokenizer", type=Path, required=True, help="target model directory")
    parser.add_argument("--bins", type=int, nargs="+", default=defaults.context_bins)
    parser.add_argument("--per-bin", type=int, default=defaults.prompts_per_bin)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--window", type=int, help="the target's max positions; default: config.json's")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--source",
        choices=SOURCES,
        help="offline (default), aa_lcr (implied by --aa-lcr-csv) or fixed_passage (the long-context set)",
    )
    parser.add_argument("--aa-lcr-csv", type=Path)
    parser.add_argument("--aa-lcr-texts", type=Path)
    parser.add_argument("--out", type=Path, help="write the set here as JSONL")
    args = parser.parse_args(argv)
    if (args.aa_lcr_csv is None) != (args.aa_lcr_texts is None):
        parser.error("--aa-lcr-csv and --aa-lcr-texts go together")

    from transformers import AutoTokenizer

    try:
        prompts = build_eval_set(
            AutoTokenizer.from_pretrained(str(args.tokenizer)),
            context_bins=args.bins,
            prompts_per_bin=args.per_bin,
            max_new_tokens=args.max_new_tokens,
            window=args.window or _window_from_config(args.tokenizer),
            source=args.source or ("offline" if args.aa_lcr_csv is None else "aa_lcr"),
            aa_lcr_csv=args.aa_lcr_csv,
            aa_lcr_texts=args.aa_lcr_texts,
            seed=args.seed,
        )
    except EvalPromptError as e:
        parser.exit(2, f"error: {e}\n")
    print(_table(prompts, args.bins))
    print(f"sha256 {eval_set_sha256(prompts)}")
    if args.out:
        save_eval_set(prompts, args.out)
        print(f"wrote {len(prompts)} prompts to {args.out}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
