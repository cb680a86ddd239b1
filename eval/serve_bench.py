"""Serving A/B benchmark (issue #15): what a drafter does to a real vLLM server under load.

For each configuration in ``serve_bench.configs`` (``none``: no speculation; ``ngram``; ``ours``:
this run's export, served as ``dspark`` on GPUs and as the ``dflash`` layout on CPU, as the eval
does) a real OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``, the
eval's engine arguments) is started on a free port, waited for (``/health``) and always stopped;
vLLM's own benchmark client (``vllm bench serve``, through :mod:`eval.bench_client`) drives it at
each level of ``serve_bench.concurrency`` over the eval set or your traffic file. Per
configuration and level: output tokens/s, requests/s, TTFT p50/p95/p99, TPOT and ITL p50/p95,
end-to-end latency, the spec-decode counters of the server's ``/metrics`` (drafts, accepted
tokens, per position) and the server's peak memory (RSS of its process tree on CPU, GPU memory on
GPUs). Two acceptance figures: the headline tokens per target step = 1 + accepted / steps over
**every** verification step, drafted or not (steps = output tokens - requests - accepted: each
request's first token comes from prefill), and vLLM's tau = 1 + accepted / drafts, over the
steps with a draft only (ngram drafts only where the last tokens match earlier ones). Written to
``serve_bench.out_dir``: ``serve_bench.json``, ``serve_bench.md``, ``tokens_per_s.png``,
``itl_p95.png``, ``speedup.png``; logged to W&B.

    python -m eval.serve_bench +experiment=smollm2_cpu_demo                 # the eval set, c = 1, 2, 4
    python -m eval.serve_bench +experiment=... serve_bench.traffic_file=my_traffic.jsonl \\
        serve_bench.concurrency=[1,8,32] serve_bench.request_rate=4 serve_bench.num_prompts=200
    python train.py +experiment=... stages=[extract,train,eval,serve_bench]  # as a stage of the main job

Keys (``serve_bench.KEY=VALUE``; types and defaults: dspark/core/config.py, ServeBenchConfig):
configs, concurrency, request_rate, num_prompts, output_len, ignore_eos, temperature,
traffic_file, max_model_len, num_warmups, host, port, start_timeout_s, level_timeout_s, out_dir.

A traffic file is JSONL, one ``{"prompt": "...", "output_tokens": N}`` per line (vLLM's custom
dataset; ``output_tokens`` optional: ``serve_bench.output_len`` wins unless it is null). A server that is not
healthy within ``serve_bench.start_timeout_s`` is stopped and the error names its log; a port
that is in use is refused; a traffic file in the wrong format is refused naming the file and
line. Each ends the command with one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from dspark.core.config import RunConfig, ServeBenchConfig, config_fingerprint, load_config
from dspark.core.errors import UserError, exit_on_user_error
from dspark.core.files import atomic_write_json, atomic_write_text, file_sha256, free_port, read_jsonl, write_jsonl
from dspark.core.waits import die_with_parent_hook, log_tail
from eval.report import _nan_to_none
from eval.results import AcceptanceCounts

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
PERCENTILES = (50, 95, 99)
METRICS = {  # serve_bench.json name -> the key of vLLM's benchmark result
    "output_tokens_per_s": "output_throughput",
    "requests_per_s": "request_throughput",
    "total_tokens_per_s": "total_token_throughput",
    "ttft_p50_ms": "p50_ttft_ms",
    "ttft_p95_ms": "p95_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "tpot_p50_ms": "p50_tpot_ms",
    "tpot_p95_ms": "p95_tpot_ms",
    "itl_p50_ms": "p50_itl_ms",
    "itl_p95_ms": "p95_itl_ms",
    "e2el_mean_ms": "mean_e2el_ms",
    "e2el_p50_ms": "p50_e2el_ms",
    "e2el_p95_ms": "p95_e2el_ms",
    "e2el_p99_ms": "p99_e2el_ms",
    "duration_s": "duration",
    "completed": "completed",
    "failed": "failed",
    "total_input_tokens": "total_input_tokens",
    "total_output_tokens": "total_output_tokens",
}
ORDER = ("none", "ngram", "ours", "dflash", "dspark")
RENDEZVOUS = ("master_addr", "master_port", "node_rank")
"""Multi-node engine arguments left out of the conditions, so the configurations of one job
(one srun step and rendezvous port each) make one report."""


class ServeBenchError(UserError):
    """Bad input or a server that would not serve: the message names the file, key or log."""


class TrafficFileError(ServeBenchError):
    """A traffic file vLLM's custom dataset cannot read: names the file and line."""


