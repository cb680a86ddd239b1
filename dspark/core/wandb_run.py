"""One W&B run setup for every stage: ``logging.mode`` auto means online with WANDB_API_KEY set,
offline (files only, no network) without it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

from dspark.core.config import RunConfig


def wandb_mode(mode: str) -> str:
    mode = str(mode)
    if mode == "auto":
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return mode


def init_wandb(cfg: RunConfig, out_dir: Path, job_type: str) -> Optional[Any]:
    """A W&B run for ``job_type`` ("train", "eval") writing under ``out_dir``/wandb, or None when
    ``logging.wandb`` is off."""
    lg = cfg.logging
    if not lg.wandb:
        return None
    import wandb

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)  # wandb adds its own wandb/ below
    suffix = "" if job_type == "train" else f"-{job_type}"
    return wandb.init(
        project=lg.project,
        entity=lg.entity,
        mode=wandb_mode(lg.mode),
        dir=str(out_dir),
        job_type=job_type,
        tags=list(cfg.tags),
        group=lg.group,
        config=cfg.to_dict(),
        name=f"{cfg.target.name}-{cfg.train.run_name}{suffix}-{int(time.time())}",
    )
