"""What every config group's checks share: :class:`ConfigError`, the small checks each
``__post_init__`` calls (a choice, a lower bound, a directory name, a compute dtype), and the dtype
names more than one group allows."""

from __future__ import annotations

from typing import Any

import torch

from dspark.core import fp8
from dspark.core.errors import UserError

NAME_MAX = 255
"""The longest file name (bytes) of the filesystems a run writes to (ext4, xfs, Lustre)."""
DTYPES = ("float32", "bfloat16", "float16")
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}
"""Config dtype names (target, train, export, shard storage) -> torch dtypes."""
FP8_STORE_DTYPES = tuple(fp8.FORMATS)
"""Shard storage only (``data.store_dtype``): values with a scale per token and layer,
dequantized by the reader (:mod:`dspark.core.fp8`, whose ``FORMATS`` declares them); nothing
computes in them."""
STORE_DTYPES = DTYPES + FP8_STORE_DTYPES
"""Every ``data.store_dtype``; :data:`dspark.formats.shard_format.STORE_DTYPES` maps them to bytes."""


class ConfigError(UserError):
    """A config value out of range or not among the allowed choices. The message names the key,
    the value and what is allowed."""


def _unresolved(value: Any) -> bool:
    """OmegaConf builds each schema once with its raw defaults, interpolations unresolved; the
    checks run again on the resolved values in :func:`load_config`."""
    return isinstance(value, str) and "${" in value


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {allowed}")


def _dir_name(key: str, value: Any, becomes: str) -> None:
    """A name the run joins into paths (``becomes``: the directories it names) is checked as a
    path component: ``.``, ``..``, empty, a leading dot or a ``/`` would put the run into another
    run's directory, its parent's, or a hidden one."""
    if not _unresolved(value):
        _check(
            isinstance(value, str) and value != "" and "/" not in value and not value.startswith("."),
            key,
            value,
            f"expected a directory name (not empty, no '/', not '.' or '..', no leading '.'): it names {becomes}",
        )
        _check(
            not any(ord(c) < 32 or ord(c) == 127 for c in value),
            key,
            value,
            f"a control character (a newline, a tab) in a directory name: it names {becomes}",
        )
        _check(
            len(value.encode()) <= NAME_MAX - 32,
            key,
            value if len(value) <= 40 else f"{value[:40]}... ({len(value.encode())} bytes)",
            f"expected a directory name of at most {NAME_MAX - 32} bytes (the filesystem's limit is {NAME_MAX}, and "
            f"the run adds suffixes): it names {becomes}",
        )


def _choice(key: str, value: Any, choices: tuple) -> None:
    if not _unresolved(value):
        _check(value in choices, key, value, f"expected one of {list(choices)}")


def _refuse_fp8(key: str, value: Any) -> None:
    """fp8 names where something computes: say where they belong instead of a bare choice list."""
    if value in FP8_STORE_DTYPES:
        raise ConfigError(
            f"{key}={value!r}: fp8 is a shard storage format, allowed only for data.store_dtype; "
            f"expected one of {list(DTYPES)}"
        )


def _compute_dtype(key: str, value: Any) -> None:
    _refuse_fp8(key, value)
    _choice(key, value, DTYPES)


def _at_least(key: str, value: Any, low: float) -> None:
    if not _unresolved(value):
        _check(value is not None and value >= low, key, value, f"expected a number >= {low}")