class PortInUseError(ServeBenchError):
    """The configured port answers or is bound already; it is never reused blindly."""


class ServerStartError(ServeBenchError):
    """The server exited, or was not healthy within the timeout (and was stopped): names its log."""


# --- configurations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Configuration:
    """One server: ``method`` None (no speculation), ngram, dflash or dspark with ``draft``."""

    name: str
    method: Optional[str] = None
    draft: Optional[Path] = None

    @property
    def label(self) -> str:
        return f"{self.name} ({self.method})" if self.name == "ours" else self.name


def resolve_configs(cfg: RunConfig, target_dir: Path, *, gpu: bool) -> list[Configuration]:
    """``serve_bench.configs`` as servers: ``ours`` is ``dspark`` on GPUs and the ``dflash``
    export on CPU (left out, with a log line, when the drafter has no dflash layout)."""
    out = []
    for name in cfg.serve_bench.configs:
        if name == "none":
            out.append(Configuration("none"))
        elif name == "ngram":
            out.append(Configuration("ngram", "ngram"))
        else:
            layout = name if name != "ours" else ("dspark" if gpu else "dflash")
            draft = ensure_export(cfg, target_dir, layout, required=name != "ours")
            if draft is None:
                log.info(
                    "serve_bench: vLLM on CPU serves only the dflash layout and this drafter has none "
                    "(sample_from_anchor or a Markov head); 'ours' is left out. On a GPU it is served as dspark."
                )
                continue
            out.append(Configuration(name, layout, draft))
    return out


def ensure_export(cfg: RunConfig, target_dir: Path, layout: str, *, required: bool) -> Optional[Path]:
    """This run's export in ``layout`` (the eval stage writes it; exported here when missing and the
    checkpoint is there). None when the drafter has no such layout and ``required`` is False."""
    from eval.run import export_all, export_path

    path = export_path(cfg, "dspark", layout)
    exported = any((export_path(cfg, "dspark", x) / "export.json").is_file() for x in (layout, "dspark"))
    if not exported:  # export_all writes the dspark layout always, the dflash one where the drafter has it
        ckpt = Path(cfg.eval.checkpoint or cfg.train.checkpoint_dir).expanduser()
        if not ckpt.exists():
            raise ServeBenchError(
                f"serve_bench: no {layout} export at {path} and no checkpoint at {ckpt}; train first "
                "(stages=[extract,train]) or set eval.checkpoint"
            )
        export_all(cfg, ckpt, target_dir, "dspark")
    if (path / "export.json").is_file():
        return path
    if required:
        raise ServeBenchError(
            f"serve_bench.configs has {layout}, but this drafter has no {layout} export (the dflash layout "
            "needs drafter.sample_from_anchor=false and drafter.markov_rank=0); use 'ours'"
        )
    return None


def speculative_config(c: Configuration, gamma: int) -> Optional[dict[str, Any]]:
    from eval.serve import speculative_config as eval_spec

    return None if c.method is None else eval_spec(c.method, c.draft, gamma)


# --- traffic -----------------------------------------------------------------------------------


def load_traffic(path: Path, *, need_output_tokens: bool = False) -> list[dict[str, Any]]:
    """A traffic file in vLLM's custom-dataset format, checked line by line before any server
    starts: a JSON object per line with a non-empty string ``prompt`` and, optionally (on every
    line with ``need_output_tokens``: serve_bench.output_len=null), a positive integer
    ``output_tokens``."""
    where = f"serve_bench.traffic_file={path}"
    if not path.is_file():
        raise TrafficFileError(f'{where}: no such file, expected JSONL with one {{"prompt": ...}} per line')
    if path.suffix != ".jsonl":
        raise TrafficFileError(f"{where}: expected a .jsonl file (vLLM's custom dataset reads JSONL only)")
    rows = []
    try:
        for n, rec in read_jsonl(path, error=TrafficFileError):
            if not isinstance(rec, dict):
                raise TrafficFileError(f'{path}:{n}: expected a JSON object with a "prompt" string, got {rec!r:.80}')
            prompt = rec.get("prompt")
            if not isinstance(prompt, str) or not prompt.strip():
                raise TrafficFileError(f'{path}:{n}: field "prompt" is {prompt!r:.80}, expected a non-empty string')
            tokens = rec.get("output_tokens")
            if "output_tokens" in rec and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
                raise TrafficFileError(f'{path}:{n}: field "output_tokens" is {tokens!r}, expected an integer >= 1')
            if need_output_tokens and "output_tokens" not in rec:
                raise TrafficFileError(
                    f'{path}:{n}: no "output_tokens", expected one on every line with serve_bench.output_len=null'
                )
            rows.append(rec)
    except UnicodeDecodeError as e:
        raise TrafficFileError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not rows:
        raise TrafficFileError(f'{where}: no requests in it, expected one {{"prompt": ...}} per line')
    return rows


