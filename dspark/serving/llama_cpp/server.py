"""llama.cpp's ``llama-server`` serving a target GGUF, with or without a drafter GGUF: its command
line, its counters and one completion, for the export check (one block drafted) and the eval's
llama.cpp rows alike. The server's life is :mod:`dspark.serving.server_lifecycle`' (the vLLM servers' too).

Counting, from llama.cpp b11434's own ``/metrics`` (``--metrics``; folded in when a request ends):

- ``llamacpp:spec_decode_num_drafts_total``: verification steps that carried a non-empty draft
  (vLLM's rule: a step without a proposal is a step, not a draft);
- ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
  ``..._num_accepted_tokens_per_pos_total{position="k"}`` (drafts with at least k+1 accepted);
- ``llamacpp:n_decode_total``: every target ``llama_decode`` call, the prompt's chunks
  (``ceil(prompt / n_batch)``) included. At one request at a time, decode-phase target forwards =
  its delta minus the prompt's chunks: the steps, drafted or not. ``generated - 1 - accepted`` is
  kept beside it as the check :func:`steps_problem` makes, as ``eval.vllm_rows`` does for vLLM.

A speculative set-up error does not stop llama-server (it logs ``failed to initialize
speculative decoding context`` and serves without speculation), so :func:`speculation_problem`
reads the log for the proposers llama.cpp actually added.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from dspark.serving.layouts import layout_named
from dspark.serving.llama_cpp.build import LlamaCpp
from dspark.serving.methods import LLAMA_CPP_NGRAM, LLAMA_CPP_NGRAM_N, LlamaCppMethod
from dspark.serving.server_lifecycle import Server, ServerError, running_server

PREFIX = "llamacpp:"
DRAFTS, DRAFT_TOKENS, ACCEPTED = (
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)
PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"
DECODES = "n_decode_total"
PREDICTED = "tokens_predicted_total"
PROCESSING = "requests_processing"
N_BATCH = 2048
"""``-b``: a prompt is decoded in chunks of this many tokens (each one ``n_decode``)."""
TRACE = 4
"""``-lv``: the level at which llama-server logs each proposer's statistics after every request
(:func:`proposer_stats`)."""


@dataclass(frozen=True)
class ServerSpec:
    """One llama-server: the target GGUF served with one method."""

    target_gguf: Path
    method: LlamaCppMethod
    gamma: int
    ctx: int
    draft_gguf: Optional[Path] = None
    threads: int = 0
    """``-t``; 0: every core of this machine."""
    p_min: Optional[float] = None
    """``--spec-draft-p-min``: a DSpark block ends at the first position its confidence head puts below."""
    seed: int = 0
    parallel: int = 1
    """``-np``: slots, each with a window of ``ctx`` (the serving benchmark's concurrency)."""
    prompt_cache: bool = True
    """False: ``--no-cache-prompt`` (the serving benchmark sends the same prompts at every level)."""
    kv_cache_type: Optional[str] = None
    """``-ctk/-ctv`` and the drafter's ``-ctkd/-ctvd``: None is llama.cpp's default (f16);
    :func:`server_spec` sets f32 for an f32 target."""
    slot_dir: Optional[Path] = None
    """``--slot-save-path``: where slots are saved and restored (:func:`slot_action`), so servers
    share a prompt's prefill; the RAM prompt cache is then off (``--cache-ram 0``), so a restored
    slot is the only cache a request finds."""

    def command(self, tree: LlamaCpp, *, host: str, port: int) -> list[str]:
        threads = str(self.threads or os.cpu_count() or 1)
        cmd = [
            str(tree.server),
            "-m",
            str(self.target_gguf),
            "--host",
            host,
            "--port",
            str(port),
            "-np",
            str(self.parallel),
            "-c",
            str(self.ctx * self.parallel),
            "-b",
            str(N_BATCH),
            "-t",
            threads,
            "--seed",
            str(self.seed),
            "--metrics",
            "--no-webui",
            # no SSE pings: llama-server sends ":\n\n" every 30 s of a long prefill, and vLLM 0.32's
            # benchmark client (which strips each chunk before splitting on blank lines) then reads
            # the whole stream as one comment and fails the request (the 7k-token prompts did)
            "--sse-ping-interval",
            "-1",
            "-lv",
            str(TRACE),
        ]
        if not self.prompt_cache:
            cmd.append("--no-cache-prompt")
        if self.slot_dir is not None:
            cmd += ["--slot-save-path", str(self.slot_dir), "--cache-ram", "0"]
        if self.kv_cache_type is not None:
            cmd += ["-ctk", self.kv_cache_type, "-ctv", self.kv_cache_type]
        if not self.method.spec_types:
            return cmd
        cmd += ["--spec-type", ",".join(self.method.spec_types), "--spec-draft-n-max", str(self.gamma)]
        if LLAMA_CPP_NGRAM in self.method.spec_types:
            cmd += [
                "--spec-ngram-simple-size-n",
                str(LLAMA_CPP_NGRAM_N),
                "--spec-ngram-simple-size-m",
                str(self.gamma),
            ]
        if self.method.layout is not None:
            if self.draft_gguf is None:
                raise ValueError(f"llama.cpp {self.method.name} needs a drafter GGUF")
            cmd += ["-md", str(self.draft_gguf), "-td", threads]
            if self.kv_cache_type is not None:
                cmd += ["-ctkd", self.kv_cache_type, "-ctvd", self.kv_cache_type]
            if self.p_min is not None and layout_named(self.method.layout).confidence_head:
                cmd += ["--spec-draft-p-min", str(self.p_min)]
        return cmd


ALL_F32 = 0
"""GGUF ``general.file_type`` of a file whose weights are all f32 (gguf-py's ``LlamaFileType.ALL_F32``)."""


def kv_cache_type_for(target_gguf: Path) -> Optional[str]:
    """f32 for an f32 target (its ``general.file_type``), so that llama.cpp's target and drafter
    caches keep the reference loop's numerics and a parity table compares f32 with f32 (issue #49:
    llama.cpp's default f16 cache moved logits by more than a near-tie's margin); None otherwise."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(target_gguf)).fields.get("general.file_type")
    except (OSError, ValueError):  # not a GGUF gguf-py reads: llama-server says why, naming its log
        return None
    return "f32" if field is not None and int(field.contents()) == ALL_F32 else None


def server_spec(target_gguf: Path, method: LlamaCppMethod, gamma: int, ctx: int, **settings: Any) -> ServerSpec:
    """The one place a llama-server's flags are decided from (method, layout, settings), for the
    export check, the eval's rows and the serving benchmark alike: ``settings`` are
    :class:`ServerSpec`'s fields; the caches follow the target's weights (:func:`kv_cache_type_for`)
    and ``p_min`` reaches only a drafter with a confidence head (:meth:`ServerSpec.command`)."""
    settings.setdefault("kv_cache_type", kv_cache_type_for(target_gguf))
    return ServerSpec(target_gguf, method, gamma, ctx, **settings)


@contextlib.contextmanager
def llama_server(
    tree: LlamaCpp,
    spec: ServerSpec,
    *,
    host: str,
    port: int,
    log_path: Path,
    timeout_s: float,
    what: str,
    timeout_key: str,
) -> Iterator[Server]:
    """The server, healthy and speculating as asked (:func:`speculation_problem`); stopped on the
    way out with its whole process tree."""
    cmd = spec.command(tree, host=host, port=port)
    env = {**os.environ, "LD_LIBRARY_PATH": str(tree.bin_dir)}
    with running_server(
        cmd,
        host=host,
        port=port,
        log_path=log_path,
        timeout_s=timeout_s,
        env=env,
        what=what,
        engine="llama.cpp",
        timeout_key=timeout_key,
    ) as server:
        problem = speculation_problem(log_path, spec.method)
        if problem:
            raise ServerError(f"{what}: {problem}; its log: {log_path}")
        yield server


def speculation_problem(log_path: Path, method: LlamaCppMethod) -> Optional[str]:
    """None when llama-server's log says it added every proposer of ``method``; else what it said."""
    text = Path(log_path).read_text(errors="replace")
    failed = re.search(r"failed to initialize speculative decoding context[^\n]*", text)
    if failed:
        return f"llama.cpp could not set up {','.join(method.spec_types)}: {failed.group(0).strip()}"
    added = set(re.findall(r"adding speculative implementation '([\w-]+)'", text))
    missing = [t for t in method.spec_types if t not in added]
    if missing:
        return f"llama.cpp did not add the proposer(s) {missing} (it added {sorted(added) or 'none'})"
    return None


# --- requests ------------------------------------------------------------------------------------


def _post(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ServerError(f"POST {url}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}") from None


@dataclass
class Completion:
    tokens: list[int]
    """Generated token ids (an end-of-generation token included, as vLLM's outputs include it)."""
    timings: dict[str, Any]
    """llama.cpp's: predicted_n, predicted_ms (decode, the first token's prefill excluded), prompt_ms..."""

    @property
    def decode_tokens_per_s(self) -> float:
        n, ms = self.timings.get("predicted_n", 0), self.timings.get("predicted_ms", 0.0)
        return (n - 1) / (ms / 1e3) if n > 1 and ms else float("nan")


def complete(
    server: Server,
    prompt_ids: list[int] | str,
    *,
    n_predict: int,
    temperature: float,
    seed: int,
    timeout_s: float = 3600,
    cache_prompt: bool = False,
) -> Completion:
    """One completion of ``prompt_ids`` (used as given: no BOS added; or a text). ``cache_prompt``:
    reuse what the slot holds of the prompt (a restored prefix, :func:`slot_action`), processing
    only the rest (``timings.cache_n`` reused, ``timings.prompt_n`` processed); off, the whole
    prompt is processed."""
    body = {
        "prompt": prompt_ids if isinstance(prompt_ids, str) else list(prompt_ids),
        "n_predict": n_predict,
        "temperature": temperature,
        "seed": seed,
        "cache_prompt": cache_prompt,
        "return_tokens": True,
    }
    out = _post(f"{server.url}/completion", body, timeout_s)
    return Completion([int(t) for t in out.get("tokens") or []], dict(out.get("timings") or {}))


def slot_action(server: Server, action: str, filename: Optional[str] = None, timeout_s: float = 600) -> dict[str, Any]:
    """``POST /slots/0?action=save|restore|erase`` (a server started with ``slot_dir``): save writes
    the target's cache of slot 0 and its tokens to ``slot_dir/filename`` (``n_saved``), restore
    reads them back (``n_restored``), erase clears the slot in the target and the drafter alike.
    Only the target's cache is saved: a drafter rebuilds its own from the tokens processed after a
    restore, so a restore must follow an erase (the drafter's cache must hold consecutive
    positions: llama.cpp b11434 fails the next request otherwise)."""
    body = {} if filename is None else {"filename": filename}
    return _post(f"{server.url}/slots/0?action={action}", body, timeout_s)


N_UBATCH = 512
"""``-ub`` (llama-server's default): a prefill's chunks of ``-b`` tokens run in micro-batches of this
many, so a prefix of a multiple of it leaves the rest of the prompt in the micro-batches a whole
prefill has: a restored prefix and its tail compute what one prefill computes."""


def shared_prefix_len(prompt_len: int, window: Optional[int]) -> int:
    """How much of a prompt servers can share through a saved slot: the largest multiple of
    :data:`N_UBATCH` that leaves at least ``window + 1`` tokens to process, so a drafter with that
    sliding window rebuilds everything its first block reads from the tail (0: nothing shared;
    ``window`` None: a drafter that attends to the whole context, which shares nothing)."""
    if window is None:
        return 0
    return max((prompt_len - (window + 1)) // N_UBATCH * N_UBATCH, 0)


def next_token_logprobs(
    server: Server, prompt_ids: list[int], *, n_probs: int, timeout_s: float = 3600
) -> dict[int, float]:
    """llama.cpp's own log-probabilities of its top ``n_probs`` next tokens after ``prompt_ids``: a
    softmax of the target's raw logits, before any sampler (``post_sampling_probs`` off). The
    prompt cache is on, so a caller that walks a text one token at a time decodes one token a call
    (teacher forcing: ``benchmarks/parity_margins.py``)."""
    body = {
        "prompt": list(prompt_ids),
        "n_predict": 1,
        "n_probs": n_probs,
        "temperature": 0.0,
        "cache_prompt": True,
        "post_sampling_probs": False,
    }
    out = _post(f"{server.url}/completion", body, timeout_s)
    top = out["completion_probabilities"][0]["top_logprobs"]
    return {int(t["id"]): float(t["logprob"]) for t in top}


@dataclass
class Counters:
    """llama-server's cumulative counters (see the module's docstring)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    decodes: int = 0
    predicted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    processing: int = 0
    """Requests in flight (a gauge, not a count: :meth:`minus` keeps the later reading's)."""

    def minus(self, before: Counters) -> Counters:
        n = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        pad = lambda v: v + [0] * (n - len(v))  # noqa: E731
        return Counters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            self.decodes - before.decodes,
            self.predicted - before.predicted,
            [a - b for a, b in zip(pad(self.accepted_per_pos), pad(before.accepted_per_pos))],
            self.processing,
        )


def read_counters(server: Server, timeout_s: float = 30) -> Counters:
    """``GET /metrics``, parsed (Prometheus text)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    c, per_pos = Counters(), {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels[len(PREFIX) :].partition("{")
        v = int(float(value)) if math.isfinite(float(value)) else 0
        if name == DRAFTS:
            c.drafts = v
        elif name == DRAFT_TOKENS:
            c.draft_tokens = v
        elif name == ACCEPTED:
            c.accepted = v
        elif name == DECODES:
            c.decodes = v
        elif name == PREDICTED:
            c.predicted = v
        elif name == PROCESSING:
            c.processing = v
        elif name == PER_POS:
            m = re.search(r'position="(\d+)"', labels)
            if m:
                per_pos[int(m.group(1))] = v
    c.accepted_per_pos = [per_pos.get(k, 0) for k in range(max(per_pos) + 1)] if per_pos else []
    return c


def counters_after(server: Server, before: Counters, num_generated: int, wait_s: float = 10.0) -> Counters:
    """The counters a request added since ``before``. llama-server folds a request's figures in as
    its slot is released, which may trail the response: wait until no request is in flight and
    at least ``num_generated`` tokens show (a lower bound where the caller's count is not exact)."""
    deadline = time.monotonic() + wait_s
    while True:
        d = read_counters(server).minus(before)
        if (d.predicted >= num_generated and not d.processing) or time.monotonic() > deadline:
            return d
        time.sleep(0.05)


def prompt_chunks(prompt_len: int) -> int:
    """The target decodes of a prompt's prefill (``-b`` tokens each): of the tokens it processed
    (``timings.prompt_n``), after what it reused."""
    return math.ceil(prompt_len / N_BATCH)


def steps_problem(steps: int, num_generated: int, num_accepted: int, gamma: int) -> Optional[str]:
    """None when the counted steps fit the output: each step after the first token gives 1 + its
    accepted tokens, so steps = generated - 1 - accepted, plus up to gamma accepted tokens a stop
    cut from the last step."""
    low = max(num_generated - 1 - num_accepted, 0)
    if low <= steps <= low + gamma:
        return None
    return (
        f"llama.cpp counted {steps} decode steps, the output says {low} to {low + gamma} ({num_generated} tokens, "
        f"{num_accepted} accepted): n_decode_total no longer counts one per step in this llama.cpp"
    )


_STATS = re.compile(
    r"statistics\s+([\w-]+): #calls\(b,g,a\) =\s*(\d+)\s+(\d+)\s+(\d+), #gen drafts =\s*(\d+), "
    r"#acc drafts =\s*(\d+), #gen tokens =\s*(\d+), #acc tokens =\s*(\d+)"
    r".*?dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms"
)


@dataclass
class ProposerStats:
    """One proposer's cumulative statistics, as llama-server logs them after each request (at
    ``-lv 4``): how many drafts it made and how long its drafting took (the ``g`` of ``dur(b,g,a)``:
    the draft pass itself; the drafter's intake of the target's states is not in it)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_ms: float = 0.0
    requests: int = 0
    """Its ``begin`` calls: one per request."""

    def minus(self, before: ProposerStats) -> ProposerStats:
        return ProposerStats(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted_tokens - before.accepted_tokens,
            self.draft_ms - before.draft_ms,
            self.requests - before.requests,
        )


def proposer_stats(log_path: Path) -> dict[str, ProposerStats]:
    """The last statistics each proposer logged (cumulative since the server started)."""
    out: dict[str, ProposerStats] = {}
    for m in _STATS.finditer(Path(log_path).read_text(errors="replace")):
        out[m.group(1)] = ProposerStats(
            int(m.group(5)), int(m.group(7)), int(m.group(8)), float(m.group(10)), int(m.group(2))
        )
    return out


def proposer_stats_after(
    log_path: Path, before: dict[str, ProposerStats], proposers: tuple[str, ...], wait_s: float = 10.0
) -> dict[str, ProposerStats]:
    """What one request added to each proposer's statistics. llama-server logs them as the slot is
    released, which may trail the response and its counters: wait until every one of
    ``proposers`` has logged one more request (at most ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        now = proposer_stats(log_path)
        later = all(now.get(k, ProposerStats()).requests > before.get(k, ProposerStats()).requests for k in proposers)
        if later or time.monotonic() > deadline:
            return {k: v.minus(before.get(k, ProposerStats())) for k, v in now.items()}
        time.sleep(0.05)
