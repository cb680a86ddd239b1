"""User errors: bad input that the user fixes, reported in one line instead of a traceback.

Every error type the project raises for a user's input (a config value, a dataset directory, a
prompt file, a target, a checkpoint or export) derives from :class:`UserError`. A command wraps
its work in :func:`exit_on_user_error`: such an error ends it with exit status 2 and one
``error: <message>`` line on stderr. ``HYDRA_FULL_ERROR=1`` or ``DSPARK_DEBUG=1`` shows the
traceback instead. Bugs (any other exception) always show theirs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

DEBUG_ENV = ("HYDRA_FULL_ERROR", "DSPARK_DEBUG")
"""Either set to a value other than 0 shows the traceback of a user error."""
USER_ERROR_EXIT = 2
"""Exit status of a command refused for bad input (argparse's, and the other commands')."""


class UserError(ValueError):
    """Bad input the user can act on. The message names the file or key, the value, what was
    expected and, where there is one, the command that fixes it."""


def debug_requested() -> bool:
    return any(os.environ.get(name, "") not in ("", "0") for name in DEBUG_ENV)


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Turn a :class:`UserError` raised inside into ``error: <message>`` on stderr and exit
    status 2 (:data:`USER_ERROR_EXIT`), unless a traceback was asked for (:data:`DEBUG_ENV`)."""
    try:
        yield
    except UserError as err:
        if debug_requested():
            raise
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(USER_ERROR_EXIT) from None


_started: list[bool] = []


def task_started() -> None:
    """Called first by a ``@hydra.main`` function that :func:`run_hydra_command` runs."""
    _started.append(True)


def run_hydra_command(main: Callable[[], Any]) -> None:
    """Run a ``@hydra.main`` command so that every config error exits with :data:`USER_ERROR_EXIT`:
    Hydra reports a composition error (a key without ``+`` that the schema lacks, a missing group
    option, a value of the wrong type) with exit status 1 before the command's function starts
    (:func:`task_started`); the project's own config errors exit 2 from inside it
    (:func:`exit_on_user_error`). An exit 1 after the function started stays 1."""
    _started.clear()
    try:
        main()
    except SystemExit as e:
        if e.code == 1 and not _started:
            raise SystemExit(USER_ERROR_EXIT) from None
        raise
