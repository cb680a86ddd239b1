"""The serving benchmark's report: ``serve_bench.json`` (the conditions, every configuration's
levels, the speedups over no speculation, merged from the per-configuration records of one set of
conditions), ``serve_bench.md``, the plots (``tokens_per_s.png``, ``itl_p95.png``,
``speedup.png``) and the W&B run (job type serve_bench)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from matplotlib.figure import Figure

from dspark.config import RunConfig
from dspark.config.wandb_run import init_wandb
from dspark.core.atomic_files import atomic_write_json, atomic_write_text
from dspark.serving.methods import BENCH_CONFIGS, LLAMA_CPP_PREFIX
from eval.acceptance import ACCEPTANCE_METRICS, TAU, TOKENS_PER_STEP
from eval.report import fmt, metric_text
from eval.results import nan_to_none
from eval.serve_bench.client import METRICS

log = logging.getLogger(__name__)


# --- serve_bench.json ----------------------------------------------------------------------------


def baseline_of(name: str) -> str:
    """The configuration a configuration's speedup is over: no speculation on the same engine."""
    return LLAMA_CPP_PREFIX + "none" if name.startswith(LLAMA_CPP_PREFIX) else "none"


def speedups(configs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Output tokens/s of each configuration over no speculation's on the same engine (vLLM's
    ``none``, llama.cpp's ``llama.cpp-none``), per concurrency level."""
    by = {c["name"]: c for c in configs}
    out = {}
    for c in configs:
        base = by.get(baseline_of(c["name"]))
        if base is None or base is c:
            continue
        ref = {lv["concurrency"]: lv["metrics"]["output_tokens_per_s"] for lv in base["levels"]}
        out[c["name"]] = {
            str(lv["concurrency"]): lv["metrics"]["output_tokens_per_s"] / ref[lv["concurrency"]]
            for lv in c["levels"]
            if ref.get(lv["concurrency"])
        }
    return out


def assemble(conditions: dict[str, Any], configs: list[dict[str, Any]]) -> dict[str, Any]:
    """serve_bench.json: the conditions, every configuration's levels, and the speedups."""
    order = BENCH_CONFIGS
    configs = sorted(configs, key=lambda c: order.index(c["name"]) if c["name"] in order else len(order))
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
                    f" (tok/step {fmt(spec[0].get(TOKENS_PER_STEP.name), 2)}, tau {fmt(spec[0][TAU.name], 2)})"
                    if spec
                    else ""
                )
            )
        return f"tokens/s at concurrency {'/'.join(map(str, levels))}: " + ", ".join(parts)


# --- serve_bench.md, plots, W&B -------------------------------------------------------------------


def _answers(c: dict[str, Any]) -> str:
    n = c["output_len"]
    return f"{n} output tokens each" if n is not None else "each request's own output_tokens"


MARKDOWN_COLUMNS = [
    "config",
    "conc.",
    "out tok/s",
    "req/s",
    "TTFT p50/p95/p99 ms",
    "TPOT p50/p95 ms",
    "ITL p50/p95 ms",
    "E2E p50/p95 ms",
    *(a.serve_label for a in ACCEPTANCE_METRICS),
    "peak mem GiB",
    "speedup vs none",
]
"""serve_bench.md's columns: the client's figures, each of :data:`~eval.acceptance.ACCEPTANCE_METRICS`
(position 1 of a per-position one), the peak memory, the speedup."""


def render_markdown(data: dict[str, Any], plots: dict[str, Path]) -> str:
    c = data["conditions"]
    lines = [
        "# Serving benchmark",
        "",
        f"{c['target']} (`{c['target_path']}`), {c['device']}, {c['dtype']}, gamma {c['gamma']}, "
        f"{c['num_requests']} requests per level from the {c['traffic_kind']} `{c['traffic']}`, "
        f"{_answers(c)}{' (EOS ignored)' if c['ignore_eos'] else ''}, temperature "
        f"{c['temperature']:g}, request rate {c['request_rate'] or 'unbounded'}; vLLM's OpenAI server and its "
        "`vllm bench serve` client"
        + (
            f"; the llama.cpp rows: llama-server (target `{c['llama_cpp_target']}`, drafter GGUF "
            f"{c['llama_cpp_draft_type']}), the same client, its spec-decode counters from llama-server's /metrics, "
            "speedups over llama.cpp-none."
            if c.get("llama_cpp_target")
            else "."
        ),
        "",
        "| " + " | ".join(MARKDOWN_COLUMNS) + " |",
        "|" + "---|" * len(MARKDOWN_COLUMNS),
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
            speedup = "1.00" if cf["name"] == baseline_of(cf["name"]) else (fmt(x, 2) + "x" if x is not None else "n/a")
            lines.append(
                f"| {cf['label']} | {conc} | {fmt(m['output_tokens_per_s'], 1)} | {fmt(m['requests_per_s'], 2)} | "
                f"{fmt(m['ttft_p50_ms'], 0)}/{fmt(m['ttft_p95_ms'], 0)}/{fmt(m['ttft_p99_ms'], 0)} | "
                f"{fmt(m['tpot_p50_ms'], 1)}/{fmt(m['tpot_p95_ms'], 1)} | "
                f"{fmt(m['itl_p50_ms'], 1)}/{fmt(m['itl_p95_ms'], 1)} | "
                f"{fmt(m['e2el_p50_ms'], 0)}/{fmt(m['e2el_p95_ms'], 0)} | "
                + "".join(f"{metric_text(a, a.value(s)) if s else '-'} | " for a in ACCEPTANCE_METRICS)
                + f"{fmt(mem, 2)} | {speedup} |"
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


SPEC_COLUMNS = tuple(a.name for a in ACCEPTANCE_METRICS if not a.per_position)
"""The acceptance figures of a level's spec in the W&B scalars and table: each of
:data:`~eval.acceptance.ACCEPTANCE_METRICS` but the per-position ones (one number per cell): tokens
per target step over all steps (the headline), tau over the drafted steps, the share drafted."""
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
    atomic_write_json(json_path, nan_to_none(data), indent=1)
    atomic_write_text(md, render_markdown(data, plots))
    if cfg is not None:
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
