"""A vLLM OpenAI server's life, for the serving benchmark: a free port (one in use is refused),
the command line with the eval's engine arguments, the server in its own session with its output
in a log, healthy (``GET /health``) within a bound or stopped, and always stopped afterwards,
its whole process tree with it; the peak memory of that tree while it serves.

A server is started as ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve``
runs); it dies with the process that started it (a kill -9 of the benchmark leaves nothing
running).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from dspark.core.errors import UserError
from dspark.core.files import free_port
from dspark.core.serving import OURS, ServingMethod, speculative_config
from dspark.core.waits import die_with_parent_hook, log_tail

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]


class ServerError(UserError):
    """A server that cannot be started where asked, or would not serve: the message names the
    key or the log."""


class PortInUseError(ServerError):
    """The configured port answers or is bound already; it is never reused blindly."""


class ServerStartError(ServerError):
    """The server exited, or was not healthy within the timeout (and was stopped): names its log."""


@dataclass(frozen=True)
class Configuration:
    """One server: ``method`` None (no speculation), ngram, dflash or dspark with ``draft``."""

    name: str
    method: Optional[str] = None
    draft: Optional[Path] = None

    @classmethod
    def serving(cls, name: str, m: ServingMethod, draft: Optional[Path] = None) -> Configuration:
        """``serve_bench.configs`` entry ``name`` served with ``m``."""
        return cls(name, m.name if m.vllm_method is not None else None, draft)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.method})" if self.name == OURS else self.name


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


def choose_port(host: str, port: int) -> int:
    """``port`` when it is free, a free one picked by the OS for 0; a port in use is refused."""
    if port == 0:
        for _ in range(20):
            p = free_port(host)
            if not port_in_use(host, p):
                return p
        raise PortInUseError(f"serve_bench.port=0: no free port found on {host}")
    if port_in_use(host, port):
        raise PortInUseError(
            f"serve_bench.port={port}: {host}:{port} is in use (another server?); it is not reused, expected a "
            "free port, or serve_bench.port=0 to pick one"
        )
    return port


# --- the command -------------------------------------------------------------------------------


def engine_flags(kwargs: dict[str, Any]) -> list[str]:
    """vllm.LLM keyword arguments (``eval.inputs.engine_kwargs``) as the server's command-line flags."""
    flags: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def server_command(
    target: Path,
    c: Configuration,
    *,
    host: str,
    port: int,
    gamma: int,
    max_model_len: int,
    dtype: str,
    seed: int,
    engine_kwargs: dict[str, Any],
    prefix_caching: bool = False,
) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` with the eval's engine arguments
    (prefix caching off unless asked: every level sends the same prompts, and a cache would give
    every level after the first its prefill for free)."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(target),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--seed",
        str(seed),
        *([] if prefix_caching else ["--no-enable-prefix-caching"]),
        "--host",
        host,
        "--port",
        str(port),
    ]
    spec = speculative_config(c.method, c.draft, gamma)
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd + engine_flags(engine_kwargs)


# --- memory --------------------------------------------------------------------------------------


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


def gpu_bytes(pids: set[int]) -> Optional[int]:
    """GPU memory the processes ``pids`` hold (nvidia-smi), or None without GPUs."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    total = 0
    for line in out.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            with contextlib.suppress(ValueError):
                total += int(float(parts[1])) * 2**20
    return total


class MemorySampler:
    """The peak memory of a server's process tree, sampled every ``every_s`` in a thread: RSS
    (summed over the tree), and GPU memory where nvidia-smi answers. ``take()`` returns the peaks
    since the last ``take()``."""

    def __init__(self, pid: int, *, gpu: bool, every_s: float = 0.5):
        self.pid, self.gpu, self.every_s = pid, gpu, every_s
        self.peak_rss = self.peak_gpu = 0
        self.life_rss = self.life_gpu = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        rss = tree_rss(self.pid)
        gpu = gpu_bytes({p.pid for p in process_tree(self.pid)}) if self.gpu else None
        with self._lock:
            self.peak_rss, self.life_rss = max(self.peak_rss, rss), max(self.life_rss, rss)
            if gpu is not None:
                self.peak_gpu, self.life_gpu = max(self.peak_gpu, gpu), max(self.life_gpu, gpu)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def take(self) -> dict[str, Optional[float]]:
        self._sample()
        with self._lock:
            out = {"peak_rss_gib": self.peak_rss / 2**30, "peak_gpu_gib": self.peak_gpu / 2**30 if self.gpu else None}
            self.peak_rss = self.peak_gpu = 0
        return out

    def stop(self) -> dict[str, Optional[float]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return {"peak_rss_gib": self.life_rss / 2**30, "peak_gpu_gib": self.life_gpu / 2**30 if self.gpu else None}


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


def wait_healthy(server: Server, timeout_s: float, *, what: str, poll_s: float = 1.0) -> float:
    """Seconds until ``GET /health`` answers 200. The server exiting first, or the timeout, raise
    :class:`ServerStartError` naming its log (the caller stops the server)."""
    t0 = time.monotonic()
    while True:
        rc = server.proc.poll()
        if rc is not None:
            raise ServerStartError(
                f"{what}: the vLLM server exited with status {rc} before it was healthy; its log: {server.log_path}\n"
                f"last lines:\n{log_tail(server.log_path)}"
            )
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise ServerStartError(
                f"{what}: the vLLM server was not healthy within {timeout_s:g}s (serve_bench.start_timeout_s) and "
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
    cmd: list[str], *, host: str, port: int, log_path: Path, timeout_s: float, env: dict[str, str], what: str
) -> Iterator[Server]:
    """A server from ``cmd`` (its own session, its output in ``log_path``), healthy; stopped on
    the way out, whatever happens."""
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
        server.start_s = wait_healthy(server, timeout_s, what=what)
        log.info("%s: healthy after %.0fs at %s", what, server.start_s, server.url)
        yield server
    finally:
        server.pids = [p.pid for p in process_tree(proc.pid)]
        stop_server(proc)
