"""Turn an ``EvalResults`` into what people read: ``report.md`` and PNG plots
(:mod:`eval.report_plots`) beside ``results.json`` (:mod:`eval.results` writes and reads it), and
optionally the same figures on a W&B run (:mod:`eval.report_wandb`).

The headline of every method is tokens per target step over every verification step
(:mod:`eval.acceptance`), with vLLM's tau over the drafted steps and the share of drafted steps
beside it, and a 95 % bootstrap interval over prompts beside each tokens-per-step and pos-1
figure. A check whose interval crosses its line says "inside the noise" instead of pass or fail
(:mod:`eval.checks`). The speedup table is the model of :mod:`eval.results`.

Usage: ``python -m eval.report RESULTS_JSON --out DIR`` re-renders a report from a results.json.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from dspark.core.atomic_files import atomic_write_text
from eval.acceptance import ACCEPT_PER_POS, ACCEPTANCE_METRICS, TOKENS_PER_STEP, AcceptanceCounts, AcceptanceMetric
from eval.checks import interval_text, paired_interval
from eval.intervals import CONFIDENCE
from eval.report_plots import write_plots
from eval.report_wandb import log_to_wandb
from eval.results import (
    INSIDE_NOISE,
    Check,
    DrafterResult,
    EvalConditions,
    EvalResults,
    load_checks,
    load_results,
    results_json,
    speedup_table,
)

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

NA = "n/a"


@dataclass(frozen=True)
class ReportPaths:
    """Where ``write_report`` put its files; ``plots`` maps a plot name to its PNG."""

    json: Path
    markdown: Path
    plots: dict[str, Path]


def fmt(x: float | None, digits: int = 3) -> str:
    """A number for a table: ``digits`` decimals, "n/a" for None or NaN (a figure nothing measured)."""
    return NA if x is None or math.isnan(x) else f"{x:.{digits}f}"


def pct(x: float | None) -> str:
    """A share as a whole percentage, "n/a" for None or NaN."""
    return NA if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def metric_text(m: AcceptanceMetric, value: float | None) -> str:
    """A figure of :data:`~eval.acceptance.ACCEPTANCE_METRICS` for a table, in its own format."""
    return pct(value) if m.share else fmt(value)


# --- Markdown --------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _conditions_section(c: EvalConditions) -> list[str]:
    bins = ", ".join(f"{b} ({c.prompts_per_bin.get(str(b), 0)} prompts)" for b in c.context_bins)
    rows = [
        ["target", f"{c.target} (`{c.target_path}`)"],
        ["gamma", str(c.gamma)],
        ["temperature", f"{c.temperature:g}"],
        ["max_new_tokens", str(c.max_new_tokens)],
        ["prompt source", c.prompt_source],
        ["context bins", bins],
        ["checkpoint", f"`{c.checkpoint}`" if c.checkpoint else NA],
        ["export dir", f"`{c.export_dir}`" if c.export_dir else NA],
        ["dtype", c.dtype],
        ["device", c.device],
    ]
    rows += [[k, _cell(v)] for k, v in c.extra.items() if k not in OWN_TABLES]
    return ["## Conditions", ""] + _table(["condition", "value"], rows)


OWN_TABLES = ("part_seconds", "greedy_outputs_equal", "llama_cpp_parity")
"""Conditions that are tables of their own (:func:`_time_section`, :func:`_equal_section`,
:func:`_parity_section`), not a cell of the conditions table."""


def _cell(v: Any) -> str:
    """A conditions value as a table cell: a number or a short string, never a Python dict."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, str)) for x in v) and len(v) <= 8:
        return ", ".join(str(x) for x in v)
    if isinstance(v, (dict, list, tuple)):
        return f"{len(v)} entries (results.json)"
    text = str(v)
    return text if len(text) <= 120 else text[:100] + "... (results.json)"


def _time_section(c: EvalConditions) -> list[str]:
    parts = c.extra.get("part_seconds") or {}
    if not isinstance(parts, dict) or not parts:
        return []
    rows = [[name, f"{float(sec) / 60:.1f}"] for name, sec in parts.items()]
    note = "Each part this run measured (a part kept from a killed run is not timed again)."
    return ["## Where the eval's time went", "", note, ""] + _table(["part", "minutes"], rows)


