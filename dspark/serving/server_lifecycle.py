"""A local server's life, for every engine the eval serves with (vLLM's OpenAI server, llama.cpp's
``llama-server``): a free port (one in use is refused), the server in its own session with its
output in a log, healthy (``GET /health``) within a bound or stopped, and always stopped
afterwards, its whole process tree with it. A server dies with the process that started it (a
kill -9 of the driver leaves nothing running).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from dspark.core.errors import UserError
from dspark.core.ports import free_port
from dspark.core.waits import die_with_parent_hook, log_tail

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]


class ServerError(UserError):
    """A server that cannot be started where asked, or would not serve: the message names the
    key or the log."""


class PortInUseError(ServerError):
    """The configured port answers or is bound already; it is never reused blindly."""


class ServerStartError(ServerError):
    """The server exited, or was not healthy within the timeout (and was stopped): names its log."""


# --- ports ---------------------------------------------------------------------------------------


def port_in_use(host: str, port: int) -> bool:
    """Something listens on, or holds, ``host:port`` (a connect succeeds or a bind fails)."""
    with socket.socket() as s:
        s.settimeout(1.0)
        if s.connect_ex((host, port)) == 0:
            return True
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what uvicorn sets: TIME_WAIT is no owner
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def choose_port(host: str, port: int, *, setting: Optional[str]) -> int:
    """``port`` when it is free, a free one picked by the OS for 0; a port in use is refused.
    ``setting``: the caller's config key that set ``port``, which a refusal names (None: a port
    the caller picks, 0)."""
    key = setting or "port"
    if port == 0:
        for _ in range(20):
            p = free_port(host)
            if not port_in_use(host, p):
                return p
        raise PortInUseError(f"{key}=0: no free port found on {host}")
    if port_in_use(host, port):
        raise PortInUseError(
            f"{key}={port}: {host}:{port} is in use (another server?); it is not reused, expected a "
            f"free port, or {key}=0 to pick one"
        )
    return port


# --- the process tree -------------------------------------------------------------------------


def process_tree(pid: int) -> list[Any]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss(pid: int) -> int:
    import psutil

    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


# --- start, wait, stop ---------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen
    host: str
    port: int
    log_path: Path
    start_s: float = 0.0
    pids: list[int] = field(default_factory=list)
    """Its process tree when it was stopped (all of them gone afterwards)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def wait_healthy(
    server: Server,
    timeout_s: float,
    *,
    what: str,
    poll_s: float = 1.0,
    engine: str = "vLLM",
    timeout_key: str,
) -> float:
    """Seconds until ``GET /health`` answers 200. The server exiting first, or the timeout, raise
    :class:`ServerStartError` naming its log (the caller stops the server) and, for the timeout,
    ``timeout_key``: the caller's name for the bound (its config key)."""
    t0 = time.monotonic()
    while True:
        rc = server.proc.poll()
        if rc is not None:
            raise ServerStartError(
                f"{what}: the {engine} server exited with status {rc} before it was healthy; "
                f"its log: {server.log_path}\n"
                f"last lines:\n{log_tail(server.log_path)}"
            )
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise ServerStartError(
                f"{what}: the {engine} server was not healthy within {timeout_s:g}s ({timeout_key}) and "
                f"was stopped; its log: {server.log_path}"
            )
        time.sleep(poll_s)


def stop_server(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's process group (it runs in its own session), SIGKILL after
    ``grace_s``; any process of its tree still alive (one that left the group) is killed too."""
    import psutil

    tree = process_tree(proc.pid)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)
        _, alive = psutil.wait_procs(tree, timeout=0 if proc.poll() is None else wait_s)
        if proc.poll() is not None and not alive:
            return
    for p in psutil.wait_procs(tree, timeout=0)[1]:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(tree, timeout=10)


@contextlib.contextmanager
def running_server(
    cmd: list[str],
    *,
    host: str,
    port: int,
    log_path: Path,
    timeout_s: float,
    env: dict[str, str],
    what: str,
    engine: str = "vLLM",
    timeout_key: str,
) -> Iterator[Server]:
    """A server from ``cmd`` (its own session, its output in ``log_path``), healthy within
    ``timeout_s`` (named ``timeout_key`` when it is not: :func:`wait_healthy`); stopped on the way
    out, whatever happens."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("%s: %s (log: %s)", what, " ".join(cmd), log_path)
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(  # its own session, and it dies with this process (a kill -9 of the driver)
            cmd,
            cwd=REPO,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent_hook(),
        )
    server = Server(proc, host, port, log_path)
    try:
        server.start_s = wait_healthy(server, timeout_s, what=what, engine=engine, timeout_key=timeout_key)
        log.info("%s: healthy after %.0fs at %s", what, server.start_s, server.url)
        yield server
    finally:
        server.pids = [p.pid for p in process_tree(proc.pid)]
        stop_server(proc)
