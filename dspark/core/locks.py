"""An output directory held by one live run: an OS file lock taken without waiting (a killed holder
leaves no stale lock), the holder's host and pid written beside it, and a second run refused
naming them (:func:`holding`, :func:`lock_or_name_holder`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any, Callable, Iterator

from dspark.core.atomic_files import atomic_write_json
from dspark.core.errors import UserError


class InUseError(UserError):
    """A directory another live run is writing."""


def lock_or_name_holder(lock_file: Path, owner_file: Path, refusal: Callable[[dict], UserError], **owner: Any) -> Any:
    """An OS file lock on ``lock_file``, taken without waiting (released when the process ends, so a
    killed holder leaves no stale lock), with this process's host, pid and start (and ``owner``)
    written to ``owner_file``; held already: ``refusal(the holder's record)`` is raised ({} when
    the record cannot be read). Returns the lock, for its ``release``."""
    import time

    from filelock import FileLock, Timeout

    lock = FileLock(str(lock_file))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            holder = json.loads(Path(owner_file).read_text())
        except (OSError, ValueError):
            holder = {}
        raise refusal(holder if isinstance(holder, dict) else {}) from None
    atomic_write_json(owner_file, {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), **owner})
    return lock


@contextlib.contextmanager
def holding(path: Path | str, *, key: str, what: str) -> Iterator[None]:
    """Hold the output directory ``path`` (named by the setting ``key``) for this process
    (:func:`lock_or_name_holder`), the lock keyed by the directory's absolute path in this machine's
    temporary directory (``dspark-holds/``) so that nothing is written beside the user's
    directories. A second run on this machine writing the same output is refused naming the
    holder's pid. (Runs on other hosts over a shared filesystem are not seen: the eval's driver is
    one process on node 0.) Creates nothing at ``path``."""
    import tempfile

    path = Path(path).expanduser().absolute()
    holds = Path(tempfile.gettempdir()) / "dspark-holds"
    holds.mkdir(parents=True, exist_ok=True)
    key_hash = hashlib.sha256(str(path).encode()).hexdigest()[:16]

    def refusal(holder: dict) -> UserError:
        return InUseError(
            f"{key}={path}: in use by another {what} (host {holder.get('host', '?')}, pid {holder.get('pid', '?')}); "
            f"two runs writing it at once would replace each other's files. Wait for it, or set {key} to another "
            "directory"
        )

    lock = lock_or_name_holder(holds / f"{key_hash}.lock", holds / f"{key_hash}.owner.json", refusal, path=str(path))
    try:
        yield
    finally:
        lock.release()
