"""A full disk said plainly: :func:`reporting_disk_full` turns ENOSPC/EDQUOT (or a library's words
for them) met while writing into one :class:`DiskFullError` naming the directory, the bytes wanted
and the bytes free, instead of ``[Errno 28]`` from deep inside pyarrow, torch or safetensors."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

from dspark.core.errors import UserError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL_BYTES = 1 << 20
"""Free space below which a failed write counts as a full disk when the writer's error carries no
errno at all (torch's zip writer reports only ``unexpected pos ...``); an errno decides by itself."""


class DiskFullError(UserError):
    """A write found no room (or hit a quota): the message names the directory, the bytes wanted
    and the bytes free, and says what to do. What was being written is removed, not left half."""


def free_bytes(path: Path | str) -> int:
    """Bytes free to this user on the filesystem holding ``path`` (or its nearest existing parent)."""
    path = Path(path).expanduser().absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def is_disk_full(err: BaseException, directory: Path | str) -> bool:
    """Whether ``err`` (or an error it came from) means the filesystem of ``directory`` is full:
    ENOSPC/EDQUOT, or the OS's words for them in a library's message. An OS error with any other
    errno is not. Only for a writer whose error carries no errno (torch's zip writer reports
    ``unexpected pos ...``) does a RuntimeError/OSError count while less than
    :data:`NEARLY_FULL_BYTES` is free. Call it before removing what was half written: that is
    what filled the disk."""
    seen: Optional[BaseException] = err
    errnos = []
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            errnos.append(seen.errno)
        if any(os.strerror(code) in str(seen) for code in DISK_FULL_ERRNOS):
            return True
        seen = seen.__cause__ or seen.__context__
    if errnos:
        return any(code in DISK_FULL_ERRNOS for code in errnos)
    return isinstance(err, (OSError, RuntimeError)) and free_bytes(directory) < NEARLY_FULL_BYTES


def disk_full_message(directory: Path | str, what: str, needed: int, todo: str, *, at_least: bool = False) -> str:
    """``<directory>: no space for <what> ([at least ]<needed> bytes needed, <free> bytes free); <todo>``."""
    bound = "at least " if at_least else ""
    free = free_bytes(directory)
    return f"{directory}: no space for {what} ({bound}{needed:,} bytes needed, {free:,} bytes free); {todo}"


@contextlib.contextmanager
def reporting_disk_full(
    directory: Path | str, *, what: str, needed: int, todo: str, at_least: bool = False
) -> Iterator[None]:
    """Raise a full disk met inside as :class:`DiskFullError` (see :func:`disk_full_message`)
    instead of the writer's own ``[Errno 28]`` from deep inside pyarrow, torch or safetensors."""
    try:
        yield
    except UserError:
        raise  # a refusal (DiskFullError among them) already says what is wrong
    except Exception as e:
        if not is_disk_full(e, directory):
            raise
        raise DiskFullError(disk_full_message(directory, what, needed, todo, at_least=at_least)) from e