def eval_set_traffic(cfg: RunConfig, heads: Any, out_dir: Path) -> tuple[Path, int]:
    """The eval set (what the eval measures tau on) as a traffic file: each prompt's tokens (the
    chat template applied already) decoded to text; the longest prompt, in tokens."""
    from eval.run import eval_set

    prompts, _ = eval_set(cfg, heads, out_dir)
    path = out_dir / "traffic_eval_set.jsonl"
    tok = heads.tokenizer
    write_jsonl(
        path,
        [{"prompt": tok.decode(list(p.prompt_token_ids)), "output_tokens": answer_len(cfg)} for p in prompts],
    )
    return path, max(p.num_tokens for p in prompts)


# --- ports and servers -------------------------------------------------------------------------


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


def engine_flags(kwargs: dict[str, Any]) -> list[str]:
    """vllm.LLM keyword arguments (``eval.run.engine_kwargs``) as the server's command-line flags."""
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
    spec = speculative_config(c, gamma)
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd + engine_flags(engine_kwargs)


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


# --- the client --------------------------------------------------------------------------------


@dataclass
class Level:
    """One concurrency level against one server."""

    concurrency: int
    metrics: dict[str, float]
    spec: Optional[dict[str, Any]]
    memory: dict[str, Optional[float]]
    client_log: str


@dataclass
class ConfigResult:
    name: str
    label: str
    method: Optional[str]
    draft: Optional[str]
    server_log: str
    server_start_s: float
    memory: dict[str, Optional[float]]
    levels: list[Level] = field(default_factory=list)
    server_pids: list[int] = field(default_factory=list)


def client_argv(
    server: Server,
    *,
    target: Path,
    traffic: Path,
    templated: bool,
    concurrency: int,
    num_prompts: int,
    sb: ServeBenchConfig,
    seed: int,
) -> list[str]:
    """The arguments of ``vllm bench serve`` for one level."""
    argv = [
        "--backend",
        "vllm",
        "--base-url",
        server.url,
        "--model",
        str(target),
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(traffic),
        "--num-prompts",
        str(num_prompts),
        "--custom-output-len",
        str(sb.output_len if sb.output_len is not None else -1),  # -1: each request's output_tokens
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        str(sb.request_rate if sb.request_rate is not None else "inf"),
        "--temperature",
        str(sb.temperature),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        ",".join(str(p) for p in PERCENTILES),
        "--num-warmups",
        str(sb.num_warmups),
        "--seed",
        str(seed),
        "--disable-shuffle",
        "--disable-tqdm",
    ]
    if templated:
        argv.append("--skip-chat-template")
    if sb.ignore_eos:
        argv.append("--ignore-eos")
    return argv


def run_client(argv: list[str], out: Path, *, timeout_s: float, what: str) -> dict[str, Any]:
    """``python -m eval.bench_client OUT ARGV`` (vLLM's benchmark in its own process); its result."""
    cmd = [sys.executable, "-m", "eval.bench_client", str(out), *argv]
    log_path = out.with_suffix(".log")
    with open(log_path, "w") as fh:
        try:
            proc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"{what}: vLLM's benchmark client ran past {timeout_s:g}s (serve_bench.level_timeout_s); its log: "
                f"{log_path}"
            ) from None
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(
            f"{what}: vLLM's benchmark client failed (exit {proc.returncode}); its log: {log_path}\n"
            f"{log_tail(log_path)}"
        )
    return json.loads(out.read_text())


