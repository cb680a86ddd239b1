"""The environment variables that place the project's directories (``paths.*``), checked before
anything is created under them. No project import: the config schema, the error handling of
every command and the caches of the serving and target wings read it."""

from __future__ import annotations

import os
from typing import Optional

PATH_ENV = ("DSPARK_OUTPUT_DIR", "DSPARK_CACHE", "DSPARK_MODELS_DIR")
"""Environment variables that place the project's directories (``dspark.config.PathsConfig``)."""


def path_env_problem(environ: Optional[dict[str, str]] = None) -> Optional[str]:
    """Why one of :data:`PATH_ENV` cannot place a directory (None: none can't): set but empty (the
    paths under it would start at the filesystem root: ``/data``, ``/checkpoints``, Hydra's ``/runs``),
    or the root itself."""
    env = os.environ if environ is None else environ
    for name in PATH_ENV:
        value = env.get(name)
        if value is None:
            continue
        if value.strip() == "":
            return (
                f"{name} is set but empty: the directories under it would start at the filesystem root (/data, "
                "/checkpoints, /runs) or the working directory; unset it (the default applies) or set it to a "
                "directory"
            )
        if os.path.abspath(os.path.expanduser(value)) == os.path.abspath(os.sep):
            return f"{name}={value!r}: the filesystem root; set it to a directory of its own"
        if any(ord(c) < 32 for c in value):
            return f"{name}={value!r}: a control character in a path; set it to a plain directory name"
    return None


def default_cache_dir() -> str:
    """``$DSPARK_CACHE`` or ``~/.cache/dspark``: converted targets, compiled ops."""
    value = os.environ.get("DSPARK_CACHE")
    return value if value and value.strip() else "~/.cache/dspark"
