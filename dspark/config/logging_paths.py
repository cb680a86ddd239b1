"""The ``logging`` group (W&B, ``conf/logging/``) and the ``paths`` group (every directory the
project writes or reads, ``conf/paths/``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dspark.config.checks import _choice

WANDB_MODES = ("auto", "online", "offline", "disabled")


@dataclass
class PathsConfig:
    """Every directory the project writes or reads. Per machine: the git-ignored conf/local/."""

    output_dir: str = "${oc.env:DSPARK_OUTPUT_DIR,outputs}"
    data_dir: str = "${paths.output_dir}/data"
    checkpoint_dir: str = "${paths.output_dir}/checkpoints"
    cache_dir: str = "${dspark_cache_dir:}"
    """Converted targets, compiled ops: ``$DSPARK_CACHE`` or ``~/.cache/dspark``."""
    models_dir: str = "${oc.env:DSPARK_MODELS_DIR,/models}"


@dataclass
class LoggingConfig:
    """W&B (:mod:`dspark.config.wandb_run`): ``WANDB_MODE`` wins when set; ``auto`` is online when
    wandb finds a login (``WANDB_API_KEY``, ``wandb login``, its settings), offline files
    otherwise; wandb=false turns it off."""

    wandb: bool = True
    project: str = "dspark"
    entity: Optional[str] = None
    mode: str = "auto"
    """auto | online | offline | disabled; an environment ``WANDB_MODE`` overrides it."""
    group: Optional[str] = None
    """W&B group; None: ``<target.name>-<train.run_name>``, the drafter's extract, train and eval
    runs together. Set it to put the runs of one experiment (an ablation multirun) side by side."""

    def __post_init__(self) -> None:
        _choice("logging.mode", self.mode, WANDB_MODES)
