"""Atomic writes: every file the pipeline hands to a later stage (or to a resumed run) is written
through :func:`atomic_write_text`/:func:`atomic_path`: a unique temporary name in the same
directory, fsynced, then renamed, so a killed job never leaves a half-written file under the real
name and two concurrent writers never share a temporary file. A directory is replaced only when it
is an earlier output of the same kind (:func:`replace_problem`), never a user's; an OS refusal the
user can fix becomes one :class:`NotWritableError` naming the path and the cause."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Collection, Iterator, Optional

from dspark.core.errors import UserError

log = logging.getLogger(__name__)


def _tmp_name(path: Path) -> Path:
    """``.NAME.tmp-HOST-PID-RANDOM``: whose it is, so that a later writer can tell a killed
    writer's leftover (:func:`remove_stale_temporaries`) from a live one's."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale_temporaries(path: Path | str) -> list[Path]:
    """Remove the temporary siblings of ``path`` (:func:`atomic_path`'s ``.NAME.tmp-*``) left by
    writers that were killed: written on this host by a process that is gone. Those of a live
    process, or of another host (a shared filesystem: its process cannot be asked), are kept.
    Each removal is logged as a warning naming it; returns what was removed."""
    path = Path(path)
    prefix, host, removed = f".{path.name}.tmp-", socket.gethostname(), []
    if not path.parent.is_dir():
        return removed
    for tmp in sorted(path.parent.glob(f"{glob.escape(prefix)}*")):
        fields = tmp.name[len(prefix) :].rsplit("-", 2)
        owner = fields[0] if len(fields) == 3 else host  # .NAME.tmp-PID-RANDOM: written before hosts were named
        if owner != host or not fields[-2].isdigit() or _pid_alive(int(fields[-2])):
            continue
        if _remove_quietly(tmp, f"a temporary {path.name} left by process {fields[-2]}, which was killed"):
            log.warning("removed %s: a temporary %s left by process %s, which was killed", tmp, path.name, fields[-2])
            removed.append(tmp)
    return removed


def _remove_quietly(tmp: Path, what: str) -> bool:
    """Remove ``tmp`` (a file, link or directory), if there is one; a cleanup, so it never raises
    over the error that called for it (a read-only filesystem refuses even the ``unlink`` of a file
    that is not there): what cannot be removed is named in a warning. Whether it is gone."""
    if not os.path.lexists(tmp):
        return True
    try:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp)
        else:
            tmp.unlink()
        return True
    except OSError as e:
        log.warning("could not remove %s, %s: %s", tmp, what, e.strerror or e)
        return False


class NotWritableError(UserError):
    """The OS refused a write for a reason the user can fix (:func:`unwritable_cause`); the message
    names the path and the cause. What was being written is removed, not left half."""


def unwritable_cause(err: BaseException, path: Path | str, tmp: Optional[Path] = None) -> Optional[str]:
    """Why the OS refused to write ``path``, in words the user can act on: a directory above it is
    a file, no permission (EACCES, EPERM), a read-only filesystem (EROFS), or a directory that takes
    no new files (ENOENT although it exists: /proc, /sys). None for any other error: a full disk is
    :func:`is_disk_full`'s, the rest are not the user's. ``err`` counts only when it names ``path``,
    a directory above it, or ``tmp`` (the temporary sibling written in its place) or a file in it."""
    if not isinstance(err, OSError) or err.errno is None or err.filename is None:
        return None
    path, where = Path(path), Path(os.fsdecode(err.filename))
    named = where  # what the OS was asked to write
    if tmp is not None and (where == tmp or tmp in where.parents):
        where = path / where.relative_to(tmp)  # the name the user gave, not the temporary one
    elif where != path and where not in path.parents:
        return None
    existing = next((p for p in (where, *where.parents) if os.path.lexists(p)), Path("/"))
    if err.errno in (errno.EEXIST, errno.ENOTDIR):
        blocker = next((p for p in (where, *where.parents) if p.exists() and not p.is_dir()), None)
        return None if blocker is None else f"{blocker} is a file, expected a directory"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to write {'in ' if existing != where else ''}{existing} ({err.strerror})"
    if err.errno == errno.EROFS:
        return f"{existing} is on a read-only filesystem"
    if err.errno == errno.ENOENT and named.parent.is_dir() and not os.path.lexists(named):
        return f"nothing can be created in {named.parent}, although it exists (a filesystem such as /proc or /sys)"
    return None


