"""AA-LCR-style long-context eval prompts, sized to the target's window in context-length bins.

Two sources share one prompt layout (AA-LCR's: the documents, then the question; see README "Glossary"):

* ``aa_lcr``: the real AA-LCR release (its CSV and extracted texts), read by :func:`load_aa_lcr`.
* ``offline``: built on any machine from text CPython ships. The prose of the language reference
  (``pydoc_data.topics``) comes first; bins larger than all of it continue with the source of a
  few stdlib sub-packages. The training prompts (``data_tools.prompts.bundled_conversations``)
  come from top-level ``Lib/*.py`` files and installed packages' descriptions, so eval
  documents do not appear in training data (the one topic that repeats a module docstring is
  left out). The same interpreter gives the same set; another Python version gives another,
  which :func:`eval_set_sha256` tells apart.

* ``fixed_passage``: the long-context set that tells length from content (issue #47). Prompt i of
  every bin asks the same question about the same answer-bearing passage (a language-reference
  topic cut to :data:`PASSAGE_TOKENS`), among distractor documents taken in one seeded order from
  the rest of the offline pool (each cut to :data:`DISTRACTOR_TOKENS`, the last one to fill the
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
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import math
import random
import re
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dspark.core.errors import UserError
from dspark.core.files import read_jsonl, write_jsonl
from dspark.core.prompt_format import format_lcr_prompt
from dspark.core.target_dir import read_text_config  # the AA-LCR message, shared with the training prompts

log = logging.getLogger(__name__)

PathLike = str | Path

MIN_FILL = 0.75
"""A prompt in bin b has at least this fraction of b tokens."""
MIN_OFFLINE_DOCUMENTS = 3
"""An offline set draws at least this many documents, so its question reads across documents."""
LCR_COLUMNS = (
    "document_category",
    "document_set_id",
    "question_id",
    "question",
    "answer",
    "data_source_filenames",
)
"""AA-LCR CSV columns the loader needs; the release's data_source_urls and input_tokens
(counted with another tokenizer) are not used."""
SOURCES = ("offline", "aa_lcr", "fixed_passage")

EXCLUDED_TOPICS = ("debugger",)
"""Reference topics that repeat a training prompt: "debugger" is pdb's module docstring."""
OFFLINE_SUBPACKAGES = (
    "asyncio",
    "concurrent",
    "email",
    "html",
    "http",
    "importlib",
    "json",
    "logging",
    "multiprocessing",
    "tomllib",
    "unittest",
    "urllib",
    "wsgiref",
    "xml",
    "xmlrpc",
    "zoneinfo",
)
"""Stdlib sub-packages whose source extends the offline pool past the language reference
(about 110k tokens) for large bins. Top-level ``Lib/*.py`` files are training prompts."""
MIN_SOURCE_CHARS = 1000
"""Smaller files (empty ``__init__.py`` and the like) make poor documents."""

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


class EvalPromptError(UserError):
    """Bad AA-LCR input, eval-set file or bin spec; the message names file, row and field."""


@dataclass(frozen=True)
class Document:
    name: str
    text: str


@dataclass(frozen=True)
class LcrQuestion:
    """One AA-LCR row with its document texts, in the CSV's order."""

    question_id: str
    document_category: str
    document_set_id: str
    question: str
    answer: str
    documents: tuple[Document, ...]


@dataclass(frozen=True)
class EvalPrompt:
    """One eval prompt, already rendered with the target's chat template."""

    prompt_id: str
    bin: int
    prompt_token_ids: list[int]
    num_tokens: int
    source: str
    question: str
    reference_answer: str | None  # AA-LCR only
    document_names: list[str]  # every document of the set, cut or whole

    def __post_init__(self) -> None:
        if self.num_tokens != len(self.prompt_token_ids):
            raise EvalPromptError(
                f"prompt {self.prompt_id!r}: num_tokens is {self.num_tokens} but "
                f"prompt_token_ids has {len(self.prompt_token_ids)}"
            )


# --- the AA-LCR release ------------------------------------------------------------------------