def level_record(
    result: dict[str, Any], c: Configuration, gamma: int, concurrency: int, memory: dict, client_log: Path
) -> Level:
    """vLLM's result for one level, in serve_bench.json's names; spec counters as AcceptanceCounts
    (per-position counts from vLLM's per-position rates x drafts; the verification steps from the
    output tokens; tau 1.0 when nothing was drafted)."""
    metrics = {ours: float(result.get(theirs, math.nan)) for ours, theirs in METRICS.items()}
    spec = None
    if c.method is not None:
        drafts = int(result.get("spec_decode_num_drafts", 0))
        accepted = int(result.get("spec_decode_accepted_tokens", 0))
        rates = list(result.get("spec_decode_per_position_acceptance_rates") or [])[:gamma]
        counts = AcceptanceCounts(
            gamma,
            drafts,
            int(result.get("spec_decode_draft_tokens", 0)),
            accepted,
            [round(r * drafts) for r in rates] + [0] * (gamma - len(rates)),
            verification_steps(result, accepted),
        )
        spec = counts.summary()
        if not drafts:
            spec.update(
                tau=1.0,
                tokens_per_step=1.0 if counts.num_steps else math.nan,
                draft_share=0.0,
                accept_per_pos=[0.0] * gamma,
                accept_cond_per_pos=[0.0] * gamma,
            )
        spec["acceptance_rate"] = counts.num_accepted / counts.num_draft_tokens if counts.num_draft_tokens else 0.0
    return Level(concurrency, metrics, spec, memory, str(client_log))


def verification_steps(result: dict[str, Any], accepted: int) -> int:
    """The target's verification steps over the measured requests, drafted or not: each request's
    first output token comes from prefill, each later step yields 1 + its accepted tokens, so
    steps = total_output_tokens - completed - accepted. Exact, except that tokens drafted and
    accepted past the ``max_tokens`` cut on a request's last step are counted by vLLM but not
    output: it can undercount by at most gamma steps per request. 0 (tokens per step unknown,
    NaN) when the client's result lacks the keys."""
    out, done = result.get("total_output_tokens"), result.get("completed")
    if out is None or done is None or any(isinstance(x, float) and math.isnan(x) for x in (out, done)):
        return 0
    return max(int(out) - int(done) - accepted, 0)


# --- the benchmark -----------------------------------------------------------------------------


@dataclass
class BenchSetup:
    """What every server and client of one benchmark share."""

    target: Path
    traffic: Path
    templated: bool
    num_requests: int
    max_model_len: int
    gamma: int
    dtype: str
    seed: int
    engine_kwargs: dict[str, Any]
    kvcache_gib: int
    gpu: bool

    def conditions(self, cfg: RunConfig) -> dict[str, Any]:
        sb = cfg.serve_bench
        return {
            "target": cfg.target.name,
            "target_path": str(self.target),
            "gamma": self.gamma,
            "output_len": sb.output_len,
            "ignore_eos": sb.ignore_eos,
            "temperature": sb.temperature,
            "traffic": str(self.traffic),
            "traffic_sha256": file_sha256(self.traffic),
            "traffic_kind": "eval set" if self.templated else "traffic file",
            "num_requests": self.num_requests,
            "concurrency": list(sb.concurrency),
            "request_rate": sb.request_rate,
            "prefix_caching": sb.prefix_caching,
            "max_model_len": self.max_model_len,
            "dtype": self.dtype,
            "device": "cuda" if self.gpu else "cpu",
            # where the workers meet is no condition: each configuration's step has its own port
            "engine_kwargs": {k: v for k, v in self.engine_kwargs.items() if k not in RENDEZVOUS},
        }


def server_max_model_len(cfg: RunConfig, longest_prompt: int = 0, longest_answer: int = 0) -> int:
    """The server's window: serve_bench.max_model_len, eval.vllm_max_model_len, or the largest
    context bin (or longest prompt) + the answer + one draft block. Headless nodes pass no prompt
    length, so a prompt past the largest bin needs serve_bench.max_model_len on multi-node runs."""
    sb, e = cfg.serve_bench, cfg.eval
    if sb.max_model_len or e.vllm_max_model_len:
        return int(sb.max_model_len or e.vllm_max_model_len)
    return max(max(e.context_bins), longest_prompt) + (longest_answer or answer_len(cfg)) + e.gamma + 1


def answer_len(cfg: RunConfig) -> int:
    """Tokens per answer: serve_bench.output_len, or eval.max_new_tokens where it is null."""
    return cfg.serve_bench.output_len or cfg.eval.max_new_tokens


