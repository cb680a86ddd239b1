"""Prompt sources: chat files, plain text, HF datasets and a bundled offline default.

Every source yields :class:`Conversation` objects (OpenAI-style messages). ShareGPT
``conversations`` ({"from": "human"|"gpt"|"system", "value": ...}) and OpenAI ``messages``
({"role", "content"}) are both accepted. Then :func:`dedupe_and_split` removes duplicates and
assigns each conversation to train or val by a hash of its content, so the split does not
depend on file order or on how many prompts were asked for.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import random
import re
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from dspark.core.errors import UserError
from dspark.core.file_reads import not_a_file, read_jsonl
from dspark.core.prompt_format import format_lcr_prompt

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
ROLES = ("system", "user", "assistant")


class PromptFileError(UserError):
    """A prompt file is malformed; the message names file, line/row and field."""


@dataclass(frozen=True)
class Conversation:
    messages: tuple[tuple[str, str], ...]  # (role, content)

    @property
    def seq_id(self) -> str:
        return hashlib.sha256(json.dumps(self.messages).encode()).hexdigest()[:16]

    def prompt_and_answer(self, *, regenerate: bool) -> tuple[list[dict[str, str]], Optional[str]]:
        """Split into the prompt messages and the answer to train on.

        regenerate=True: the prompt ends at the last user turn; the target writes the answer.
        regenerate=False: the last assistant turn is the answer, everything before is prompt.
        """
        msgs = [{"role": r, "content": c} for r, c in self.messages]
        if regenerate:
            while msgs and msgs[-1]["role"] == "assistant":
                msgs.pop()
            return msgs, None
        if not msgs or msgs[-1]["role"] != "assistant":
            raise ValueError("regenerate=false needs conversations that end with an assistant turn")
        return msgs[:-1], msgs[-1]["content"]


def _conversation(record: Any, where: str) -> Conversation:
    if not isinstance(record, dict):
        raise PromptFileError(
            f"{where}: expected a JSON object with 'messages' or 'conversations', got {type(record).__name__}"
        )
    if "messages" in record:
        turns, role_key, content_key, roles = record["messages"], "role", "content", {r: r for r in ROLES}
    elif "conversations" in record:
        turns, role_key, content_key, roles = record["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise PromptFileError(
            f"{where}: expected a field 'messages' (OpenAI) or 'conversations' (ShareGPT); found {sorted(record)}"
        )
    if not isinstance(turns, (list, tuple)) or not turns:
        raise PromptFileError(
            f"{where}: field {'messages' if role_key == 'role' else 'conversations'!r} must be a non-empty list"
        )
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise PromptFileError(f"{where}: turn {i} must be an object with {role_key!r} and {content_key!r}")
        role = roles.get(str(turn[role_key]).lower())
        if role is None:
            raise PromptFileError(
                f"{where}: turn {i} field {role_key!r} is {turn[role_key]!r}; expected one of {sorted(roles)}"
            )
        if not isinstance(turn[content_key], str):
            raise PromptFileError(f"{where}: turn {i} field {content_key!r} must be a string")
        out.append((role, turn[content_key]))
    if not any(r == "user" for r, _ in out):
        raise PromptFileError(f"{where}: no user turn")
    return Conversation(tuple(out))


def read_conversations(path: Path) -> Iterator[Conversation]:
    """Conversations from a JSONL file, one per line; errors name the file and line."""
    for n, record in read_jsonl(path, error=PromptFileError):
        yield _conversation(record, f"{path}:{n}")


def read_records(records: Iterable[dict[str, Any]], where: str) -> Iterator[Conversation]:
    for n, record in enumerate(records):
        yield _conversation(record, f"{where} row {n}")


LCR_SOURCES: dict[str, dict[str, int]] = {
    "bundled_lcr": {},
    "bundled_lcr_short": dict(min_chars=2000, max_chars=3400, max_docs=3),
    "bundled_lcr_long": dict(min_chars=3600, max_chars=27000, max_docs=6),
}
"""The AA-LCR-style sources by name and their :func:`bundled_lcr_conversations` arguments, at
about 3.4 characters a SmolLM2 token on these texts (a few prompts whose documents are shorter
than their share come out below): ``bundled_lcr`` about 0.6k-2.5k tokens; ``bundled_lcr_short``
about 0.6k-1.1k (many distinct sequences at a CPU's extraction cost); ``bundled_lcr_long`` about
1k-8k, the long end of the eval's context bins."""


SOURCE_FORMATS = (
    "'bundled'",
    *(f"'{name}'" for name in LCR_SOURCES),
    "a .jsonl/.json chat file (one object per line with OpenAI 'messages' or ShareGPT 'conversations')",
    "a .parquet chat file (the same fields as columns)",
    "a .txt file (one prompt per line, blank lines skipped)",
    "a directory written by datasets' save_to_disk",
    "a Hugging Face Hub dataset name (org/name)",
)
ACCEPTED_SOURCES = "one of: " + " | ".join(SOURCE_FORMATS)

FILE_SUFFIXES = frozenset(
    {".jsonl", ".json", ".parquet", ".txt", ".text", ".csv", ".tsv", ".arrow", ".md", ".yaml", ".yml"}
    | {".gz", ".zst", ".bz2", ".xz", ".zip", ".tar"}
)
"""Suffixes that make a name a local file even when it does not exist (Hub names may hold dots:
``teknium/OpenHermes-2.5``)."""

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def looks_local(source: str) -> bool:
    """A path rather than a Hub name: starts with ``/``, ``.`` or ``~``, has a backslash or more
    than one ``/``, ends in a file suffix, or its part before the ``/`` is a local directory
    (``data/prompts`` beside a ``data/``). Such a source is never looked up on the Hub."""
    if not _HUB_NAME.fullmatch(source) or Path(source).suffix.lower() in FILE_SUFFIXES:
        return True
    return "/" in source and Path(source).parent.is_dir()


def read_text_prompts(path: Path) -> Iterator[Conversation]:
    """One single-turn user prompt per line of a UTF-8 text file; blank lines are skipped."""
    with open(path, encoding="utf-8") as f:
        try:
            for line in f:
                if line.strip():
                    yield Conversation((("user", line.strip()),))
        except UnicodeDecodeError as e:
            raise PromptFileError(f"{path}: not UTF-8 text ({e.reason}), expected one prompt per line") from None


def _read_parquet(path: Path) -> Iterator[Conversation]:
    import pyarrow.parquet as pq

    yield from read_records(pq.read_table(path).to_pylist(), str(path))


_FILE_READERS: dict[str, Callable[[Path], Iterator[Conversation]]] = {
    ".jsonl": read_conversations,
    ".json": read_conversations,
    ".parquet": _read_parquet,
    ".txt": read_text_prompts,
}


def _read_saved_dataset(path: Path, split: str) -> Iterator[Conversation]:
    """A directory written by ``datasets``' ``save_to_disk`` (a Dataset, or a DatasetDict's ``split``)."""
    if not (path / "dataset_dict.json").is_file() and not (path / "state.json").is_file():
        raise PromptFileError(
            f"{path}: a directory without state.json or dataset_dict.json, not one written by datasets' "
            f"save_to_disk; data.source expects {ACCEPTED_SOURCES}"
        )
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise PromptFileError(f"{path}: data.hf_split={split!r} is not among the saved splits {sorted(ds)}")
        ds = ds[split]
    return read_records(ds, str(path))


def _read_hub(name: str, split: str) -> Iterator[Conversation]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - datasets and the Hub client raise many types; say which
        raise PromptFileError(
            f"data.source={name!r}: no such local file or directory, and the Hub dataset {name!r} could not be "
            f"loaded ({type(e).__name__}: {e}); expected {ACCEPTED_SOURCES}"
        ) from e
    return read_records(ds, name)


def load_source(source: str, *, split: str = "train") -> Iterator[Conversation]:
    """The conversations of ``data.source`` (:data:`SOURCE_FORMATS`). The source is checked when
    this is called, so a wrong one fails before any work starts; records are read as the result
    is iterated, and a malformed one names its file and line or row."""
    if source == "bundled":
        return bundled_conversations()
    if source in LCR_SOURCES:
        return bundled_lcr_conversations(**LCR_SOURCES[source])
    path = Path(source).expanduser()
    if path.is_file():
        reader = _FILE_READERS.get(path.suffix.lower())
        if reader is None:
            suffix = path.suffix or "(no suffix)"
            raise PromptFileError(f"{path}: unsupported file type {suffix!r}; data.source expects {ACCEPTED_SOURCES}")
        return reader(path)
    if path.is_dir():
        return _read_saved_dataset(path, split)
    if path.exists() or path.is_symlink():  # a FIFO, a socket, a device, a broken link
        raise PromptFileError(f"data.source={source!r}: {not_a_file(path)}; expected {ACCEPTED_SOURCES}")
    if looks_local(source):
        raise PromptFileError(
            f"data.source={source!r}: no such file or directory ({path.absolute()}); expected {ACCEPTED_SOURCES}"
        )
    return _read_hub(source, split)


def dedupe_and_split(
    conversations: Iterable[Conversation], *, val_fraction: float, limit: Optional[int] = None
) -> dict[str, list[Conversation]]:
    """Drop exact duplicates (by content), then split by content hash (deterministic)."""
    seen: set[str] = set()
    out: dict[str, list[Conversation]] = {"train": [], "val": []}
    for conv in conversations:
        key = conv.seq_id
        if key in seen:
            continue
        seen.add(key)
        split = "val" if int(key[:8], 16) / 16**8 < val_fraction else "train"
        out[split].append(conv)
        if limit is not None and len(seen) >= limit:
            break
    return out


# --- bundled offline default ----------------------------------------------------------------

_DOC_TASKS = (
    "Summarize the following documentation in three sentences:\n\n{text}",
    "Explain, for a new Python programmer, what this module is for:\n\n{text}",
    "List the key points of this text as bullet points:\n\n{text}",
    "Write a short tutorial introduction based on this description:\n\n{text}",
)
_CODE_TASKS = (
    "Explain what this Python function does, step by step:\n\n```python\n{text}\n```",
    "Write a docstring for this Python function:\n\n```python\n{text}\n```",
    "Suggest a unit test for this function:\n\n```python\n{text}\n```",
    "Rewrite this function to be clearer, keeping its behaviour:\n\n```python\n{text}\n```",
)
_PACKAGE_TASKS = (
    "What problem does the Python package '{name}' solve? Its description says:\n\n{text}",
    "Write a short README quick-start for '{name}', based on this summary:\n\n{text}",
)


def _clip(text: str, max_chars: int) -> str:
    text = text.strip()
    return text if len(text) <= max_chars else text[:max_chars].rsplit(" ", 1)[0] + " ..."


def _stdlib_snippets(max_files: int = 400) -> Iterator[tuple[str, str, str]]:
    """(kind, name, text) from the stdlib's source: module docstrings and small functions."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))[:max_files]
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        doc = ast.get_docstring(tree)
        if doc and len(doc) > 200:
            yield "doc", path.stem, doc
        source = path.read_text(encoding="utf-8").splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and node.end_lineno:
                body = "\n".join(source[node.lineno - 1 : node.end_lineno])
                if 150 < len(body) < 1500:
                    yield "code", f"{path.stem}.{node.name}", body
                    break


OWN_DISTRIBUTION = "dspark-train"


def _package_descriptions() -> Iterator[tuple[str, str, str]]:
    # the environment's own site-packages, not sys.path: libraries put their vendored packages on
    # sys.path at import time (wandb does), which would change the prompt set mid-process
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    for dist in sorted(metadata.distributions(path=site), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = dist.metadata["Name"]
        if name == OWN_DISTRIBUTION:  # our README changes with every commit; the prompt set must not
            continue
        text = dist.metadata.get("Summary") or ""
        desc = (
            dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else dist.metadata.get("Description")
        )
        if desc and len(str(desc)) > 200:
            text = f"{text}\n\n{desc}"
        if name and len(text) > 120:
            yield "package", name, text


def bundled_conversations(*, seed: int = 0, max_chars: int = 1500) -> Iterator[Conversation]:
    """A few hundred varied single-turn instructions from text every machine has: the Python
    standard library's docstrings and source, and installed packages' descriptions. The set
    changes only when the environment's packages do (the manifest's prompt-set hash then
    refuses to resume into a dataset built from the old set)."""
    rng = random.Random(seed)
    items = [*_stdlib_snippets(), *_package_descriptions()]
    rng.shuffle(items)  # mix kinds, so a prefix of the list is as varied as the whole
    for kind, name, text in items:
        if kind == "package":
            task = rng.choice(_PACKAGE_TASKS).format(name=name, text=_clip(text, max_chars))
        elif kind == "code":
            task = rng.choice(_CODE_TASKS).format(text=_clip(text, max_chars))
        else:
            task = rng.choice(_DOC_TASKS).format(text=_clip(text, max_chars))
        yield Conversation((("user", task),))


# --- bundled long-context default (AA-LCR style) ----------------------------------------------


LCR_TRAIN_QUESTIONS = (
    "What is each document about? Answer with one short paragraph per document.",
    "Which functions or classes are defined in the documents? Give the document number for each.",
    "Explain how the first document and the last document differ in purpose.",
    "Quote the first sentence of each document, then say which document is the longest.",
    "Write a short overview that a new team member could read before using these modules.",
    "Which document would you read to learn about error handling, and what does it say about it?",
    "List the names that appear in more than one document and explain their role in each.",
    "Describe, step by step, what the code in the second document does.",
    "Summarise the documents in a table with the columns: document, subject, key names.",
    "What questions would a reviewer ask about these documents? Give three with short answers.",
)
"""Questions for the training prompts; the eval set asks others (eval.prompt_bins.OFFLINE_QUESTIONS)."""


LCR_EXCLUDED_MODULES = frozenset(
    {
        "asynchat.py",
        "asyncore.py",
        "cgi.py",
        "contextlib.py",
        "imghdr.py",
        "imp.py",
        "mimetypes.py",
        "nturl2path.py",
        "platform.py",
        "pydoc.py",
        "queue.py",
        "socket.py",
        "subprocess.py",
        "threading.py",
        "trace.py",
        "uu.py",
        "zipimport.py",
    }
)
"""Top-level modules that share code or docs with the stdlib sub-packages the eval set reads
(more than 20 common 8-word runs, e.g. imghdr's tests in email.mime.image): never training text."""


def _stdlib_module_sources() -> list[tuple[str, str]]:
    """(name, text) of the top-level stdlib modules: the training side of the offline documents.
    The eval set draws from the language reference and stdlib sub-packages instead."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")):
        if path.name in LCR_EXCLUDED_MODULES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) >= 2000:
            out.append((f"Lib/{path.name}", text))
    return out


def _excerpt(rng: random.Random, text: str, max_chars: int) -> str:
    """A contiguous run of whole lines of at most ``max_chars``, from a random line."""
    if len(text) <= max_chars:
        return text.strip()
    lines = text.splitlines()
    start = rng.randrange(len(lines))
    while start > 0 and sum(len(x) + 1 for x in lines[start:]) < max_chars:
        start -= 1
    out, n = [], 0
    for line in lines[start:]:
        if n + len(line) + 1 > max_chars:
            break
        out.append(line)
        n += len(line) + 1
    return "\n".join(out).strip()


def bundled_lcr_conversations(
    *,
    seed: int = 0,
    count: Optional[int] = None,
    min_chars: int = 2000,
    max_chars: int = 6500,
    max_docs: int = 4,
) -> Iterator[Conversation]:
    """AA-LCR-style training prompts from text every machine has: 2 to ``max_docs`` documents
    (excerpts of top-level stdlib module sources and installed packages' descriptions) of
    ``min_chars`` to ``max_chars`` characters in all (about 600 to 2,500 SmolLM2 tokens), then a
    question about them. On-policy answers to such prompts copy from the documents, which is
    what a drafter for long-context serving has to learn; the short instructions of ``bundled``
    never show it. Seeded: the same environment gives the same prompts. ``count`` None: as many as
    the caller takes (``data.num_prompts``); the first N are the same whatever is taken after."""
    rng = random.Random(f"bundled_lcr:{seed}")
    docs = _stdlib_module_sources() + [(name, text) for _, name, text in _package_descriptions()]
    for _ in itertools.count() if count is None else range(count):
        total = rng.randint(min_chars, max_chars)
        n = rng.randint(2, max_docs)
        picked = rng.sample(docs, n)
        texts = [_excerpt(rng, text, total // n) for _, text in picked]
        yield Conversation((("user", format_lcr_prompt(texts, rng.choice(LCR_TRAIN_QUESTIONS))),))


if __name__ == "__main__":  # quick look: python -m data_tools.prompts
    convs = dedupe_and_split(bundled_conversations(), val_fraction=0.05)
    print({k: len(v) for k, v in convs.items()}, file=sys.stderr)
    print(convs["train"][0].messages[0][1][:500])