def load_aa_lcr(csv_path: PathLike, texts_dir: PathLike) -> list[LcrQuestion]:
    """Read the AA-LCR CSV and each question's documents.

    ``texts_dir`` is the extracted-text directory: either ``lcr/`` itself or the directory
    holding it. Documents are read once per file, as several questions share a set.
    """
    csv_path, texts_dir = Path(csv_path), Path(texts_dir)
    cache: dict[Path, str] = {}
    questions = []
    with open(csv_path, encoding="utf-8-sig", newline="") as f:  # fields hold newlines
        reader = csv.DictReader(f)
        missing = [c for c in LCR_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise EvalPromptError(
                f"{csv_path}: missing column(s) {missing}; the AA-LCR CSV needs "
                f"{list(LCR_COLUMNS)}, found {reader.fieldnames}"
            )
        line = reader.line_num + 1
        for row in reader:
            questions.append(_lcr_question(row, f"{csv_path}:{line}", texts_dir, cache))
            line = reader.line_num + 1
    return questions


def _lcr_question(row: dict[Any, Any], line: str, texts_dir: Path, cache: dict[Path, str]) -> LcrQuestion:
    if None in row or any(row[c] is None for c in LCR_COLUMNS):
        raise EvalPromptError(f"{line}: the row has a different number of fields than the header")
    qid = row["question_id"].strip()
    where = f"{line} (question_id {qid!r})"
    for column, expected in (
        ("question", "the question text"),
        ("document_category", "the directory under lcr/"),
        ("document_set_id", "the directory under lcr/<document_category>/"),
        ("data_source_filenames", "';'-separated document file names"),
    ):
        if not row[column].strip():
            raise EvalPromptError(f"{where}: field {column!r} is empty; expected {expected}")
    set_dirs = [
        root / row["document_category"].strip() / row["document_set_id"].strip()
        for root in (texts_dir, texts_dir / "lcr")
    ]
    documents = []
    for name in _filenames(row["data_source_filenames"], set_dirs):
        path, tried = _find_document(name, set_dirs)
        if path is None:
            raise EvalPromptError(
                f"{where}: field 'data_source_filenames' names {name!r}, but no such file "
                f"exists; tried {[str(p) for p in tried]}"
            )
        if path not in cache:
            cache[path] = path.read_text(encoding="utf-8")
        documents.append(Document(name, cache[path]))
    return LcrQuestion(
        question_id=qid,
        document_category=row["document_category"].strip(),
        document_set_id=row["document_set_id"].strip(),
        question=row["question"].strip(),
        answer=row["answer"].strip(),
        documents=tuple(documents),
    )


def _filenames(field: str, set_dirs: Sequence[Path]) -> list[str]:
    """File names from ``data_source_filenames``: ';'-separated in the release, newlines
    accepted too. A piece that names no file is split again at ',' (names may hold commas,
    so a comma splits only when the whole piece is not a file)."""
    names = []
    for piece in (p.strip() for p in re.split(r"[;\r\n]", field)):
        if not piece:
            continue
        if "," in piece and _find_document(piece, set_dirs)[0] is None:
            names += [n.strip() for n in piece.split(",") if n.strip()]
        else:
            names.append(piece)
    return names


def _find_document(name: str, set_dirs: Sequence[Path]) -> tuple[Path | None, list[Path]]:
    """The document's path (the release stores ``<name>.txt``; the CSV may omit ``.txt``) and
    the paths tried."""
    candidates = [name] if name.endswith(".txt") else [name, name + ".txt"]
    tried = [d / c for d in set_dirs for c in candidates]
    return next((p for p in tried if p.is_file()), None), tried


# --- the prompt ---------------------------------------------------------------------------------


def chat_token_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as the user turn, rendered with the target's chat template, ready to generate."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding, older versions the list itself
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


class _DocumentTokens:
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


def _fit(tokens: _DocumentTokens, documents: Sequence[Document], question: str, bin_size: int) -> list[int] | None:
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


# --- the offline set ----------------------------------------------------------------------------


_OfflinePool = tuple[list[Document], list[Document]]  # (reference topics, sub-package sources)


def offline_documents() -> list[Document]:
    """The offline pool: language-reference topics, then stdlib sub-package sources, each in
    a fixed order (the same machine gives the same pool)."""
    return _reference_topics() + _subpackage_sources()


def _reference_topics() -> list[Document]:
    from pydoc_data.topics import topics

    return [Document(f"pydoc_data.topics:{k}", topics[k]) for k in sorted(topics) if k not in EXCLUDED_TOPICS]


def _subpackage_sources() -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for package in OFFLINE_SUBPACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = set(path.relative_to(root).parts)
            if parts & {"test", "tests", "__pycache__"}:
                continue
            text = path.read_text(encoding="utf-8")
            if len(text) >= MIN_SOURCE_CHARS:
                docs.append(Document(f"Lib/{path.relative_to(root).as_posix()}", text))
    return docs


def _draw_offline_set(rng: random.Random, tokens: _DocumentTokens, pool: _OfflinePool, bin_size: int) -> list[Document]:
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


def _offline_bin(
    tokens: _DocumentTokens,
    pool: _OfflinePool,
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
        if ids is None or len(ids) < lower:
            raise EvalPromptError(
                f"offline bin {bin_size}: cannot fill a prompt to between {lower} and {bin_size} "
                f"tokens (got {None if ids is None else len(ids)}); the bin is too small for the "
                "question, or larger than the offline documents"
            )
        prompts.append(
            EvalPrompt(
                prompt_id=f"offline-s{seed}-b{bin_size}-{i}",
                bin=bin_size,
                prompt_token_ids=ids,
                num_tokens=len(ids),
                source="offline",
                question=question,
                reference_answer=None,
                document_names=[d.name for d in docs],
            )
        )
    return prompts


def _aa_lcr_bin(
    tokens: _DocumentTokens,
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
    tokens: _DocumentTokens, passage: Document, distractors: Sequence[Document], order: str, question: str, size: int
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


def _fixed_passage_set(
    tokens: _DocumentTokens, bins: Sequence[int], lowers: Sequence[int], per_bin: int, seed: int
) -> list[EvalPrompt]:
    """The ``fixed_passage`` source (module docstring): prompt i is the same passage, question,
    distractor order and passage position in every bin."""
    topics, sources = _reference_topics(), _subpackage_sources()
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
            fit = _passage_prompt(tokens, passage, distractors, order, question, b)
            if fit is None or len(fit[0]) < lower:
                raise EvalPromptError(
                    f"fixed_passage bin {b}: cannot fill a prompt to between {lower} and {b} tokens (got "
                    f"{None if fit is None else len(fit[0])}); the bin is too small for the passage and question"
                )
            ids, names = fit
            prompts.append(
                EvalPrompt(
                    prompt_id=f"fixed-s{seed}-b{b}-{i}",
                    bin=b,
                    prompt_token_ids=ids,
                    num_tokens=len(ids),
                    source="fixed_passage",
                    question=question,
                    reference_answer=None,
                    document_names=names,
                )
            )
    return sorted(prompts, key=lambda p: bins.index(p.bin))


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
    tokens = _DocumentTokens(tokenizer)
    lowers = [max(previous + 1, math.ceil(MIN_FILL * b)) for previous, b in zip([0, *context_bins], context_bins)]
    if source == "fixed_passage":
        return _fixed_passage_set(tokens, list(context_bins), lowers, prompts_per_bin, seed)
    pool: _OfflinePool = ([], [])
    questions: list[LcrQuestion] = []
    if source == "offline":
        pool = (_reference_topics(), _subpackage_sources())
    else:
        if aa_lcr_csv is None or aa_lcr_texts is None:
            raise EvalPromptError("source 'aa_lcr' needs aa_lcr_csv and aa_lcr_texts")
        questions = load_aa_lcr(aa_lcr_csv, aa_lcr_texts)
        random.Random(f"aa_lcr:{seed}").shuffle(questions)
    prompts: list[EvalPrompt] = []
    for b, lower in zip(context_bins, lowers):
        if source == "offline":
            prompts += _offline_bin(tokens, pool, b, lower, prompts_per_bin, seed)
        else:
            prompts += _aa_lcr_bin(tokens, questions, b, lower, prompts_per_bin)
    return prompts


def save_eval_set(prompts: Sequence[EvalPrompt], path: PathLike) -> None:
    """One JSON object per prompt; written to a temporary name and renamed when complete."""
    write_jsonl(path, [asdict(p) for p in prompts])


PROMPT_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "prompt_id": (str,),
    "bin": (int,),
    "prompt_token_ids": (list,),
    "num_tokens": (int,),
    "source": (str,),
    "question": (str,),
    "reference_answer": (str, type(None)),
    "document_names": (list,),
}
"""An eval-set line's fields and their JSON types (:class:`EvalPrompt`)."""


def _checked_prompt(record: Any, where: str, vocab_size: int | None) -> EvalPrompt:
    names = sorted(PROMPT_FIELD_TYPES)
    if not isinstance(record, dict) or sorted(record) != names:
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise EvalPromptError(f"{where}: expected an object with fields {names}, got {found}")
    for key, types in PROMPT_FIELD_TYPES.items():
        value = record[key]
        if not isinstance(value, types) or isinstance(value, bool):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise EvalPromptError(f"{where}: field {key!r} is {value!r:.60}, expected {want}")
    ids = record["prompt_token_ids"]
    if not ids:
        raise EvalPromptError(f"{where}: field 'prompt_token_ids' is empty, expected the prompt's token ids")
    hi = vocab_size if vocab_size else None
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (hi is not None and t >= hi):
            bound = f"[0, {hi})" if hi is not None else ">= 0"
            raise EvalPromptError(
                f"{where}: field 'prompt_token_ids'[{i}] is {t!r:.40}, expected a token id in {bound} (the target's "
                "vocabulary)"
            )
    if not all(isinstance(d, str) for d in record["document_names"]):
        raise EvalPromptError(f"{where}: field 'document_names' expected a list of strings")
    try:
        return EvalPrompt(**record)
    except EvalPromptError as e:
        raise EvalPromptError(f"{where}: {e}") from e


def load_eval_set(
    path: PathLike,
    *,
    vocab_size: int | None = None,
    window: int = 0,
    max_new_tokens: int = 0,
    key: str | None = "eval.prompts_file",
) -> list[EvalPrompt]:
    """A prepared eval set (``eval.prompts_file``, or one this project wrote), every line checked:
    fields and their types, token ids inside the target's vocabulary (``vocab_size``), UTF-8; a
    missing or empty file is an :class:`EvalPromptError` naming it. With ``window``, a prompt
    whose tokens plus ``max_new_tokens`` do not fit is left out, counted in a warning, as a
    generated set leaves such documents out; none left is an error."""
    path = Path(path)
    where = f"{key}={path}" if key else str(path)  # the setting that named the file, if any
    if not path.is_file():
        raise EvalPromptError(f"{where}: no such file, expected JSONL with one prompt object per line")
    prompts = []
    try:
        for n, record in read_jsonl(path, error=EvalPromptError):
            prompts.append(_checked_prompt(record, f"{path}:{n}", vocab_size))
    except UnicodeDecodeError as e:
        raise EvalPromptError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not prompts:
        raise EvalPromptError(f"{where}: no prompts in it, expected one JSON object per line")
    if window:
        fit = [p for p in prompts if p.num_tokens + max_new_tokens <= window]
        if len(fit) < len(prompts):
            longest = max(p.num_tokens for p in prompts)
            log.warning(
                "%s: %d of %d prompts left out: their tokens + eval.max_new_tokens=%d exceed the target's window "
                "of %d (the longest has %d tokens)",
                path,
                len(prompts) - len(fit),
                len(prompts),
                max_new_tokens,
                window,
                longest,
            )
        if not fit:
            raise EvalPromptError(
                f"{where}: every prompt's tokens + eval.max_new_tokens={max_new_tokens} exceed the target's "
                f"window of {window}; nothing to evaluate"
            )
        prompts = fit
    return prompts


def eval_set_sha256(prompts: Sequence[EvalPrompt]) -> str:
    """A hash of the prompts' token ids, in order: equal hashes mean the target saw the same
    prompts, whatever the ids or names say."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(p.prompt_token_ids).encode() + b"\n")
    return h.hexdigest()


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


def main(argv: Sequence[str] | None = None) -> None:
    from dspark.core.config import EvalConfig

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
