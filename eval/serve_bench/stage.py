"""Serving A/B benchmark (issue #15): what a drafter does to a real vLLM server under load.

For each configuration in ``serve_bench.configs`` (``none``: no speculation; ``ngram``; ``ours``:
this run's export, served as ``dspark`` on GPUs and as the ``dflash`` layout on CPU, as the eval
does; ``llama.cpp-none``, ``llama.cpp-ngram``, ``llama.cpp-dspark``, ``llama.cpp-ngram-then-dspark``:
llama.cpp's ``llama-server`` with the eval's target GGUF and this run's drafter GGUF, one slot per
concurrent request, its counters read from its ``/metrics`` around each level and its warm-ups sent
outside them, speedups over ``llama.cpp-none``) a real OpenAI-compatible server (``python -m
vllm.entrypoints.openai.api_server``, the eval's engine arguments; or llama-server) is started
on a free port, waited for (``/health``) and always stopped;
vLLM's own benchmark client (``vllm bench serve``, through :mod:`eval.serve_bench.client`) drives it at
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
    python train.py +experiment=... stages=[extract,train,export,eval,serve_bench]  # as a stage of the main job

Keys (``serve_bench.KEY=VALUE``; types and defaults: dspark/config/serve_bench.py, ServeBenchConfig):
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
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from dspark.config import RunConfig, ServeBenchConfig, config_fingerprint, load_config
from dspark.core.atomic_files import atomic_write_json
from dspark.core.errors import CONF_DIR, exit_on_user_error, run_hydra_command, task_started
from dspark.core.file_reads import file_sha256
from dspark.export.stage import export_path, wait_for_export
from dspark.serving.llama_cpp.server import Counters, complete, counters_after, llama_server, read_counters, server_spec
from dspark.serving.methods import (
    BY_NAME,
    OURS,
    export_method,
    llama_cpp_method,
    speculative_config,
)
from dspark.serving.server_lifecycle import Server
from dspark.serving.vllm_engine import run_headless_workers
from dspark.target import prepare_target, resolve_target
from eval.acceptance import TAU, TOKENS_PER_STEP
from eval.engine_args import engine_kwargs, engine_window
from eval.out_dir import claim_out_dir, make_out_dir
from eval.results import nan_to_none
from eval.serve_bench.client import NEW_CONNECTION_PER_REQUEST, Level, client_argv, level_record, run_client
from eval.serve_bench.configs import (
    ServeBenchError,
    answer_len,
    eval_set_traffic,
    load_traffic,
    resolve_configs,
    serves_exports,
)
from eval.serve_bench.report import BenchOutcome, assemble, merged_configs, write_outputs
from eval.serve_bench.server import (
    START_TIMEOUT_SETTING,
    Configuration,
    MemorySampler,
    choose_port,
    running_server,
    server_command,
)

log = logging.getLogger(__name__)

RENDEZVOUS = ("master_addr", "master_port", "node_rank")
"""Multi-node engine arguments left out of the conditions, so the configurations of one job
(one srun step and rendezvous port each) make one report."""


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
    llama_cpp: Optional[tuple[Any, Path]] = None
    """(the llama.cpp build, the target GGUF) when a configuration is llama.cpp's."""
    llama_cpp_threads: int = 0
    p_min: Optional[float] = None
    warmup_prompt: str = ""
    """What a llama.cpp level's warm-ups send (the traffic's first prompt) for ``warmup_tokens``."""
    warmup_tokens: int = 16

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
            **(
                {
                    "llama_cpp_target": str(self.llama_cpp[1]),
                    "llama_cpp_draft_type": cfg.eval.llama_cpp_draft_type,
                    "llama_cpp_threads": self.llama_cpp_threads,
                    "p_min": self.p_min,
                }
                if self.llama_cpp
                else {}
            ),
        }


def server_max_model_len(cfg: RunConfig, longest_prompt: int = 0, longest_answer: int = 0) -> int:
    """The server's window: serve_bench.max_model_len, eval.vllm_max_model_len, or the largest
    context bin (or longest prompt) + the answer + one draft block. Headless nodes pass no prompt
    length, so a prompt past the largest bin needs serve_bench.max_model_len on multi-node runs."""
    sb, e = cfg.serve_bench, cfg.eval
    if sb.max_model_len or e.vllm_max_model_len:
        return int(sb.max_model_len or e.vllm_max_model_len)
    return engine_window(max(max(e.context_bins), longest_prompt), longest_answer or answer_len(cfg), e.gamma)


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