def _equal_section(c: EvalConditions) -> list[str]:
    equal = c.extra.get("greedy_outputs_equal") or {}
    if not isinstance(equal, dict) or not equal:
        return []
    rows = [[name, f"{e['equal']} of {e['prompts']}", str(e["reference"])] for name, e in equal.items()]
    note = (
        "Every method is lossless: under greedy decoding each should give the target's own text; a prompt "
        "that differs shows where two numerics part."
    )
    return ["## Greedy outputs against the reference", "", note, ""] + _table(
        ["drafter", "prompts equal", "reference"], rows
    )


def _pick(results: EvalResults, want: Callable[[DrafterResult], bool]) -> Optional[DrafterResult]:
    return next((d for d in results.drafters if want(d)), None)


def _summary_section(results: EvalResults) -> list[str]:
    """Five lines, each a figure with its interval and what it means: ours, vLLM's ngram, the chain,
    ours over ngram (paired by prompt) and ours' fade with the context."""
    ours = _pick(results, lambda d: d.name == "dspark" and d.runner == "reference") or _pick(
        results, lambda d: d.name == "dspark"
    )
    ngram = _pick(results, lambda d: d.runner == "vllm" and d.method == "ngram") or _pick(
        results, lambda d: d.name == "ngram"
    )
    chain = _pick(results, lambda d: d.name.startswith("ngram-then-dspark"))
    lines = []

    def tps(d: DrafterResult) -> str:
        return f"**{fmt(d.tokens_per_step)}**{interval_text(d.interval(TOKENS_PER_STEP.stat))}"

    if ours is not None:
        lines.append(
            f"- **Ours** (`{ours.name}`, {ours.runner}): {tps(ours)} tokens per target step: each target forward "
            f"yields {fmt(ours.tokens_per_step, 2)} tokens, {fmt(ours.tokens_per_step - 1, 2)} of them accepted drafts."
        )
    if ngram is not None:
        share = pct(AcceptanceCounts.from_dict(ngram.overall).draft_share)
        lines.append(
            f"- **vLLM ngram** (prompt lookup, no model: the free baseline): {tps(ngram)} tokens per target step "
            f"(tau {fmt(ngram.tau)} over the {share} of steps it found a match to draft from)."
        )
    if chain is not None:
        lines.append(
            f"- **ngram, then ours** (the lookup's draft where it has one, ours elsewhere): {tps(chain)} tokens "
            "per target step."
        )
    if ours is not None and ngram is not None and ngram.tokens_per_step:
        ratio = ours.tokens_per_step / ngram.tokens_per_step
        lo, hi = paired_interval(ours, ngram)
        verdict = (
            "ours accepts fewer tokens per target step than the lookup"
            if hi < 1
            else "ours accepts more tokens per target step than the lookup"
            if lo > 1
            else "level within the noise of these prompts"
        )
        lines.append(
            f"- **Ours / ngram**: {fmt(ratio)}{interval_text((lo, hi))}, paired over the prompts both answered: "
            f"{verdict}."
        )
    if ours is not None and len(ours.per_bin) > 1:
        value, (lo, hi) = ours.fade()
        bins = sorted(ours.per_bin, key=int)
        verdict = (
            "no fade this eval set can tell"
            if lo <= 1 <= hi
            else ("acceptance falls with the context" if hi < 1 else "acceptance rises with the context")
        )
        lines.append(
            f"- **Fade** (ours at {bins[-1]} tokens of context over {bins[0]}): {fmt(value)}{interval_text((lo, hi))}: "
            f"{verdict}."
        )
    if not lines:
        return []
    note = f"Brackets: {CONFIDENCE:.0%} bootstrap intervals over the prompts. Tables below; figures in results.json."
    return ["## Summary", ""] + lines + ["", note]


def _figures_row(d: DrafterResult, counts: dict[str, Any], bin: str | None) -> list[str]:
    """Each of :data:`~eval.acceptance.ACCEPTANCE_METRICS` (recomputed from the counters), its
    interval where it has one, then the steps counted."""
    c = AcceptanceCounts.from_dict(counts)
    summary = c.summary()
    cells = [
        metric_text(m, m.value(summary)) + (interval_text(d.interval(m.stat, bin)) if m.stat else "")
        for m in ACCEPTANCE_METRICS
    ]
    return cells + [f"{c.num_steps}"]


