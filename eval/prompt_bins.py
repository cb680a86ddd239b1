"""One context bin's eval prompts, per source, each sized to the bin (the sizing rule is
:mod:`eval.prompts`'): the prompt layout rendered with the target's chat template
(:func:`chat_token_ids`), documents cut to the largest token cap that fits, and the bins of the
``offline``, ``aa_lcr`` and ``fixed_passage`` sources.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any

from dspark.core.prompt_format import format_lcr_prompt
from eval.eval_set import EvalPrompt, EvalPromptError
from eval.prompt_documents import Document, LcrQuestion, reference_topics, subpackage_sources

log = logging.getLogger(__name__)

MIN_OFFLINE_DOCUMENTS = 3
"""An offline set draws at least this many documents, so its question reads across documents."""

OFFLINE_QUESTIONS = (
    (
        "For each document, say in one sentence which part of Python it describes. Then name the "
        "two documents whose subjects are most closely related and explain the connection."
    ),
    (
        "Which documents state a grammar rule or a function signature? For each of them, give the "
        "document number and quote the rule or signature."
    ),
    (
        "List every exception mentioned in the documents. For each exception, give the numbers of "
        "the documents that mention it and the situation in which it is raised."
    ),
    (
        "Summarise each document in at most two sentences, in document order. Then say which "
        "document would help most someone writing their first Python class, and why."
    ),
    ("Compare the first and the last document: which concepts do they share, and where do they differ?"),
    (
        "Which built-in names, keywords or modules are discussed in more than one document? For "
        "each of them, list the documents that discuss it."
    ),
)


PASSAGE_TOKENS = 384
"""The answer-bearing passage of a ``fixed_passage`` prompt: the same tokens in every bin."""
DISTRACTOR_TOKENS = 1024
"""A ``fixed_passage`` distractor's cap, so a bin holds several documents and a larger bin more."""
PASSAGE_ORDERS = ("first", "middle", "last")
"""Where the passage stands among the distractors, by prompt index."""
FIXED_PASSAGE_QUESTION = (
    "One of the documents is the Python language reference's entry on '{topic}'. Say which document it "
    "is and quote its first sentence. Then explain in one short paragraph what the entry specifies."
)


# --- the prompt ---------------------------------------------------------------------------------


def chat_token_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as the user turn, rendered with the target's chat template, ready to generate."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding, older versions the list itself
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


