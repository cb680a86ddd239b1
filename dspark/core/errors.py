"""User errors: bad input that the user fixes, reported in one line instead of a traceback.

Every error type the project raises for a user's input (a config value, a dataset directory, a
prompt file, a target, a checkpoint or export) derives from :class:`UserError`. A command wraps
its work in :func:`exit_on_user_error`: such an error ends it with exit status 2 and one
``error: <message>`` line on stderr. ``HYDRA_FULL_ERROR=1`` or ``DSPARK_DEBUG=1`` shows the
traceback instead. Bugs (any other exception) always show theirs.

Hydra's own composition errors (a key the schema lacks, an experiment that does not exist, a value
of the wrong type, an override it cannot parse) read the same: :func:`run_hydra_command` composes
the command line with Hydra's compose API before ``@hydra.main`` runs and words what Hydra refuses
as one such line (:func:`check_composition`).
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from dspark.core.path_env import path_env_problem
from dspark.core.renamed_keys import RENAMED_KEYS

DEBUG_ENV = ("HYDRA_FULL_ERROR", "DSPARK_DEBUG")
"""Either set to a value other than 0 shows the traceback of a user error."""
USER_ERROR_EXIT = 2
"""Exit status of a command refused for bad input (argparse's, and the other commands')."""
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The Hydra tree every command composes (``@hydra.main(config_path=.../conf, config_name="config")``)."""
MAX_SWEEP_CHECKS = 64
"""Compositions :func:`check_composition` runs for a ``--multirun`` sweep at most (one per value)."""


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
    except KeyboardInterrupt:
        if debug_requested():
            raise
        print(f"error: {INTERRUPTED}", file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED_EXIT) from None
    except OSError as err:
        line = user_os_error(err)
        if line is None or debug_requested():
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        raise SystemExit(USER_ERROR_EXIT) from None


INTERRUPTED_EXIT = 130
"""A shell's status for a command ended by Ctrl-C (128 + SIGINT)."""
INTERRUPTED = (
    "interrupted (Ctrl-C). Kept: every complete shard, the last checkpoint tag, every finished eval part; "
    "the same command resumes from them"
)


USER_OS_ERRORS = {
    errno.ENAMETOOLONG: "a name longer than the filesystem allows (255 bytes a name); pick a shorter one",
    errno.EACCES: "permission denied; pick a directory you can write, or change its permissions",
    errno.EPERM: "operation not permitted; pick a directory you can write",
    errno.EROFS: "a read-only filesystem; pick a writable directory",
    errno.ENOTDIR: "a file where a directory belongs in this path; pick another path",
    errno.EISDIR: "a directory where a file belongs; pick a file",
    errno.ELOOP: "too many symbolic links in this path (a link loop?)",
    errno.ENOEXEC: "not an executable this machine can run (damaged or for another machine)",
}
"""OS errors a user's paths cause (a setting, an argument), each with what to do: one ``error:``
line naming the path instead of a traceback."""


def user_os_error(err: OSError) -> Optional[str]:
    """``err`` as one line naming its path and the way out, or None for an OS error a user's path
    did not cause (a full disk has its own message, :mod:`dspark.core.disk_space`)."""
    hint = USER_OS_ERRORS.get(err.errno or -1)
    if hint is None:
        return None
    where = err.filename if err.filename is not None else "?"
    shown = str(where) if len(str(where)) <= 120 else f"{str(where)[:100]}... ({len(str(where))} characters)"
    return f"{shown}: {hint} ({os.strerror(err.errno)})"


_started: list[bool] = []


def task_started() -> None:
    """Called first by a ``@hydra.main`` function that :func:`run_hydra_command` runs."""
    _started.append(True)


def check_path_env() -> None:
    """Refuse a ``DSPARK_*`` directory variable that is set but empty, the filesystem root, or holds
    a control character (:func:`dspark.core.path_env.path_env_problem`): one line,
    before anything is created under it."""
    problem = path_env_problem()
    if problem:
        raise UserError(problem)


