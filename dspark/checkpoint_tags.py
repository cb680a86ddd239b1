"""A training checkpoint directory's layout: its tags, ``latest``, ``run.json`` and lock.

A checkpoint directory (``train.checkpoint_dir``) holds DeepSpeed tags ``stepNNNNNNNN/`` and
DeepSpeed's ``latest`` file naming the newest. Inside a tag, beside DeepSpeed's own files,
``run.json`` (:func:`dspark.checkpoint_run.provenance`) is written *before* ``latest`` moves to it
(:func:`publish_tag`), so a tag without it is a save that did not finish. The directory is held
by one run at a time (:func:`lock_checkpoint_dir`).

The trainer's side (save, resume) is :mod:`dspark.checkpoint`; reading a tag's drafter weights
is :mod:`dspark.checkpoint_weights`; comparing a tag's ``run.json`` with a run is
:mod:`dspark.checkpoint_run`.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from dspark.core.atomic_files import atomic_write_json, atomic_write_text, foreign_listing
from dspark.core.errors import UserError
from dspark.core.locks import lock_or_name_holder

RUN_FILE = "run.json"
LATEST_FILE = "latest"
LOCK_FILE, OWNER_FILE = ".lock", ".owner.json"


class CheckpointError(UserError):
    """A checkpoint (or an export made from one) that cannot be read or served; the message says
    which file, field or tensor, and what was expected."""


class CheckpointInUseError(CheckpointError):
    """Another live run holds the checkpoint directory."""


OURS = (OWNER_FILE, LOCK_FILE, LATEST_FILE)
"""Files every training run writes into its checkpoint directory first (the lock and its owner) or
with its first tag (``latest``): a directory holding one is an earlier run's."""


def claim_checkpoint_dir(checkpoint_dir: Path) -> None:
    """Refuse ``train.checkpoint_dir`` unless it is missing, empty, or an earlier run's (one of
    :data:`OURS`): a run writes its tags, ``latest``, ``validation.jsonl`` and its lock there, and a
    user's files of those names would be replaced."""
    if not checkpoint_dir.exists() and not checkpoint_dir.is_symlink():
        return
    if not checkpoint_dir.is_dir():
        raise CheckpointError(
            f"train.checkpoint_dir={checkpoint_dir}: a file, expected a directory for the run's checkpoints or nothing"
        )
    shown = foreign_listing(checkpoint_dir, OURS)
    if shown is None:
        return
    raise CheckpointError(
        f"train.checkpoint_dir={checkpoint_dir}: holds {shown}, which no training run wrote (no {OWNER_FILE}); "
        "refusing to write checkpoints into it: set train.checkpoint_dir to a new or empty directory"
    )


def lock_checkpoint_dir(checkpoint_dir: Path) -> Any:
    """Hold ``checkpoint_dir`` for this run (an OS file lock, released when the process ends, so
    a killed run leaves no stale lock). A second run pointed at it (a requeued job and a manual
    rerun) is refused with the holder's host and pid instead of writing into the same tags."""
    checkpoint_dir = Path(checkpoint_dir).expanduser()
    claim_checkpoint_dir(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)

    def refusal(owner: dict) -> CheckpointInUseError:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner["since"])) if "since" in owner else "?"
        return CheckpointInUseError(
            f"{checkpoint_dir}: in use by another training run (host {owner.get('host', '?')}, pid "
            f"{owner.get('pid', '?')}, since {since}); two runs writing one checkpoint directory would "
            "interleave their tags. Wait for it or stop it, or give this run its own train.checkpoint_dir"
        )

    return lock_or_name_holder(checkpoint_dir / LOCK_FILE, checkpoint_dir / OWNER_FILE, refusal)


def publish_tag(checkpoint_dir: Path, tag: str, run_config: dict[str, Any]) -> None:
    """Finish a tag DeepSpeed saved with ``save_latest=False``: write its ``run.json``, then move
    ``latest`` to it. A kill in between leaves ``latest`` on the previous, complete tag."""
    checkpoint_dir = Path(checkpoint_dir).expanduser()
    atomic_write_json(checkpoint_dir / tag / RUN_FILE, run_config, indent=2, default=str)
    atomic_write_text(checkpoint_dir / LATEST_FILE, tag)


def tag_bytes(tag: Path) -> int:
    """Bytes the files of a tag directory hold (every rank's), 0 when there is none."""
    return sum(f.stat().st_size for f in Path(tag).rglob("*") if f.is_file())


