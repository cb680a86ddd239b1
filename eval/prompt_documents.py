"""The documents eval prompts ask about: the AA-LCR release (:func:`load_aa_lcr`) and the
offline pool, built from text CPython ships (:func:`offline_documents`). :mod:`eval.prompts` says
what each source is; :mod:`eval.prompt_bins` cuts the documents into prompts.
"""

from __future__ import annotations

import csv
import re
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.eval_set import EvalPromptError, PathLike

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


# --- the offline pool -----------------------------------------------------------------------------


def offline_documents() -> list[Document]:
    """The offline pool: language-reference topics, then stdlib sub-package sources, each in
    a fixed order (the same machine gives the same pool)."""
    return reference_topics() + subpackage_sources()


def reference_topics() -> list[Document]:
    from pydoc_data.topics import topics

    return [Document(f"pydoc_data.topics:{k}", topics[k]) for k in sorted(topics) if k not in EXCLUDED_TOPICS]


def subpackage_sources() -> list[Document]:
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
