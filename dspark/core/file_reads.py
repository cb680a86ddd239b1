"""Checked reads: what is at a path where a file belongs (:func:`not_a_file`), content hashes, and
JSON/JSONL whose errors name the file and line (raised as the caller's own ValueError subclass)."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path
from typing import Any, Iterator, Optional


def not_a_file(path: Path | str) -> Optional[str]:
    """What is at ``path`` where a regular file belongs, said plainly (None: a regular file):
    "no such file", "a directory", "a named pipe (FIFO)", ... so a message says what is wrong."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    for test, what in (
        (stat.S_ISDIR, "a directory, not a file"),
        (stat.S_ISFIFO, "a named pipe (FIFO), not a regular file"),
        (stat.S_ISSOCK, "a socket, not a regular file"),
        (stat.S_ISCHR, "a character device, not a regular file"),
        (stat.S_ISBLK, "a block device, not a regular file"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def file_sha256(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def text_sha256(text: Optional[str]) -> str:
    return hashlib.sha256((text or "").encode()).hexdigest()


def read_jsonl(path: Path | str, *, error: type[ValueError] = ValueError) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line; bad JSON raises ``error`` (the
    caller's own ValueError subclass) naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None


def read_json(path: Path | str, *, expected: str, error: type[ValueError] = ValueError) -> Any:
    """The parsed content of a JSON file; a file that is not valid JSON (or not UTF-8) raises
    ``error`` (the caller's own ValueError subclass) naming it and ``expected``."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e}), {expected}") from None
