"""Files derived from a verified source and reused across runs (a shard's Arrow cache, the target's
top-k cache, the draft vocabulary's token counts), each checked before reuse as its source is.

When a derived file is built, its size and SHA-256 are recorded beside it (``NAME.record.json``),
together with the (size, mtime) at which its hash was last confirmed and the identity of what it
was built from (``source``: the source shard's SHA-256 and the builder, say), so that a
self-consistent file and record copied from another source are not taken for this one. Before reuse:

- a record whose source is not this one's: rebuilt (the warning names both);
- no record (a file from before records existed, or a build killed before its record), or a size
  other than the recorded one: rebuilt;
- the same size and mtime as when last confirmed: reused with no read (a stat, the rerun's cost);
- otherwise the file is hashed; a hash other than the recorded one is rebuilt, an equal one is
  reused and its (size, mtime) recorded again.

A rebuild is logged as a warning naming the file and why. Zeros written over part of a cache
keep its size and are finite, so only the hash can tell; whoever restores the mtime after
writing defeats the cheap path, and ``data_tools.verify`` hashes every cache regardless.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Callable, Optional

from dspark.core.atomic_files import atomic_path, atomic_write_json
from dspark.core.errors import UserError
from dspark.core.file_reads import file_sha256, read_json

log = logging.getLogger(__name__)

RECORD_SUFFIX = ".record.json"
TOPK_DIR = ".target_topk"
"""Under a dataset: the target's top-k caches (:mod:`dspark.data.target_topk`)."""
COUNTS_DIR = ".draft_vocab"
"""Under a dataset: the draft vocabulary's token counts (:mod:`dspark.data.draft_vocab`)."""


def record_path(path: Path) -> Path:
    return path.with_name(path.name + RECORD_SUFFIX)


class NotDerivedError(UserError):
    """A file where a derived file would be written that has no record of being built there."""


def _write_record(path: Path, built: Path, sha256: str, source: Optional[str] = None) -> None:
    st = built.stat()
    record = {"bytes": st.st_size, "sha256": sha256, "confirmed": [st.st_size, st.st_mtime_ns]}
    if source is not None:
        record["source"] = source
    atomic_write_json(record_path(path), record, indent=1)


def problem(path: Path, *, full: bool = False, source: Optional[str] = None) -> Optional[str]:
    """Why ``path`` cannot be reused (None: it can): see the module's rules. ``full``: hash it
    even when its (size, mtime) were confirmed (``data_tools.verify``). ``source``: a key of
    the inputs it must have been built from, when its name does not already say so."""
    path = Path(path)
    if not path.is_file():
        return "missing"
    try:
        record = read_json(record_path(path), expected="a derived file's record")
        size, sha = int(record["bytes"]), str(record["sha256"])
        confirmed = list(record.get("confirmed") or [])
    except (OSError, ValueError, KeyError, TypeError):
        return f"no intact record of its build ({record_path(path).name})"
    if source is not None and record.get("source") != source:
        built_from = record.get("source")
        return f"built from {built_from if built_from else 'inputs its record does not name'}, not from {source}"
    st = path.stat()
    if st.st_size != size:
        return f"{st.st_size} bytes, its build recorded {size}"
    if not full and confirmed == [st.st_size, st.st_mtime_ns]:
        return None
    found = file_sha256(path)
    if found != sha:
        return f"sha256 {found[:16]}, its build recorded {sha[:16]} (altered on disk)"
    _write_record(path, path, sha, record.get("source"))
    return None


def reuse_or_build(
    path: Path,
    build: Callable[[Path], None],
    *,
    what: str,
    source: Optional[str] = None,
    only_over_ours: Optional[str] = None,
) -> Path:
    """``path`` reused if intact, else built by ``build(tmp)`` into a temporary sibling, recorded
    and renamed into place (a kill leaves the earlier file or nothing, never half a file under its
    name). A rebuild of a file that existed is a warning naming it and why. ``only_over_ours``
    (for a path beside a user's files, the way out to name): a file there with no record of
    being built there is the user's, refused with :class:`NotDerivedError`, never overwritten."""
    path = Path(path)
    why = problem(path, source=source)
    if why is None:
        return path
    if only_over_ours and (path.exists() or path.is_symlink()) and not record_path(path).is_file():
        raise NotDerivedError(
            f"{path}: a file this project did not write (no {record_path(path).name}), where the {what} goes; "
            f"refusing to overwrite it: {only_over_ours}"
        )
    if path.exists():
        log.warning("%s: %s; rebuilding this %s from its source", path, why, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        build(tmp)
        _write_record(path, tmp, file_sha256(tmp), source)  # the record first: a kill before the rename rebuilds
    return path


def file_records(directory: Path, *, skip: tuple[str, ...] = ()) -> dict[str, list]:
    """Every regular file directly in ``directory`` (but ``skip``) as ``{name: [bytes, sha256,
    mtime_ns]}``: what a derived directory's marker records (the converted target, the llama.cpp
    build's programs) for :func:`files_problem`."""
    out = {}
    for p in sorted(Path(directory).iterdir()):
        if p.is_file() and not p.is_symlink() and p.name not in skip:
            st = p.stat()
            out[p.name] = [st.st_size, file_sha256(p), st.st_mtime_ns]
    return out


def files_problem(directory: Path, recorded: dict[str, list], *, made_by: str) -> Optional[str]:
    """Why the files of ``directory`` are not the ones ``recorded`` (:func:`file_records`; None: they
    are): one missing, of another size, or of another SHA-256. As for a single derived file, a file
    whose mtime is the recorded one is not read (a record without an mtime is hashed each time).
    ``made_by`` names what wrote them in the message ("build", "conversion")."""
    directory = Path(directory)
    for name, rec in sorted(recorded.items()):
        p = directory / name
        if not p.is_file():
            return f"{p}: missing"
        size = p.stat().st_size
        if size != rec[0]:
            return f"{p}: {size} bytes, its {made_by} wrote {rec[0]}"
    for name, rec in sorted(recorded.items()):
        p = directory / name
        confirmed = len(rec) > 2 and p.stat().st_mtime_ns == rec[2]
        if not confirmed and file_sha256(p) != rec[1]:
            return f"{p}: altered since its {made_by} (sha256 differs)"
    return None


def remove(path: Path) -> None:
    """Remove a derived file and its record."""
    for p in (Path(path), record_path(Path(path))):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
