"""Bounded waits (issue #17: nothing hangs): a child process with a time limit, and a watchdog
for a call that starts processes (a vLLM engine). When a bound runs out, the processes waited
for are killed (the whole tree: vLLM's engine core and workers too) and :class:`WaitTimedOut`
names what was waited for, the bound, where its log is and what to do."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

from dspark.core.errors import UserError

log = logging.getLogger(__name__)
T = TypeVar("T")


class WaitTimedOut(UserError):
    """A bounded wait ran out: the message names what was waited for, the bound (and the setting
    that sets it), the log to read, and what to do."""


def kill_tree(pid: int, *, also_root: bool = True, grace_s: float = 10.0) -> list[int]:
    """SIGKILL ``pid``'s descendants (and ``pid`` itself unless ``also_root`` is False); returns
    the pids killed. psutil comes with DeepSpeed and vLLM."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + ([root] if also_root else [])
    except psutil.NoSuchProcess:
        return []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=grace_s)
    return [p.pid for p in procs]


def die_with_parent_hook() -> Optional[Callable[[], None]]:
    """Linux: a ``preexec_fn`` that has the child get SIGKILL when the thread that started it
    ends (a kill -9 of the driver must not leave a vLLM engine running for nobody; call
    :func:`run_child` from a thread that outlives the child, e.g. the main one). libc is looked
    up here, in the parent: the hook runs between fork and exec, where loading a library could
    wait on a lock another thread of the parent held."""
    if os.uname().sysname != "Linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_child(
    cmd: Sequence[str],
    *,
    log_file: Path,
    timeout_s: float,
    what: str,
    todo: str,
    cwd: Optional[Path] = None,
    env: Optional[dict[str, str]] = None,
) -> int:
    """Run ``cmd`` with its output in ``log_file``, at most ``timeout_s`` seconds; its exit status.
    It dies with this process (Linux). Past the bound (or on Ctrl-C here) it and every process it
    started are killed; past the bound :class:`WaitTimedOut` says ``<what> did not finish within
    N s ...; <todo>`` and names the log."""
    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as fh:  # the child's own log and progress bars, kept; a live view: tail -f
        proc = subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent_hook(),
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            killed = kill_tree(proc.pid)
            proc.wait()
            raise WaitTimedOut(
                f"{what} did not finish within {timeout_s:g} s (pid {proc.pid}; it and its {len(killed) - 1} "
                f"child process(es) were killed; its log: {log_file}); {todo}"
            ) from None
        except BaseException:
            kill_tree(proc.pid)
            proc.wait()
            raise


@contextlib.contextmanager
def watchdog(timeout_s: Optional[float], on_timeout: Callable[[], Any]) -> Iterator[threading.Event]:
    """Call ``on_timeout`` from a thread if the ``with`` body is still running after
    ``timeout_s`` seconds (None or 0: no bound); yields the event set when it fired."""
    fired, done = threading.Event(), threading.Event()

    def watch() -> None:
        if not done.wait(timeout_s):
            fired.set()
            on_timeout()

    if timeout_s:
        threading.Thread(target=watch, daemon=True, name="dspark-watchdog").start()
    try:
        yield fired
    finally:
        done.set()


def bounded_start(start: Callable[[], T], *, timeout_s: Optional[float], what: str, todo: str) -> T:
    """``start()`` (a call that starts child processes and waits for them, like ``vllm.LLM``),
    bounded: after ``timeout_s`` every process this one started is killed, which makes a waiting
    start-up fail, and that failure becomes :class:`WaitTimedOut` naming ``what`` and ``todo``."""

    def kill_children() -> None:
        # said before the kill: the kill makes the start fail at once, and the error printed then
        # must not be interleaved with this line
        log.error("%s: not done after %g s; killing its child processes", what, timeout_s)
        kill_tree(os.getpid(), also_root=False)

    with watchdog(timeout_s, kill_children) as fired:
        try:
            return start()
        except Exception as err:
            if fired.is_set():
                raise WaitTimedOut(f"{what} did not finish within {timeout_s:g} s; {todo}") from err
            raise