def start_server(
    c: Configuration, s: BenchSetup, sb: ServeBenchConfig, log_path: Path, what: str
) -> contextlib.AbstractContextManager[Server]:
    """The configuration's server (vLLM's OpenAI server or llama-server) on a free port, healthy;
    stopped with its process tree on the way out."""
    host = sb.host
    port = choose_port(host, sb.port)
    if c.engine == "llama.cpp":
        tree, target_gguf = s.llama_cpp
        spec = server_spec(
            target_gguf,
            llama_cpp_method(c.name),
            s.gamma,
            s.max_model_len,
            draft_gguf=c.draft,
            threads=s.llama_cpp_threads,
            p_min=s.p_min,
            seed=s.seed,
            parallel=max(sb.concurrency),  # one slot per concurrent request, each with the whole window
            prompt_cache=sb.prefix_caching,
        )
        return llama_server(
            tree,
            spec,
            host=host,
            port=port,
            log_path=log_path,
            timeout_s=sb.start_timeout_s,
            what=what,
            timeout_key=START_TIMEOUT_SETTING,
        )
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
    return running_server(
        cmd, host=host, port=port, log_path=log_path, timeout_s=sb.start_timeout_s, env=env, what=what
    )


def llama_cpp_level_fields(d: Counters, raw: dict[str, Any], speculative: bool) -> dict[str, Any]:
    """llama-server's counters over one level, folded into vLLM's client result (``raw``) so that
    :func:`~eval.serve_bench.client.level_record` counts llama.cpp's levels as vLLM's.

    The output tokens are the server's own count (``tokens_predicted_total``). vLLM's client reads a
    streamed completion's ``usage`` only from a chunk without ``choices``, and llama-server's
    /v1/completions puts ``usage`` in its last chunk beside ``choices``: the client then counts the
    output by re-tokenizing the text, which merges tokens across the boundaries the target generated
    and undercounts (so steps came out short and drafts above 100 % of them). The client's count is
    kept as ``client_output_tokens``; the throughputs and TPOTs it derived from it are rescaled to the
    server's count (TPOT over the whole level's decode tokens, not per request). Speculative levels
    also get the draft counters in the names vLLM's server gives them (``vllm:spec_decode_*``).
    Raises when the counters contradict each other (more drafts than verification steps)."""
    out: dict[str, Any] = {"server_decodes": d.decodes}
    client_tokens, done = raw.get("total_output_tokens"), int(raw.get("completed") or 0)
    if d.predicted and client_tokens:
        out["client_output_tokens"] = client_tokens
        out["total_output_tokens"] = d.predicted
        scale = d.predicted / client_tokens
        for k in ("output_throughput", "max_output_tokens_per_s"):
            if isinstance(raw.get(k), (int, float)):
                out[k] = raw[k] * scale
        if isinstance(raw.get("duration"), (int, float)) and raw["duration"] > 0:
            out["total_token_throughput"] = (float(raw.get("total_input_tokens") or 0) + d.predicted) / raw["duration"]
        if client_tokens > done and d.predicted > done:
            per_token = (client_tokens - done) / (d.predicted - done)
            for k in [k for k in raw if k.endswith("_tpot_ms")]:
                if isinstance(raw[k], (int, float)):
                    out[k] = raw[k] * per_token
    if speculative:
        steps = d.predicted - done - d.accepted
        if d.predicted and d.drafts > steps + done:  # a stop may cut up to one step per request
            raise RuntimeError(
                f"llama.cpp counted {d.drafts} drafts in {steps} verification steps ({d.predicted} tokens "
                f"generated, {done} requests, {d.accepted} accepted): the counters disagree"
            )
        out.update(
            spec_decode_num_drafts=d.drafts,
            spec_decode_draft_tokens=d.draft_tokens,
            spec_decode_accepted_tokens=d.accepted,
            spec_decode_per_position_acceptance_rates=[a / d.drafts if d.drafts else 0.0 for a in d.accepted_per_pos],
        )
    return out