def remove_unpublished_tag(checkpoint_dir: Path, tag: str) -> int:
    """Remove tag directory ``tag`` unless ``latest`` names it: the files of a save that was killed
    or ran out of space, never resumed (``latest`` did not move), about to be written again. A
    save into it would overwrite DeepSpeed's files one by one and keep any it no longer writes.
    Returns the bytes given back."""
    checkpoint_dir = Path(checkpoint_dir).expanduser()
    latest = latest_tag(checkpoint_dir)
    path = checkpoint_dir / tag
    if not path.is_dir() or (latest is not None and latest.name == tag):
        return 0
    size = tag_bytes(path)
    shutil.rmtree(path)
    return size


def tag_name(step: int) -> str:
    return f"step{step:08d}"


def tag_step(tag: Path) -> int:
    """The step of a ``stepNNNNNNNN`` tag directory, -1 for any other name."""
    name = Path(tag).name
    return int(name.removeprefix("step")) if name.startswith("step") and name[4:].isdigit() else -1


def latest_tag(checkpoint_dir: Path) -> Optional[Path]:
    """The tag DeepSpeed's ``latest`` names, or None when there is none yet."""
    latest = Path(checkpoint_dir).expanduser() / LATEST_FILE
    return latest.parent / latest.read_text().strip() if latest.is_file() else None


def resolve_tag(path: Path) -> Path:
    """A tag directory from either the tag itself or the checkpoint root (its ``latest``)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    tag = latest_tag(path)
    if tag is not None:
        if not tag.is_dir():
            raise CheckpointError(f"{path / LATEST_FILE} names tag {tag.name!r}, but {tag} does not exist")
        return tag
    return path


def model_states_file(tag: Path) -> Path:
    files = sorted(tag.glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise CheckpointError(
            f"{tag}: not a DeepSpeed checkpoint tag (no *mp_rank_00_model_states.pt); "
            "pass the checkpoint directory (with 'latest') or one of its stepNNNNNNNN tags"
        )
    return files[0]


def checkpoint_model_file(path: Path) -> Path:
    """The DeepSpeed model-states file of a checkpoint tag, or of the checkpoint directory's
    ``latest`` tag: what an export reads, so what a report that depends on it should hash."""
    return model_states_file(resolve_tag(path))


def read_run_config(tag: Path) -> Optional[dict[str, Any]]:
    """The resolved Hydra config a tag was trained with (``run.json``), None if it has none; its
    fields that other code reads are type-checked, one :class:`CheckpointError` naming the file,
    the field and what was expected."""
    run_file = Path(tag) / RUN_FILE
    if not run_file.is_file():
        return None
    try:
        record = json.loads(run_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{run_file}: unreadable ({e}); expected the JSON the trainer writes") from e
    config = record.get("config") if isinstance(record, dict) else None
    if not isinstance(config, dict):
        raise CheckpointError(f"{run_file}: field 'config' is {_shown(config)}; expected the run's config, a mapping")
    for group in ("target", "train", "drafter", "data", "deepspeed", "paths"):
        if group in config and not isinstance(config[group], dict):
            raise CheckpointError(
                f"{run_file}: field 'config.{group}' is {_shown(config[group])}; expected a mapping of its keys"
            )
    target = config.get("target") or {}
    ids = target.get("layer_ids")
    if ids is not None and not (
        isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise CheckpointError(f"{run_file}: field 'config.target.layer_ids' is {_shown(ids)}; expected a list of ints")
    for key in ("name", "path", "source"):
        if target.get(key) is not None and not isinstance(target[key], str):
            raise CheckpointError(
                f"{run_file}: field 'config.target.{key}' is {_shown(target[key])}; expected a string"
            )
    return config


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:50] + "..."


def check_resume_tag(tag_dir: Path, named_by: str) -> None:
    """A tag fit to resume, before DeepSpeed reads it: a directory, with DeepSpeed's model states
    and the trainer's ``run.json`` (written last: without it the save did not finish, and its
    drafter could not be checked). One error each, naming the tag and ``named_by``."""
    if not tag_dir.is_dir():
        raise CheckpointError(
            f"{named_by}={tag_dir}: no such checkpoint tag directory; expected a stepNNNNNNNN directory the trainer "
            "wrote (train.resume=auto resumes the one 'latest' names, train.resume=never starts over)"
        )
    if not any(tag_dir.glob("*mp_rank_00_model_states.pt")):
        raise CheckpointError(
            f"{named_by}={tag_dir}: not a DeepSpeed checkpoint tag (no *mp_rank_00_model_states.pt); expected a "
            "stepNNNNNNNN directory the trainer wrote"
        )
    if not (tag_dir / RUN_FILE).is_file():
        raise CheckpointError(
            f"{named_by}={tag_dir}: no {RUN_FILE}, so its save did not finish (the trainer writes it last) and its "
            "drafter cannot be checked against this config; resume a complete tag (train.resume=auto: the one "
            "'latest' names) or start over (train.resume=never)"
        )