class DocumentTokens:
    """Document token ids, memoised by text: a build draws the same documents for many prompts
    and bins, and AA-LCR documents are about 100k tokens each."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._ids: dict[str, list[int]] = {}

    def ids(self, text: str) -> list[int]:
        if text not in self._ids:
            self._ids[text] = self.tokenizer.encode(text, add_special_tokens=False, verbose=False)
        return self._ids[text]

    def head(self, text: str, n: int) -> str:
        """The first ``n`` tokens of ``text``, as text."""
        ids = self.ids(text)
        if n >= len(ids):
            return text
        # a byte-level cut may end inside a character, which decodes to U+FFFD
        return self.tokenizer.decode(ids[:n], clean_up_tokenization_spaces=False).rstrip("\ufffd")


def _equal_cap(lengths: Sequence[int], budget: int) -> int:
    """The largest c with sum(min(n, c) for n in lengths) <= budget (the longest length when
    everything fits)."""
    spent, rest = 0, len(lengths)
    for n in sorted(lengths):
        if spent + n * rest > budget:
            return max(0, (budget - spent) // rest)
        spent += n
        rest -= 1
    return max(lengths, default=0)


def _fit(tokens: DocumentTokens, documents: Sequence[Document], question: str, bin_size: int) -> list[int] | None:
    """Token ids of the prompt whose documents are cut to the largest equal cap that fits
    ``bin_size``, or None if even the question with empty documents does not fit.

    Documents are counted apart from the prompt, so the first guess can be off by a few
    tokens where they join; each retry lowers the budget by the overflow.
    """
    wrapper = tokens.ids(f"BEGIN DOCUMENT {len(documents)}:\n\nEND DOCUMENT {len(documents)}\n\n")
    frame = chat_token_ids(tokens.tokenizer, format_lcr_prompt([], question))
    budget = bin_size - len(frame) - len(wrapper) * len(documents)
    lengths = [len(tokens.ids(d.text)) for d in documents]
    while budget >= 0:
        cap = _equal_cap(lengths, budget)
        texts = [tokens.head(d.text, cap) for d in documents]
        ids = chat_token_ids(tokens.tokenizer, format_lcr_prompt(texts, question))
        if len(ids) <= bin_size:
            return ids
        budget -= len(ids) - bin_size
    return None


# --- a bin per source ----------------------------------------------------------------------------


OfflinePool = tuple[list[Document], list[Document]]  # (reference topics, sub-package sources)


def _draw_offline_set(rng: random.Random, tokens: DocumentTokens, pool: OfflinePool, bin_size: int) -> list[Document]:
    """Documents in a seeded order (all topics before any source file) until they hold more
    than ``bin_size`` tokens and number at least MIN_OFFLINE_DOCUMENTS; :func:`_fit` then cuts
    the longest to fill the bin."""
    topics, sources = pool
    order = rng.sample(topics, len(topics)) + rng.sample(sources, len(sources))
    chosen, total = [], 0
    for doc in order:
        if total > bin_size and len(chosen) >= MIN_OFFLINE_DOCUMENTS:
            break
        chosen.append(doc)
        total += len(tokens.ids(doc.text))
    return chosen


def offline_bin(
    tokens: DocumentTokens,
    pool: OfflinePool,
    bin_size: int,
    lower: int,
    per_bin: int,
    seed: int,
) -> list[EvalPrompt]:
    prompts = []
    for i in range(per_bin):
        rng = random.Random(f"offline:{seed}:{bin_size}:{i}")
        question = rng.choice(OFFLINE_QUESTIONS)
        docs = _draw_offline_set(rng, tokens, pool, bin_size)
        ids = _fit(tokens, docs, question, bin_size)
        prompts.append(
            _filled_prompt(
                None if ids is None else (ids, [d.name for d in docs]),
                f"offline-s{seed}-b{bin_size}-{i}",
                "offline",
                question,
                size=bin_size,
                lower=lower,
                too_small="the bin is too small for the question, or larger than the offline documents",
            )
        )
    return prompts


def _filled_prompt(
    fit: tuple[list[int], list[str]] | None,
    prompt_id: str,
    source: str,
    question: str,
    *,
    size: int,
    lower: int,
    too_small: str,
) -> EvalPrompt:
    """The prompt of ``source``'s bin of ``size`` tokens from ``fit`` (its token ids and document
    names, None where nothing fits), or :class:`EvalPromptError` unless it fills the bin: between
    ``lower`` and ``size`` tokens (``too_small``: why a bin may not fill)."""
    if fit is None or len(fit[0]) < lower:
        raise EvalPromptError(
            f"{source} bin {size}: cannot fill a prompt to between {lower} and {size} tokens "
            f"(got {None if fit is None else len(fit[0])}); {too_small}"
        )
    ids, names = fit
    return EvalPrompt(
        prompt_id=prompt_id,
        bin=size,
        prompt_token_ids=ids,
        num_tokens=len(ids),
        source=source,
        question=question,
        reference_answer=None,
        document_names=names,
    )


def aa_lcr_bin(
    tokens: DocumentTokens,
    questions: Sequence[LcrQuestion],
    bin_size: int,
    lower: int,
    per_bin: int,
) -> list[EvalPrompt]:
    """The first ``per_bin`` questions (in the given order) whose set fills the bin."""
    prompts = []
    for q in questions:
        if len(prompts) == per_bin:
            break
        ids = _fit(tokens, q.documents, q.question, bin_size)
        if ids is None or len(ids) < lower:  # question too long, or documents too short
            continue
        prompts.append(
            EvalPrompt(
                prompt_id=f"aa_lcr-{q.question_id}-b{bin_size}",
                bin=bin_size,
                prompt_token_ids=ids,
                num_tokens=len(ids),
                source="aa_lcr",
                question=q.question,
                reference_answer=q.answer,
                document_names=[d.name for d in q.documents],
            )
        )
    if len(prompts) < per_bin:
        log.warning(
            "AA-LCR bin %d: only %d of %d questions fill it to %d-%d tokens",
            bin_size,
            len(prompts),
            per_bin,
            lower,
            bin_size,
        )
    return prompts


def _passage_prompt(
    tokens: DocumentTokens, passage: Document, distractors: Sequence[Document], order: str, question: str, size: int
) -> tuple[list[int], list[str]] | None:
    """Token ids and document names of a prompt of at most ``size`` tokens: the passage whole, and
    the distractors in their order, each cut to DISTRACTOR_TOKENS, the last one to what is left;
    None if the passage and the question alone do not fit. As :func:`_fit`, each retry lowers the
    budget by the overflow (documents are counted apart from where they join)."""
    wrapper = len(tokens.ids(f"BEGIN DOCUMENT {len(distractors) + 1}:\n\nEND DOCUMENT {len(distractors) + 1}\n\n"))
    frame = len(chat_token_ids(tokens.tokenizer, format_lcr_prompt([passage.text], question)))
    budget = size - frame
    while budget >= 0:
        chosen: list[tuple[str, str]] = []
        left = budget
        for d in distractors:
            take = min(len(tokens.ids(d.text)), DISTRACTOR_TOKENS, left - wrapper)
            if take <= 0:
                break
            chosen.append((d.name, tokens.head(d.text, take)))
            left -= take + wrapper
        at = {"first": 0, "middle": len(chosen) // 2, "last": len(chosen)}[order]
        chosen.insert(at, (passage.name, passage.text))
        ids = chat_token_ids(tokens.tokenizer, format_lcr_prompt([t for _, t in chosen], question))
        if len(ids) <= size:
            return ids, [n for n, _ in chosen]
        budget -= len(ids) - size
    return None


def fixed_passage_set(
    tokens: DocumentTokens, bins: Sequence[int], lowers: Sequence[int], per_bin: int, seed: int
) -> list[EvalPrompt]:
    """The ``fixed_passage`` source (:mod:`eval.prompts`): prompt i is the same passage, question,
    distractor order and passage position in every bin."""
    topics, sources = reference_topics(), subpackage_sources()
    rng = random.Random(f"fixed_passage:{seed}")
    candidates = [t for t in rng.sample(topics, len(topics)) if len(tokens.ids(t.text)) >= PASSAGE_TOKENS]
    if len(candidates) < per_bin:
        raise EvalPromptError(
            f"fixed_passage: {len(candidates)} reference topics hold {PASSAGE_TOKENS} tokens, "
            f"prompts_per_bin={per_bin} needs as many"
        )
    prompts: list[EvalPrompt] = []
    for i, topic in enumerate(candidates[:per_bin]):
        passage = Document(topic.name, tokens.head(topic.text, PASSAGE_TOKENS))
        question = FIXED_PASSAGE_QUESTION.format(topic=topic.name.split(":", 1)[1])
        others = [d for d in topics + sources if d.name != topic.name]
        distractors = random.Random(f"fixed_passage:{seed}:{i}").sample(others, len(others))
        order = PASSAGE_ORDERS[i % len(PASSAGE_ORDERS)]
        for b, lower in zip(bins, lowers):
            prompts.append(
                _filled_prompt(
                    _passage_prompt(tokens, passage, distractors, order, question, b),
                    f"fixed-s{seed}-b{b}-{i}",
                    "fixed_passage",
                    question,
                    size=b,
                    lower=lower,
                    too_small="the bin is too small for the passage and question",
                )
            )
    return sorted(prompts, key=lambda p: bins.index(p.bin))
