"""An eval stage's output directory: claimed before anything is written (refused when it holds what
no earlier run of that stage wrote) and marked as the stage's own once the inputs are good. The eval
(``eval.run``) and the serving benchmark (``eval.serve_bench``) claim theirs here."""

from __future__ import annotations

from pathlib import Path

from dspark.core.atomic_files import foreign_listing
from dspark.core.errors import UserError


class OutDirInUseError(UserError):
    """An output directory that holds what no earlier run of this stage wrote."""


OUT_DIR_MARKER = ".dspark-output"
"""The file a stage writes first into an output directory it created or found empty: that
directory is then its own (an earlier run's) and may be written into again."""


def claim_out_dir(out_dir: Path, *, key: str, stage: str, earlier: tuple[str, ...]) -> None:
    """Refuse ``out_dir`` unless it is missing, empty, or an earlier output of ``stage`` (its
    marker, or written before markers existed: one of ``earlier`` and nothing it does not write
    is checked by the marker alone). Creates nothing: :func:`make_out_dir` does, after the run's
    inputs are checked, so a refused run leaves no directory behind."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not out_dir.is_dir():
        raise OutDirInUseError(f"{key}={out_dir}: a file, expected a directory for the {stage}'s output or nothing")
    shown = foreign_listing(out_dir, (OUT_DIR_MARKER, *earlier))
    if shown is None:
        return
    raise OutDirInUseError(
        f"{key}={out_dir}: holds {shown}, which no earlier {stage} wrote (no {OUT_DIR_MARKER}); refusing to write "
        f"into it: set {key} to a new or empty directory"
    )


def make_out_dir(out_dir: Path) -> None:
    """Create ``out_dir`` (already claimed) and mark it as this stage's output."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / OUT_DIR_MARKER).touch()