def bench_config(c: Configuration, s: BenchSetup, sb: ServeBenchConfig, out_dir: Path) -> ConfigResult:
    """One server, every concurrency level, stopped afterwards."""
    what = f"serve_bench {c.label}"
    logs = out_dir / "logs"
    llama = c.engine == "llama.cpp"
    with start_server(c, s, sb, logs / f"server_{c.name}.log", what) as server:
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
                if llama:  # llama-server's counters are read here, so the warm-ups are sent here, outside them
                    argv[argv.index("--num-warmups") + 1] = "0"
                    argv.insert(0, NEW_CONNECTION_PER_REQUEST)  # it closes a kept-alive connection after a stream
                    for _ in range(sb.num_warmups):
                        warm = read_counters(server)
                        done = complete(
                            server, s.warmup_prompt, n_predict=s.warmup_tokens, temperature=sb.temperature, seed=s.seed
                        )
                        counters_after(server, warm, len(done.tokens))  # folded in before `before` is read
                    before = read_counters(server)
                raw = run_client(argv, out, timeout_s=sb.level_timeout_s, what=f"{what}, concurrency {conc}")
                if llama:
                    done = counters_after(server, before, int(raw.get("total_output_tokens") or 0))
                    raw.update(llama_cpp_level_fields(done, raw, c.method is not None))
                if not raw.get("completed") or raw.get("failed"):  # a level short of requests is not comparable
                    raise RuntimeError(
                        f"{what}, concurrency {conc}: {raw.get('failed') or 'every'} of {s.num_requests} requests "
                        f"failed ({raw.get('first_errors')}); client log {out.with_suffix('.log')}, server log "
                        f"{server.log_path}"
                    )
                lv = level_record(raw, c, s.gamma, conc, sampler.take(), out.with_suffix(".log"))
                log.info(
                    "%s, concurrency %d: %.1f tokens/s, p95 ITL %.1f ms%s",
                    what,
                    conc,
                    lv.metrics["output_tokens_per_s"],
                    lv.metrics["itl_p95_ms"],
                    f", tok/step {lv.spec[TOKENS_PER_STEP.name]:.3f}, tau {lv.spec[TAU.name]:.3f}" if lv.spec else "",
                )
                result.levels.append(lv)
        finally:
            result.memory = sampler.stop()
    result.server_pids = server.pids
    return result


def run_serve_bench(cfg: RunConfig, heads: Any, target_dir: Path) -> BenchOutcome:
    """The stage: every configuration, every level; serve_bench.json, .md, plots, W&B."""
    cfg = load_config(cfg)
    sb, e = cfg.serve_bench, cfg.eval
    out_dir = Path(sb.out_dir).expanduser()
    earlier = ("serve_bench.json", "configs")
    claim_out_dir(out_dir, key="serve_bench.out_dir", stage="serving benchmark", earlier=earlier)
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
    make_out_dir(out_dir)
    llama = None
    if any(c.engine == "llama.cpp" for c in configs):
        from dspark.serving.llama_cpp.build import ensure_built
        from eval.llama_cpp_rows import target_gguf_for

        tree = ensure_built()
        llama = (tree, target_gguf_for(cfg, tree, target_dir))
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
        llama_cpp=llama,
        llama_cpp_threads=e.llama_cpp_threads,
        p_min=e.confidence_threshold,
        warmup_prompt=str(rows[0]["prompt"]),
        warmup_tokens=int(sb.output_len or rows[0].get("output_tokens") or 16),
    )
    conditions = setup.conditions(cfg)
    fp = config_fingerprint(conditions)
    for c in configs:
        r = bench_config(c, setup, sb, out_dir)
        atomic_write_json(
            out_dir / "configs" / f"{c.name}.json", nan_to_none({"fingerprint": fp, "result": asdict(r)}), indent=1
        )
    data = assemble(conditions, merged_configs(out_dir, fp))
    return write_outputs(cfg, data, out_dir)


# --- multi-node: the workers of nodes 1..n-1 ---------------------------------------------------


def run_headless(cfg: RunConfig, target_dir: Path) -> None:
    """Nodes 1..n-1 of a multi-node server: host this node's workers for the one configuration
    node 0 serves (``SERVE_BENCH=1 sbatch slurm/eval.sbatch``), with the same engine arguments."""
    sb, e = cfg.serve_bench, cfg.eval
    if len(sb.configs) != 1:
        raise ServeBenchError(
            f"serve_bench.headless=true: serve_bench.configs={sb.configs}, expected one configuration"
        )
    name = sb.configs[0]
    # multi-node engines run on GPUs, where every drafter has the layout ours is served in
    m = export_method(gpu=True, has_layout=lambda x: True) if name == OURS else BY_NAME[name]
    draft = export_path(cfg, "ours", m.layout) if m.layout is not None else None
    if draft is not None:
        wait_for_export(draft)  # node 0 exports first
    c = Configuration.serving(name, m, draft)
    kwargs = dict(
        model=str(target_dir),
        dtype=cfg.target.dtype,
        max_model_len=server_max_model_len(cfg),
        enforce_eager=True,
        seed=e.seed,
        speculative_config=speculative_config(c.method, c.draft, e.gamma),
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

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def _main(raw: DictConfig) -> None:
        task_started()
        with exit_on_user_error():
            cfg = load_config(raw)
            if cfg.serve_bench.headless:
                target = resolve_target(cfg.target, cache_dir=Path(cfg.paths.cache_dir).expanduser()).path
                run_headless(cfg, target)
                return
            heads, target_dir = prepare_target(cfg)
            if serves_exports(cfg):  # as train.py does: the export stage first, a no-op when up to date
                from dspark.export.stage import run_export

                run_export(cfg, target_dir)
            outcome = run_serve_bench(cfg, heads, target_dir)
            print(f"serve_bench: {outcome.summary_line()}\nreport {outcome.markdown}")

    run_hydra_command(_main)