def run_hydra_command(main: Callable[[], Any]) -> None:
    """Run a ``@hydra.main`` command so that every config error exits with :data:`USER_ERROR_EXIT`
    and one ``error:`` line: a composition error (a key without ``+`` that the schema lacks, a
    missing group option, a value of the wrong type) is found by :func:`check_composition` before
    Hydra starts; the project's own config errors exit 2 from inside the command's function
    (:func:`exit_on_user_error`). Should Hydra still fail before that function starts
    (:func:`task_started`), its exit 1 becomes 2 too; an exit 1 after it started stays 1. With
    :data:`DEBUG_ENV` set, Hydra composes and reports alone (its traceback)."""
    _started.clear()
    with exit_on_user_error():  # before Hydra creates its run directory under paths.output_dir
        check_path_env()
    if not debug_requested():
        with exit_on_user_error():
            check_composition(sys.argv[1:])
    try:
        main()
    except SystemExit as e:
        if e.code == 1 and not _started:
            raise SystemExit(USER_ERROR_EXIT) from None
        raise


def renamed_key_message(key: str) -> Optional[str]:
    """One line for a key that moved (:data:`~dspark.core.renamed_keys.RENAMED_KEYS`): the old key,
    the new one, and how to write it; None for any other key."""
    new = RENAMED_KEYS.get(key.lstrip("+~"))
    if new is None:
        return None
    return f"{key.lstrip('+~')} is now {new} (export is a stage of its own): write {new}=... instead"


def closest_key(tree: Any, key: str, exclude: Iterable[str] = ()) -> Optional[str]:
    """The key of the config ``tree`` that the unknown ``key`` most likely meant: a key beside it
    spelt alike (``train.lrr`` -> ``train.lr``), else one of the same name elsewhere, the
    shallowest (``train.seed`` -> ``seed``), else one spelt very nearly alike elsewhere
    (``train.seeed`` -> ``seed``); None when there is none. ``exclude``: other unknown keys,
    never suggested."""
    exclude = set(exclude) | {key}
    group, _, name = key.rpartition(".")
    node = OmegaConf.select(tree, group) if group else tree
    siblings = [str(k) for k in (node.keys() if OmegaConf.is_dict(node) else [])]
    siblings = [k for k in siblings if f"{group}.{k}".lstrip(".") not in exclude]
    close = difflib.get_close_matches(name, siblings, n=1)
    if close:
        return f"{group}.{close[0]}".lstrip(".")
    keys = [k for k in _all_keys(tree, hydra=key.startswith("hydra.")) if k not in exclude]
    for cutoff in (1.0, 0.8):
        near = [k for k in keys if difflib.SequenceMatcher(None, name, k.rpartition(".")[2]).ratio() >= cutoff]
        if near:
            return min(near, key=lambda k: (k.count("."), k))
    return None


def _all_keys(node: Any, prefix: str = "", *, hydra: bool) -> Iterator[str]:
    """Every key of a config tree, dotted; Hydra's own settings (``hydra.*``) only if ``hydra``."""
    for k in node.keys() if OmegaConf.is_dict(node) else []:
        if str(k) == "hydra" and not prefix and not hydra:
            continue
        yield f"{prefix}{k}"
        child = node._get_node(k)
        if OmegaConf.is_dict(child):
            yield from _all_keys(child, f"{prefix}{k}.", hydra=hydra)