def bench_config(c: Configuration, s: BenchSetup, sb: ServeBenchConfig, out_dir: Path) -> ConfigResult:
    """One server, every concurrency level, stopped afterwards."""
    host = sb.host
    port = choose_port(host, sb.port)
    cmd = server_command(
        s.target,
        c,
        host=host,
        port=port,
        gamma=s.gamma,
        max_model_len=s.max_model_len,
        dtype=s.dtype,
        seed=s.seed,
        engine_kwargs=s.engine_kwargs,
        prefix_caching=sb.prefix_caching,
    )
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(s.kvcache_gib))
    what = f"serve_bench {c.label}"
    logs = out_dir / "logs"
    with running_server(
        cmd,
        host=host,
        port=port,
        log_path=logs / f"server_{c.name}.log",
        timeout_s=sb.start_timeout_s,
        env=env,
        what=what,
    ) as server:
        sampler = MemorySampler(server.proc.pid, gpu=s.gpu)
        result = ConfigResult(
            c.name,
            c.label,
            c.method,
            str(c.draft) if c.draft else None,
            str(server.log_path),
            round(server.start_s, 1),
            {},
        )
        try:
            sampler.take()  # the levels' peaks start here (loading is in the lifetime peak)
            for conc in sb.concurrency:
                out = logs / f"client_{c.name}_c{conc}.json"
                argv = client_argv(
                    server,
                    target=s.target,
                    traffic=s.traffic,
                    templated=s.templated,
                    concurrency=conc,
                    num_prompts=s.num_requests,
                    sb=sb,
                    seed=s.seed,
                )
                log.info("%s, concurrency %d: %d requests", what, conc, s.num_requests)
                raw = run_client(argv, out, timeout_s=sb.level_timeout_s, what=f"{what}, concurrency {conc}")
                if not raw.get("completed"):
                    raise RuntimeError(
                        f"{what}, concurrency {conc}: no request completed ({raw.get('first_errors')}); client log "
                        f"{out.with_suffix('.log')}, server log {server.log_path}"
                    )
                lv = level_record(raw, c, s.gamma, conc, sampler.take(), out.with_suffix(".log"))
                log.info(
                    "%s, concurrency %d: %.1f tokens/s, p95 ITL %.1f ms%s",
                    what,
                    conc,
                    lv.metrics["output_tokens_per_s"],
                    lv.metrics["itl_p95_ms"],
                    f", tok/step {lv.spec['tokens_per_step']:.3f}, tau {lv.spec['tau']:.3f}" if lv.spec else "",
                )
                result.levels.append(lv)
        finally:
            result.memory = sampler.stop()
    result.server_pids = server.pids
    return result


