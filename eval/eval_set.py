"""An eval set as a file: the :class:`EvalPrompt` record, its JSONL writer and checked reader,
and its hash.

``eval.prompts_file`` (or the set stage 3 builds, :mod:`eval.prompts`) holds one
:class:`EvalPrompt` per line, already rendered with the target's chat template.
:func:`load_eval_set` checks every line (fields and their types, token ids inside the target's
vocabulary) and :func:`eval_set_sha256` says whether two sets gave the target the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dspark.core.atomic_files import write_jsonl
from dspark.core.errors import UserError
from dspark.core.file_reads import not_a_file, read_jsonl

log = logging.getLogger(__name__)

PathLike = str | Path


class EvalPromptError(UserError):
    """Bad AA-LCR input, eval-set file or bin spec; the message names file, row and field."""


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
    problem = not_a_file(path)
    if problem:
        raise EvalPromptError(f"{where}: {problem}, expected JSONL with one prompt object per line")
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
