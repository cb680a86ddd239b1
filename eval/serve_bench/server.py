"""A vLLM OpenAI server for the serving benchmark: its command line with the eval's engine
arguments, and the peak memory of its process tree while it serves. Its life (a free port,
healthy within a bound, always stopped with its whole tree) is :mod:`dspark.serving.server_lifecycle`', which
llama.cpp's server shares; the names are re-exported here for the benchmark's callers, the port
and the start-up bound under the benchmark's own settings (:data:`PORT_SETTING`,
:data:`START_TIMEOUT_SETTING`).

A server is started as ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve``
runs); it dies with the process that started it (a kill -9 of the benchmark leaves nothing
running).
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from dspark.serving import server_lifecycle
from dspark.serving.methods import OURS, ServingMethod, speculative_config
from dspark.serving.server_lifecycle import (  # noqa: F401  (re-exported: the benchmark's callers import them here)
    REPO,
    PortInUseError,
    Server,
    ServerError,
    ServerStartError,
    port_in_use,
    process_tree,
    stop_server,
    tree_rss,
    wait_healthy,
)

log = logging.getLogger(__name__)

PORT_SETTING = "serve_bench.port"
"""The setting that picks a benchmark server's port, which a refusal names."""
START_TIMEOUT_SETTING = "serve_bench.start_timeout_s"
"""The setting that bounds a benchmark server's start (vLLM's or llama-server), which a timeout names."""


def choose_port(host: str, port: int) -> int:
    """:func:`dspark.serving.server_lifecycle.choose_port` for :data:`PORT_SETTING`."""
    return server_lifecycle.choose_port(host, port, setting=PORT_SETTING)


def running_server(cmd: list[str], **kwargs: Any) -> contextlib.AbstractContextManager[Server]:
    """:func:`dspark.serving.server_lifecycle.running_server` bounded by :data:`START_TIMEOUT_SETTING`."""
    return server_lifecycle.running_server(cmd, timeout_key=START_TIMEOUT_SETTING, **kwargs)


@dataclass(frozen=True)
class Configuration:
    """One server: ``method`` None (no speculation), ngram, dflash or dspark with ``draft``."""

    name: str
    method: Optional[str] = None
    draft: Optional[Path] = None
    engine: str = "vllm"
    """vllm, or llama.cpp (``llama-server``; ``draft`` is then the drafter's GGUF)."""

    @classmethod
    def serving(cls, name: str, m: ServingMethod, draft: Optional[Path] = None) -> Configuration:
        """``serve_bench.configs`` entry ``name`` served with ``m``."""
        return cls(name, m.name if m.vllm_method is not None else None, draft)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.method})" if self.name == OURS else self.name


# --- the command -------------------------------------------------------------------------------


def engine_flags(kwargs: dict[str, Any]) -> list[str]:
    """vllm.LLM keyword arguments (``eval.engine_args.engine_kwargs``) as the server's command-line flags."""
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
