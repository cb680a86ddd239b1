"""File helpers every stage uses: atomic writes, content hashes, JSONL, a free local port.

Every file the pipeline hands to a later stage (or to a resumed run) is written through
:func:`atomic_write_text`/:func:`atomic_path`: a unique temporary name in the same directory,
fsynced, then renamed, so a killed job never leaves a half-written file under the real name and
two concurrent writers never share a temporary file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Iterator, Optional


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(3).hex()}")


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (file or directory) to write; on success it replaces
    ``path`` (a directory already at ``path`` is removed first), on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        if path.is_dir() and tmp.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path | str, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_json(path: Path | str, obj: Any, **dumps: Any) -> None:
    atomic_write_text(path, json.dumps(obj, **dumps) + "\n")


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


def write_jsonl(path: Path | str, records: Iterator[Any] | list[Any]) -> None:
    """One JSON value per line, written atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it); for one-process rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