def not_writable(err: BaseException, path: Path | str, tmp: Optional[Path] = None) -> Optional[NotWritableError]:
    """:class:`NotWritableError` ``cannot write PATH: CAUSE`` when :func:`unwritable_cause` has a cause, else None."""
    cause = unwritable_cause(err, path, tmp)
    return None if cause is None else NotWritableError(f"cannot write {path}: {cause}")


def default_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0666 less this process's umask (a writer that goes
    through a ``tempfile``, such as safetensors', leaves 0600 instead)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


class DirectoryInUseError(UserError):
    """A directory that holds something this project did not write there, where it would be replaced."""


def replace_problem(
    path: Path, owner_marker: Optional[str], owned_files: Optional[Collection[str]] = None
) -> Optional[str]:
    """Why the directory at ``path`` may not be replaced (None: it may): it may when it is missing,
    empty, or an earlier output of the same kind (it holds ``owner_marker``, a file that kind of
    output always has, and, with ``owned_files``, nothing else than those). Anything else is a
    user's, and is never deleted."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_dir():
        return f"{path} is {'a link' if path.is_symlink() else 'a file'}, expected a directory to write or nothing"
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        return None
    if owner_marker is not None and owner_marker in entries:
        foreign = [e for e in entries if owned_files is not None and e not in owned_files]
        if not foreign:
            return None
        return (
            f"{path} is an earlier output ({owner_marker}) but also holds {', '.join(foreign[:5])}, which it did not "
            "write; refusing to replace it: move those files, or pick another directory"
        )
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    what = f"no {owner_marker}, so it is not an earlier output of this kind" if owner_marker else "not empty"
    return f"{path} holds {shown} ({what}); refusing to replace it: pick another directory, or empty it yourself"


def foreign_listing(directory: Path, ours: Collection[str]) -> Optional[str]:
    """What an existing ``directory`` holds, shown as "a, b and N more", when it holds none of the
    entries ``ours`` (what this project's output of that kind always has); None when it is empty or
    holds one of them, so a run may write there."""
    entries = sorted(p.name for p in Path(directory).iterdir())
    if not entries or any(e in entries for e in ours):
        return None
    return ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")


@contextlib.contextmanager
def atomic_path(
    path: Path | str, *, owner_marker: Optional[str] = None, owned_files: Optional[Collection[str]] = None
) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (file or directory) to write; on success it replaces
    ``path``, on error it is removed. A directory already at ``path`` is replaced only if it is
    empty or holds ``owner_marker`` (:func:`replace_problem`), checked before anything is written
    and again before the swap; otherwise :class:`DirectoryInUseError`, and nothing is touched.
    An OS refusal the user can fix (:func:`unwritable_cause`) is raised as :class:`NotWritableError`."""
    path = Path(path)
    if path.is_dir() or path.is_symlink():
        problem = replace_problem(path, owner_marker, owned_files)
        if problem:
            raise DirectoryInUseError(problem)
    tmp = _tmp_name(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        for f in [tmp] if tmp.is_file() else sorted(tmp.iterdir()) if tmp.is_dir() else []:
            _fsync(f)
        if tmp.is_dir() and (path.is_dir() or path.is_symlink()):
            problem = replace_problem(path, owner_marker, owned_files)
            if problem:
                raise DirectoryInUseError(problem)
            old = _tmp_name(path)
            os.replace(path, old)  # the earlier output moves aside, the new one takes its name, then it goes
            try:
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.replace(old, path)  # the earlier output back under its name
                except OSError as e:
                    log.warning("the earlier %s is at %s, it could not be moved back: %s", path.name, old, e)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException as e:
        _remove_quietly(tmp, f"the unfinished {path.name}")
        refused = not_writable(e, path, tmp)
        if refused is not None:
            raise refused from e
        raise


def _fsync(path: Path) -> None:
    if path.is_file():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def atomic_write_text(path: Path | str, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_json(path: Path | str, obj: Any, **dumps: Any) -> None:
    atomic_write_text(path, json.dumps(obj, **dumps) + "\n")


def write_jsonl(path: Path | str, records: Iterator[Any] | list[Any]) -> None:
    """One JSON value per line, written atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