def check_composition(argv: list[str], *, config_dir: Path = CONF_DIR) -> None:
    """Compose what ``@hydra.main`` will compose from the command line ``argv``, with Hydra's
    compose API, and raise :class:`UserError` in our words where Hydra would refuse it: the
    override, what is wrong and the closest valid key or option (:func:`hydra_error_message`).
    Under ``--multirun`` each value of a sweep is composed (up to :data:`MAX_SWEEP_CHECKS` in all;
    ``glob(...)`` sweeps are left to Hydra). Help and completion compose nothing, and a command
    line naming another config directory is left to Hydra."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    args = get_args_parser().parse_args(argv)  # Hydra's own parser, as @hydra.main's
    if args.help or args.hydra_help or args.shell_completion or args.config_path or args.config_dir:
        return
    if args.experimental_rerun:
        return
    parser = OverridesParser.create()
    parsed = []
    for raw in args.overrides:
        try:
            parsed.append(parser.parse_override(raw))
        except HydraException as err:
            raise UserError(
                f"{raw}: cannot parse ({str(err).strip().splitlines()[0]}); expected KEY=VALUE, +KEY=VALUE or ~KEY "
                "(https://hydra.cc/docs/advanced/override_grammar/basic/)"
            ) from None
    multirun = args.multirun or "hydra.mode=MULTIRUN" in args.overrides
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        for overrides in _jobs(parsed, multirun):
            try:
                compose(config_name=args.config_name or "config", overrides=overrides)
            except (HydraException, OmegaConfBaseException) as err:
                raise UserError(hydra_error_message(err, parsed)) from err


def _jobs(parsed: list[Any], multirun: bool) -> Iterator[list[str]]:
    """The override lists to compose: the command line as given; under ``--multirun`` each sweep
    at its first value, then each of its other values in turn."""
    from hydra.errors import HydraException

    if not multirun:
        yield [o.input_line for o in parsed]
        return
    values: list[list[str]] = []
    for o in parsed:
        if not o.is_sweep_override():
            values.append([o.input_line])
            continue
        try:
            values.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        except HydraException:  # glob(...) needs the config loader; Hydra checks its own
            values.append([])
    first = [v[0] for v in values if v]
    yield first
    checks = 1
    for i, vs in enumerate(values):
        for v in vs[1:]:
            if checks >= MAX_SWEEP_CHECKS:
                return
            checks += 1
            yield [v if j == i else w[0] for j, w in enumerate(values) if w]


def _written(parsed: list[Any], key: str) -> str:
    """The override of ``key`` as the user wrote it, or the key."""
    return next((o.input_line for o in parsed if o.key_or_group == key), key)


def hydra_error_message(err: Exception, parsed: list[Any]) -> str:
    """One line for a composition error of Hydra's: the override, what is wrong, and the closest
    valid key or option. ``parsed``: the command line's overrides (Hydra's ``Override``)."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    text = str(err).strip()
    first = text.splitlines()[0].rstrip(".") if text else type(err).__name__
    cause = err.__cause__
    if (
        first.startswith("Could not override")
        and isinstance(cause, (ConfigAttributeError, ConfigKeyError))
        and cause.full_key
        and cause.parent_node is not None
    ):
        key = cause.full_key
        moved = renamed_key_message(key)
        if moved:
            return moved
        close = closest_key(cause.parent_node._get_root(), key)
        return f"unknown config key {key} " + (
            f"(did you mean {close}?)" if close else "(every key: python train.py --help)"
        )
    m = re.match(r"Could not (override|delete) '(.+?)'\. No match in the defaults list", text)
    if m:
        written = _written(parsed, m[2])
        if m[1] == "delete":
            return f"{written}: {m[2]} is not in the defaults list, nothing to delete"
        return f"{written}: {m[2]} is not in the defaults list (did you mean +{written.lstrip('+')}?)"
    if isinstance(err, MissingConfigException) and err.options and err.missing_cfg_file:
        group, _, name = err.missing_cfg_file.rpartition("/")
        written = next((o.input_line for o in parsed if o.key_or_group == group and o.input_line.endswith(name)), "")
        where = re.match(r"In '(.+?)'", text)
        if not written:  # a defaults list names it
            written = f"{group}={name}" + (f" (in {where[1]}.yaml)" if where else "")
        close = difflib.get_close_matches(name, err.options, n=1)
        hint = f" (did you mean {written.partition('=')[0]}={close[0]}?)" if close else ""
        return f"{written}: no such {group}, expected one of {', '.join(err.options)}{hint}"
    m = re.search(r"An item is already at '(.+?)'", text)
    if m:
        written = _written(parsed, m[1])
        return f"{written}: {m[1]} is set already, expected {written.lstrip('+')} (without +) to change it"
    m = re.match(r"Ambiguous value for argument '(.+?)=(.*)'", first)
    if m:
        return (
            f"{m[1]}={m[2]}: a comma outside brackets or quotes, expected {m[1]}=[{m[2]}] for a list, "
            f"{m[1]}='{m[2]}' for a string, or --multirun (-m) to sweep over the values"
        )
    m = re.match(r"Multiple values for (\S+?)\.? ", first)
    if m:
        given = [o for o in parsed if o.key_or_group == m[1]]
        key = given[0].get_key_element() if given else m[1]
        return (
            f"{', '.join(o.input_line for o in given) or m[1]}: one {m[1]} at a time, expected one {key}=NAME "
            f"(--multirun with {key}=A,B runs each)"
        )
    if first.startswith("Error merging override ") and cause is not None and str(cause).strip():
        return f"{first.removeprefix('Error merging override ')}: {str(cause).strip().splitlines()[0]}"
    if cause is not None and str(cause).strip():
        first += ": " + str(cause).strip().splitlines()[0]
    return first