def _tau_section(results: EvalResults) -> list[str]:
    """Per method, then per method and context bin: the all-steps figure with its interval,
    vLLM's tau over the drafted steps, the drafted share, pos-1 with its interval."""
    head = [m.label for m in ACCEPTANCE_METRICS] + ["steps"]
    bins = sorted({b for d in results.drafters for b in d.per_bin}, key=int)
    fade_head = f"fade @{bins[-1]}/@{bins[0]}" if len(bins) > 1 else "fade"
    fades = [d.fade() for d in results.drafters]
    overall = [
        [d.name, d.runner] + _figures_row(d, d.overall, None) + [fmt(fade) + interval_text(interval)]
        for d, (fade, interval) in zip(results.drafters, fades)
    ]
    per_bin = [
        [d.name, b, str(d.per_bin[b].get("num_prompts", ""))] + _figures_row(d, d.per_bin[b], b)
        for d in results.drafters
        for b in [str(x) for x in results.conditions.context_bins]
        if b in d.per_bin
    ]
    text = (
        "tokens/step = 1 + accepted / every target verification step (drafted or not): what a user pays "
        "for, target forwards. tau = 1 + accepted / drafts counts only the steps that had a draft "
        "(vLLM's counter); drafted = their share. pos-1 = P(first drafted token accepted), per draft. "
        "fade = tokens/step at the longest context bin over the shortest (paired over the prompts where the "
        "bins hold the same prompts at other lengths: eval.source=fixed_passage). "
        f"Brackets: {CONFIDENCE:.0%} bootstrap interval over prompts (seeded); none for a single prompt."
    )
    return (
        ["## Tokens per target step", "", text, ""]
        + _table(["drafter", "runner"] + head + [fade_head], overall)
        + ["", "Per context bin:", ""]
        + _table(["drafter", "ctx bin", "prompts"] + head, per_bin)
    )


def _position_section(results: EvalResults) -> list[str]:
    positions = [f"pos {k}" for k in range(1, results.conditions.gamma + 1)]
    uncond = [[d.name] + [fmt(a) for a in d.overall[ACCEPT_PER_POS.name]] for d in results.drafters]
    cond = [[d.name] + [fmt(a) for a in d.overall["accept_cond_per_pos"]] for d in results.drafters]
    return (
        ["## Acceptance per draft position", "", "Unconditional: P(first k draft tokens all accepted).", ""]
        + _table(["drafter"] + positions, uncond)
        + ["", "Conditional: P(position k accepted | positions < k accepted).", ""]
        + _table(["drafter"] + positions, cond)
    )


def _speedup_section(rows: list[dict[str, Any]]) -> list[str]:
    model = (
        "Predicted = E / (1 + r) with E = measured tokens per target step (every step) and r = measured "
        "draft/target cost per step; "
        "p is the i.i.d. per-token acceptance giving E = (1 - p^(gamma+1)) / (1 - p)."
    )
    head = ["## Speedup", "", model, ""]
    if not rows:
        return head + ["No drafter has a measured cost ratio or wall-clock speedup."]
    table = [
        [
            r["drafter"],
            fmt(r["tokens_per_step"]),
            fmt(r["p"]),
            fmt(r["r"]),
            fmt(r["predicted"], 2),
            fmt(r["measured"], 2) + interval_text(r.get("measured_interval"), 2),
        ]
        for r in rows
    ]
    return head + _table(["drafter", "tokens/step (E)", "p", "r", "predicted speedup", "measured speedup"], table)


def _calibration_section(results: EvalResults) -> list[str]:
    rows = [
        [d.name, fmt(d.calibration.ece), str(sum(d.calibration.bin_count))]
        for d in results.drafters
        if d.calibration is not None
    ]
    if not rows:
        return []
    return ["## Confidence calibration", ""] + _table(["drafter", "ECE", "verified positions"], rows)


def _checks_section(checks: list[Check]) -> list[str]:
    def result(c: Check) -> str:
        return INSIDE_NOISE if c.inside_noise else ("pass" if c.passed else "**FAIL**")

    rows = [[c.name, fmt(c.target), fmt(c.measured) + interval_text(c.interval), result(c), c.detail] for c in checks]
    note = (
        f"Brackets: {CONFIDENCE:.0%} bootstrap interval over prompts; a check whose interval crosses its line "
        "is inside the noise: this eval set cannot tell."
    )
    return ["## Quality checks", "", note, ""] + _table(["check", "target", "measured", "result", "detail"], rows)


