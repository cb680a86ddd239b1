"""The ``serve_bench`` keys: the serving A/B benchmark (``python -m eval.serve_bench``, or
``stages=[...,serve_bench]``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import II

from dspark.config.checks import _at_least, _check, _choice
from dspark.serving.methods import BENCH_CONFIGS


@dataclass
class ServeBenchConfig:
    """The serving A/B benchmark (``eval.serve_bench``, issue #15): a real vLLM OpenAI server per
    configuration, driven by vLLM's own benchmark client at each concurrency level."""

    configs: list[str] = field(default_factory=lambda: ["none", "ngram", "ours"])
    """none: no speculation; ngram: vLLM's free baseline; ours: this run's export, served as
    ``dspark`` on GPUs and as the ``dflash`` layout on CPU (where the drafter has it), as the
    eval does; dspark / dflash: that method explicitly; llama.cpp-none, llama.cpp-ngram,
    llama.cpp-dspark, llama.cpp-ngram-then-dspark: llama.cpp's llama-server (CPU machines where
    scripts/setup.sh built it), its speedups over llama.cpp-none."""
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4])
    """Client concurrency levels (vLLM bench --max-concurrency); GPU presets: 1 to 64."""
    request_rate: Optional[float] = None
    """Requests per second (a Poisson process); None: all at once, bounded by the concurrency."""
    num_prompts: Optional[int] = None
    """Requests per level; None: every prompt of the traffic once (at least 2 x the concurrency)."""
    output_len: Optional[int] = II("eval.max_new_tokens")
    """Tokens per answer; every configuration generates exactly this many (EOS ignored). null:
    each request's own ``output_tokens`` (a traffic file's; then required on every line)."""
    ignore_eos: bool = True
    temperature: float = II("eval.temperature")
    traffic_file: Optional[str] = None
    """Your own traffic: JSONL, one ``{"prompt": "...", "output_tokens": N}`` per line (vLLM's
    custom dataset; output_tokens optional), the chat template applied by the client. None:
    the eval set (eval.prompts_file or the one built per context bin), templated already."""
    max_model_len: Optional[int] = None
    """The server's window; None: as the eval's engines (the largest bin + answer + a block)."""
    num_warmups: int = 1
    """Requests sent before each level, outside its figures and its spec-decode counters."""
    prefix_caching: bool = False
    """vLLM's automatic prefix caching on the servers. Off: every level sends the same prompts,
    and with a cache each level after the first (and every request the warm-up repeats) would
    skip its prefill, so TTFT and tokens/s would not compare across levels. On: your traffic's
    own prefix reuse, measured from the second level on."""
    host: str = "127.0.0.1"
    port: int = 0
    """0: a free port picked per server; a port in use is refused, never reused."""
    start_timeout_s: int = 900
    """A server not healthy by then is stopped and reported with its log."""
    level_timeout_s: int = 3600
    """One concurrency level's client run, at most."""
    out_dir: str = "${eval.out_dir}/serve_bench"
    headless: bool = False
    """Nodes 1..n-1 of a multi-node server (``SERVE_BENCH=1 sbatch slurm/eval.sbatch``): host this node's workers
    for the one configuration in ``configs`` that node 0 serves."""

    def __post_init__(self) -> None:
        _check(bool(self.configs), "serve_bench.configs", self.configs, "expected a non-empty list")
        for c in self.configs:
            _choice("serve_bench.configs[]", c, BENCH_CONFIGS)
        _check(
            bool(self.concurrency) and all(c >= 1 for c in self.concurrency),
            "serve_bench.concurrency",
            self.concurrency,
            "expected a non-empty list of levels >= 1",
        )
        if self.request_rate is not None:
            _check(self.request_rate > 0, "serve_bench.request_rate", self.request_rate, "expected > 0, or null")
        if self.num_prompts is not None:
            _at_least("serve_bench.num_prompts", self.num_prompts, 1)
        if self.output_len is not None:
            _at_least("serve_bench.output_len", self.output_len, 1)
        for key in ("start_timeout_s", "level_timeout_s"):
            _at_least(f"serve_bench.{key}", getattr(self, key), 1)
        _at_least("serve_bench.num_warmups", self.num_warmups, 0)
        _check(0 <= self.port <= 65535, "serve_bench.port", self.port, "expected 0 (pick a free one) or a TCP port")
