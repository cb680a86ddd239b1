"""The ``export`` group (``conf/export/``): which checkpoint the export stage reads, where it writes
the served formats and in which dtype (:mod:`dspark.export.stage`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dspark.config.checks import _compute_dtype


@dataclass
class ExportConfig:
    """The export stage: a training checkpoint -> every layout vLLM can serve it in, each checked
    with vLLM's own classes, listed in ``<out_dir>/exports.json`` (what eval and the serving
    benchmark read)."""

    checkpoint: Optional[str] = None
    """A training checkpoint (dir with 'latest' or a stepNNNNNNNN tag), or a trained drafter's
    directory (our export, or a speculators DSpark checkpoint: listed as it is, never exported
    again); None = this run's train.checkpoint_dir."""
    out_dir: str = "${paths.output_dir}/exports/${target.name}/${train.run_name}"
    """Where the exports and their record (exports.json) go."""
    dtype: Optional[str] = None
    """The exported weights' dtype; None = the run's train.dtype."""

    def __post_init__(self) -> None:
        if self.dtype is not None:
            _compute_dtype("export.dtype", self.dtype)