def _parity_section(results: EvalResults) -> list[str]:
    """llama.cpp's rows against their reference-loop twins, per prompt (``eval.agreement.llama_cpp_parity``)."""
    parity = results.conditions.extra.get("llama_cpp_parity") or {}
    if not parity:
        return []
    rows = []
    for name, p in parity.items():
        for r in p["per_prompt"]:
            rows.append(
                [
                    name,
                    str(r["prompt_id"]),
                    "yes" if r["tokens_equal"] else f"no (from token {r['first_difference']})",
                    f"{r['accepted'][0]} / {r['accepted'][1]}",
                    f"{r['drafts'][0]} / {r['drafts'][1]}",
                    f"{r['steps'][0]} / {r['steps'][1]}",
                ]
            )
    note = (
        "Greedy, both lossless: equal tokens where the two targets' numerics agree (a quantized target GGUF "
        "parts from the fp32 reference); accepted, drafts and steps as llama.cpp / the reference loop."
    )
    head = ["drafter", "prompt", "tokens equal", "accepted", "drafts", "steps"]
    return ["## llama.cpp against the reference loop", "", note, ""] + _table(head, rows)


def render_markdown(results: EvalResults, plots: dict[str, Path], *, checks: list[Check] | None = None) -> str:
    """The report: a five-line summary, then the conditions (no number means anything without them),
    then the tables; every cell a number or a short string."""
    sections = [
        ["# DSpark acceptance report"],
        _summary_section(results),
        _conditions_section(results.conditions),
        _tau_section(results),
        _position_section(results),
        _speedup_section(speedup_table(results)),
        _calibration_section(results),
        _parity_section(results),
        _equal_section(results.conditions),
        _time_section(results.conditions),
    ]
    if checks is not None:
        sections.append(_checks_section(checks))
    sections.append(["## Plots"] + [f"\n![{name}]({p.name})" for name, p in plots.items()])
    return "\n\n".join("\n".join(s) for s in sections if s) + "\n"


def _fade_text(d: DrafterResult) -> str:
    """``  fade @7168/@1024 0.93 [0.85, 1.01]``: tokens/step at the longest bin over the shortest."""
    bins = sorted(d.per_bin, key=int)
    if len(bins) < 2:
        return ""
    value, interval = d.fade()
    return f"  fade @{bins[-1]}/@{bins[0]} {fmt(value)}{interval_text(interval)}"


def summary_lines(results: EvalResults, checks: list[Check]) -> list[str]:
    """The main job's eval lines: each method's tokens per target step over all steps (the headline,
    with its interval), vLLM's tau over the drafted steps and the drafted share beside it; then
    each check with its verdict."""
    lines = []
    speedups = {r["drafter"]: r for r in speedup_table(results)}
    for d in results.drafters:
        share = pct(AcceptanceCounts.from_dict(d.overall).draft_share)
        clock = ""
        if d.runner == "llama.cpp" and d.tokens_per_s:
            clock = f", {d.tokens_per_s:.1f} tok/s" + (
                f" = {d.measured_speedup:.2f}x{interval_text(speedups[d.name]['measured_interval'], 2)} none"
                if d.measured_speedup and d.method != "none"
                else ""
            )
        interval = interval_text(d.interval(TOKENS_PER_STEP.stat))
        lines.append(
            f"eval     {d.name:<18} tokens/step {fmt(d.tokens_per_step)}{interval}"
            f"  (tau {fmt(d.tau)} over drafted steps, {share} drafted; {d.runner}{clock}){_fade_text(d)}"
        )
    lines += [f"check    {c.name}: {c.verdict} ({c.detail})" for c in checks]
    parts = results.conditions.extra.get("part_seconds") or {}
    if parts:  # where the eval's wall clock went (parts kept from a killed run are not timed again)
        lines.append("eval     time: " + ", ".join(f"{name} {s / 60:.1f} min" for name, s in parts.items()))
    return lines


# --- entry points ----------------------------------------------------------------------------


def write_report(
    results: EvalResults, out_dir: Path, *, checks: list[Check] | None = None, wandb_run: Run | None = None
) -> ReportPaths:
    """Write the PNGs, report.md and results.json into ``out_dir``; log them to ``wandb_run``.

    results.json is written last and atomically: it is what marks the report complete
    (``eval.run`` skips a report whose results.json holds the same fingerprint), so a kill
    before it leaves a report that the next run writes again, never one taken as complete."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(results, out_dir)
    md_path = out_dir / "report.md"
    atomic_write_text(md_path, render_markdown(results, plots, checks=checks))
    json_path = out_dir / "results.json"
    atomic_write_text(json_path, results_json(results, checks))
    if wandb_run is not None:
        log_to_wandb(wandb_run, results, plots)
    return ReportPaths(json=json_path, markdown=md_path, plots=plots)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Re-render a DSpark eval report from results.json.")
    parser.add_argument("results_json", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="directory for the report")
    args = parser.parse_args(argv)
    paths = write_report(load_results(args.results_json), args.out, checks=load_checks(args.results_json))
    print(paths.markdown)


if __name__ == "__main__":
    main()