def speedups(configs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Output tokens/s of each configuration over no speculation's, per concurrency level."""
    base = next((c for c in configs if c["name"] == "none"), None)
    if base is None:
        return {}
    ref = {lv["concurrency"]: lv["metrics"]["output_tokens_per_s"] for lv in base["levels"]}
    out = {}
    for c in configs:
        if c["name"] == "none":
            continue
        out[c["name"]] = {
            str(lv["concurrency"]): lv["metrics"]["output_tokens_per_s"] / ref[lv["concurrency"]]
            for lv in c["levels"]
            if ref.get(lv["concurrency"])
        }
    return out


def assemble(conditions: dict[str, Any], configs: list[dict[str, Any]]) -> dict[str, Any]:
    """serve_bench.json: the conditions, every configuration's levels, and the speedups."""
    configs = sorted(configs, key=lambda c: ORDER.index(c["name"]) if c["name"] in ORDER else len(ORDER))
    return {"conditions": conditions, "configs": configs, "speedup_over_none": speedups(configs)}


def merged_configs(out_dir: Path, fp: str) -> list[dict[str, Any]]:
    """Every configuration measured under these conditions (``configs/<name>.json``): one
    invocation per configuration (a multi-node job) still makes one report."""
    found = []
    for path in sorted((out_dir / "configs").glob("*.json")):
        with contextlib.suppress(ValueError, OSError):
            rec = json.loads(path.read_text())
            if rec.get("fingerprint") == fp:
                found.append(rec["result"])
    return found


@dataclass
class BenchOutcome:
    json_path: Path
    markdown: Path
    plots: dict[str, Path]
    data: dict[str, Any]

    def summary_line(self) -> str:
        """The main job's closing line: tokens/s per configuration at each level, and the first
        level's tokens per target step over all steps (tau, over the drafted steps, beside it)."""
        levels = self.data["conditions"]["concurrency"]
        parts = []
        for c in self.data["configs"]:
            tps = {lv["concurrency"]: lv["metrics"]["output_tokens_per_s"] for lv in c["levels"]}
            spec = [lv["spec"] for lv in c["levels"] if lv.get("spec")]
            parts.append(
                f"{c['label']} {'/'.join(f'{tps[x]:.0f}' if x in tps else '-' for x in levels)}"
                + (
                    f" (tok/step {_fmt(spec[0].get('tokens_per_step'), 2)}, tau {_fmt(spec[0]['tau'], 2)})"
                    if spec
                    else ""
                )
            )
        return f"tokens/s at concurrency {'/'.join(map(str, levels))}: " + ", ".join(parts)


def run_serve_bench(cfg: RunConfig, heads: Any, target_dir: Path) -> BenchOutcome:
    """The stage: every configuration, every level; serve_bench.json, .md, plots, W&B."""
    import torch

    from eval.run import engine_kwargs

    cfg = load_config(cfg)
    sb, e = cfg.serve_bench, cfg.eval
    out_dir = Path(sb.out_dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    if sb.traffic_file:
        traffic = Path(sb.traffic_file).expanduser()
        rows, templated = load_traffic(traffic, need_output_tokens=sb.output_len is None), False
        longest = 0
    else:
        traffic, longest = eval_set_traffic(cfg, heads, out_dir)
        rows, templated = load_traffic(traffic), True
    configs = resolve_configs(cfg, target_dir, gpu=gpu)
    if not configs:
        raise ServeBenchError(
            f"serve_bench.configs={sb.configs}: nothing vLLM can serve here (on CPU 'ours' needs the dflash layout); "
            "add none or ngram"
        )
    setup = BenchSetup(
        target=target_dir,
        traffic=traffic,
        templated=templated,
        num_requests=sb.num_prompts or len(rows),
        max_model_len=server_max_model_len(
            cfg, longest, 0 if sb.output_len else max(int(r.get("output_tokens", 0)) for r in rows)
        ),
        gamma=e.gamma,
        dtype=cfg.target.dtype,
        seed=e.seed,
        engine_kwargs=engine_kwargs(cfg),
        kvcache_gib=e.vllm_cpu_kvcache_gib,
        gpu=gpu,
    )
    conditions = setup.conditions(cfg)
    fp = config_fingerprint(conditions)
    for c in configs:
        r = bench_config(c, setup, sb, out_dir)
        atomic_write_json(
            out_dir / "configs" / f"{c.name}.json", _nan_to_none({"fingerprint": fp, "result": asdict(r)}), indent=1
        )
    data = assemble(conditions, merged_configs(out_dir, fp))
    return write_outputs(cfg, data, out_dir)


# --- report ------------------------------------------------------------------------------------


def _fmt(x: Optional[float], digits: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.0f}%"


def _answers(c: dict[str, Any]) -> str:
    n = c["output_len"]
    return f"{n} output tokens each" if n is not None else "each request's own output_tokens"


def render_markdown(data: dict[str, Any], plots: dict[str, Path]) -> str:
    c = data["conditions"]
    lines = [
        "# Serving benchmark",
        "",
        f"{c['target']} (`{c['target_path']}`), {c['device']}, {c['dtype']}, gamma {c['gamma']}, "
        f"{c['num_requests']} requests per level from the {c['traffic_kind']} `{c['traffic']}`, "
        f"{_answers(c)}{' (EOS ignored)' if c['ignore_eos'] else ''}, temperature "
        f"{c['temperature']:g}, request rate {c['request_rate'] or 'unbounded'}; vLLM's OpenAI server and its "
        "`vllm bench serve` client.",
        "",
        "| config | conc. | out tok/s | req/s | TTFT p50/p95/p99 ms | TPOT p50/p95 ms | ITL p50/p95 ms "
        "| E2E p50/p95 ms | tok/step | tau (drafted steps) | drafted | accept pos 1 | peak mem GiB "
        "| speedup vs none |",
        "|" + "---|" * 14,
    ]
    sp = data["speedup_over_none"]
    for cf in data["configs"]:
        for lv in cf["levels"]:
            m, s, conc = lv["metrics"], lv.get("spec"), lv["concurrency"]
            mem = (
                lv["memory"]["peak_gpu_gib"]
                if lv["memory"].get("peak_gpu_gib") is not None
                else lv["memory"]["peak_rss_gib"]
            )
            x = sp.get(cf["name"], {}).get(str(conc))
            lines.append(
                f"| {cf['label']} | {conc} | {_fmt(m['output_tokens_per_s'])} | {_fmt(m['requests_per_s'], 2)} | "
                f"{_fmt(m['ttft_p50_ms'], 0)}/{_fmt(m['ttft_p95_ms'], 0)}/{_fmt(m['ttft_p99_ms'], 0)} | "
                f"{_fmt(m['tpot_p50_ms'])}/{_fmt(m['tpot_p95_ms'])} | "
                f"{_fmt(m['itl_p50_ms'])}/{_fmt(m['itl_p95_ms'])} | "
                f"{_fmt(m['e2el_p50_ms'], 0)}/{_fmt(m['e2el_p95_ms'], 0)} | "
                f"{_fmt(s.get('tokens_per_step'), 3) if s else '-'} | {_fmt(s['tau'], 3) if s else '-'} | "
                f"{_pct(s.get('draft_share')) if s else '-'} | "
                f"{_fmt(s['accept_per_pos'][0], 3) if s else '-'} | {_fmt(mem, 2)} | "
                f"{'1.00' if cf['name'] == 'none' else (_fmt(x, 2) + 'x' if x is not None else 'n/a')} |"
            )
    lines += [
        "",
        "tok/step: 1 + accepted / all verification steps, drafted or not (what a user pays for: target "
        "forwards); tau (drafted steps): 1 + accepted / drafts, over only the steps with a draft (vLLM's "
        "counter); drafted: the share of steps with a draft.",
        "",
        "peak mem: the server's process tree (RSS on CPU, GPU memory on GPUs) during the level.",
        "",
    ]
    lines += [f"![{name}]({p.name})" for name, p in plots.items()]
    lines += ["", "Servers (logs, start time):", ""]
    lines += [
        f"- {cf['label']}: `{cf['server_log']}`, healthy after {cf['server_start_s']:.0f}s" for cf in data["configs"]
    ]
    return "\n".join(lines) + "\n"


def write_plots(data: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    from matplotlib.figure import Figure

    c = data["conditions"]
    title = f"{c['target']}, {c['device']}, gamma={c['gamma']}, {_answers(c)}"
    plots = {}

    def line_plot(name: str, ylabel: str, series: dict[str, tuple[list[int], list[float]]], what: str) -> None:
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.set(xlabel="client concurrency", ylabel=ylabel, xscale="log", title=f"{what}\n{title}")
        ax.set_xticks(c["concurrency"], [str(x) for x in c["concurrency"]])
        ax.set_xticks([], minor=True)  # the log axis' own minor labels (3x10^0) beside ours
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        plots[name] = out_dir / f"{name}.png"
        fig.savefig(plots[name], dpi=120)

    def series(metric: str) -> dict[str, tuple[list[int], list[float]]]:
        return {
            cf["label"]: ([lv["concurrency"] for lv in cf["levels"]], [lv["metrics"][metric] for lv in cf["levels"]])
            for cf in data["configs"]
        }

    line_plot("tokens_per_s", "output tokens/s", series("output_tokens_per_s"), "Throughput vs concurrency")
    line_plot("itl_p95", "p95 inter-token latency (ms)", series("itl_p95_ms"), "p95 ITL vs concurrency")
    labels = {cf["name"]: cf["label"] for cf in data["configs"]}
    if data["speedup_over_none"]:
        line_plot(
            "speedup",
            "output tokens/s over no speculation",
            {labels[n]: ([int(k) for k in v], list(v.values())) for n, v in data["speedup_over_none"].items()},
            "Speedup over no speculation",
        )
    return plots


def wandb_scalars(data: dict[str, Any]) -> dict[str, float]:
    out = {}
    for cf in data["configs"]:
        for lv in cf["levels"]:
            key = f"serve_bench/{cf['name']}/c{lv['concurrency']}"
            out.update({f"{key}/{k}": v for k, v in lv["metrics"].items()})
            if lv.get("spec"):
                for k in SPEC_COLUMNS:
                    out[f"{key}/{k}"] = lv["spec"].get(k)
            out[f"{key}/peak_rss_gib"] = lv["memory"]["peak_rss_gib"]
            if lv["memory"].get("peak_gpu_gib") is not None:
                out[f"{key}/peak_gpu_gib"] = lv["memory"]["peak_gpu_gib"]
    for name, per in data["speedup_over_none"].items():
        out.update({f"serve_bench/{name}/c{k}/speedup_over_none": v for k, v in per.items()})
    return {k: float(v) for k, v in out.items() if v is not None and not math.isnan(float(v))}


SPEC_COLUMNS = ("tokens_per_step", "tau", "draft_share")
"""The acceptance figures of a level's spec in the W&B scalars and table: tokens per target step
over all steps (the headline), tau over the drafted steps, and the share of steps drafted."""
TABLE_COLUMNS = ["config", "concurrency", *METRICS, *SPEC_COLUMNS, "peak_rss_gib", "peak_gpu_gib"]


def table_rows(data: dict[str, Any]) -> list[list[Any]]:
    """The W&B table's rows, one per configuration and level, in :data:`TABLE_COLUMNS`' order."""
    return [
        [
            cf["label"],
            lv["concurrency"],
            *(lv["metrics"].get(k) for k in METRICS),
            *((lv.get("spec") or {}).get(k) for k in SPEC_COLUMNS),
            lv["memory"]["peak_rss_gib"],
            lv["memory"].get("peak_gpu_gib"),
        ]
        for cf in data["configs"]
        for lv in cf["levels"]
    ]


def write_outputs(cfg: Optional[RunConfig], data: dict[str, Any], out_dir: Path) -> BenchOutcome:
    """serve_bench.json, serve_bench.md, the plots; the W&B run (job type serve_bench) when on."""
    plots = write_plots(data, out_dir)
    json_path, md = out_dir / "serve_bench.json", out_dir / "serve_bench.md"
    atomic_write_json(json_path, _nan_to_none(data), indent=1)
    atomic_write_text(md, render_markdown(data, plots))
    if cfg is not None:
        from dspark.core.wandb_run import init_wandb

        run = init_wandb(cfg, out_dir, job_type="serve_bench")
        if run is not None:
            import wandb

            rows = table_rows(data)
            run.log(
                {
                    **wandb_scalars(data),
                    "serve_bench/table": wandb.Table(columns=TABLE_COLUMNS, data=rows),
                    **{f"serve_bench/plots/{n}": wandb.Image(str(p)) for n, p in plots.items()},
                }
            )
            run.finish()
    log.info("serve_bench: %s (+ %s, %s)", md, json_path.name, ", ".join(p.name for p in plots.values()))
    return BenchOutcome(json_path, md, plots, data)


# --- multi-node: the workers of nodes 1..n-1 ---------------------------------------------------


def run_headless(cfg: RunConfig, target_dir: Path) -> None:
    """Nodes 1..n-1 of a multi-node server: host this node's workers for the one configuration
    node 0 serves (``SERVE_BENCH=1 sbatch slurm/eval.sbatch``), with the same engine arguments."""
    from dspark.core.vllm_engine import run_headless_workers
    from eval.run import engine_kwargs, export_path

    sb, e = cfg.serve_bench, cfg.eval
    if len(sb.configs) != 1:
        raise ServeBenchError(
            f"serve_bench.headless=true: serve_bench.configs={sb.configs}, expected one configuration"
        )
    name = sb.configs[0]
    method = {"none": None, "ngram": "ngram"}.get(name, "dspark" if name == "ours" else name)
    draft = export_path(cfg, "dspark", method) if method in ("dspark", "dflash") else None
    deadline = time.time() + 3600
    while draft is not None and not (draft / "export.json").is_file():  # node 0 exports first
        if time.time() > deadline:
            raise ServeBenchError(f"{draft} did not appear within an hour; did node 0 fail?")
        time.sleep(10)
    c = Configuration(name, method, draft)
    kwargs = dict(
        model=str(target_dir),
        dtype=cfg.target.dtype,
        max_model_len=server_max_model_len(cfg),
        enforce_eager=True,
        seed=e.seed,
        speculative_config=speculative_config(c, e.gamma),
        **engine_kwargs(cfg),
    )
    run_headless_workers(kwargs)


# --- command -----------------------------------------------------------------------------------


def main() -> None:
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(f"python -m eval.serve_bench: {__doc__}")
        return
    import hydra
    from omegaconf import DictConfig

    import dspark.core.config  # noqa: F401
    from dspark.core.target import prepare_target

    @hydra.main(version_base="1.3", config_path="../conf", config_name="config")
    def _main(raw: DictConfig) -> None:
        with exit_on_user_error():
            cfg = load_config(raw)
            if cfg.serve_bench.headless:
                from dspark.core.target import resolve_target

                target = resolve_target(cfg.target, cache_dir=Path(cfg.paths.cache_dir).expanduser()).path
                run_headless(cfg, target)
                return
            heads, target_dir = prepare_target(cfg)
            outcome = run_serve_bench(cfg, heads, target_dir)
            print(f"serve_bench: {outcome.summary_line()}\nreport {outcome.markdown}")

    _main()


if __name__ == "__main__":
    main()
