"""One W&B run setup for every stage (extract, train, eval), decided the way W&B users expect.

- Mode: ``WANDB_MODE`` in the environment (or ``WANDB_DISABLED=true``) wins over the config's
  ``logging.mode``. ``auto`` follows wandb's own settings: a mode set by ``wandb offline`` or
  ``wandb disabled``; else online when wandb finds credentials without asking (``WANDB_API_KEY``,
  an identity token file, the netrc entry ``wandb login`` writes, or the ``api_key`` of its
  settings file), offline files otherwise. Nothing here touches the network.
- Names: ``<target>-<run_name>-<stage>``; ``train.run_name`` tells the variants apart
  (``markov256``, its ablation ``markov0``).
- Group: ``logging.group``, or ``<target>-<run_name>`` so that the extract, train and eval runs
  of one drafter sit together; ``job_type`` is the stage.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

from dspark.config import RunConfig

log = logging.getLogger(__name__)

WANDB_MODE_ALIASES = {"dryrun": "offline", "run": "online"}
"""Older spellings wandb still reads from ``WANDB_MODE``."""


def wandb_credentials() -> Optional[str]:
    """Where wandb would find credentials without prompting (a name for the log), or None."""
    if os.environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "WANDB_IDENTITY_TOKEN_FILE"
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        settings = wandb_setup.singleton().settings
        if wbauth.read_netrc_auth(host=settings.base_url):
            return "netrc (wandb login)"
        if settings.api_key:
            return "wandb settings api_key"
    except Exception as err:  # noqa: BLE001 - another wandb layout, a malformed key: no credentials
        log.debug("W&B credentials lookup failed: %s", err)
    return None


def _settings_mode() -> Optional[str]:
    """The mode wandb's settings files hold (``wandb offline`` / ``wandb disabled``), if not online."""
    try:
        from wandb.sdk import wandb_setup

        mode = str(wandb_setup.singleton().settings.mode)
    except Exception:  # noqa: BLE001
        return None
    mode = WANDB_MODE_ALIASES.get(mode, mode)
    return mode if mode in ("offline", "disabled") else None


def wandb_mode(mode: str) -> str:
    """online | offline | disabled for ``logging.mode``: the environment first, then the config,
    then (for ``auto``) wandb's settings and credentials."""
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled"
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env:
        return WANDB_MODE_ALIASES.get(env, env)
    if str(mode) != "auto":
        return str(mode)
    return _settings_mode() or ("online" if wandb_credentials() else "offline")


def run_group(cfg: RunConfig) -> str:
    """``logging.group``, or the drafter's own: its extract, train and eval runs side by side."""
    return cfg.logging.group or f"{cfg.target.name}-{cfg.train.run_name}"


def run_name(cfg: RunConfig, job_type: str) -> str:
    return f"{cfg.target.name}-{cfg.train.run_name}-{job_type}"


def init_wandb(cfg: RunConfig, out_dir: Path, job_type: str) -> Optional[Any]:
    """A W&B run for the stage ``job_type`` ("extract", "train", "eval") writing under
    ``out_dir``/wandb, or None when ``logging.wandb`` is off or the mode is ``disabled``."""
    lg = cfg.logging
    if not lg.wandb:
        return None
    mode = wandb_mode(lg.mode)
    if mode == "disabled":
        log.info("W&B: disabled (%s)", "WANDB_MODE" if os.environ.get("WANDB_MODE") else "logging.mode")
        return None
    import wandb

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)  # wandb adds its own wandb/ below
    run = wandb.init(
        project=lg.project,
        entity=lg.entity,
        mode=mode,
        dir=str(out_dir),
        job_type=job_type,
        tags=[t[:64] for t in (*cfg.tags, cfg.target.name, cfg.train.run_name)],  # W&B's limit
        group=run_group(cfg),
        config=cfg.to_dict(),
        name=run_name(cfg, job_type),
    )
    log.info("W&B %s run %s (group %s) in %s", mode, run.name, run.group, out_dir / "wandb")
    return run
