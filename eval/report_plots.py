"""The eval report's PNG plots (:mod:`eval.report` writes them beside ``report.md``): acceptance
per draft position, tokens per target step per context bin with its 95 % interval, and each
confidence head's calibration.

``Figure()`` without pyplot renders through Agg and leaves the process's global backend alone.
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure

from eval.acceptance import ACCEPT_PER_POS, TOKENS_PER_STEP
from eval.intervals import CONFIDENCE
from eval.results import EvalConditions, EvalResults


def _conditions_line(c: EvalConditions) -> str:
    return f"{c.target}, gamma={c.gamma}, temperature={c.temperature:g}"


def plot_acceptance_per_position(results: EvalResults, path: Path) -> None:
    """Unconditional acceptance against draft position, one line per drafter."""
    gamma = results.conditions.gamma
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    positions = list(range(1, gamma + 1))
    for d in results.drafters:
        ax.plot(positions, d.overall[ACCEPT_PER_POS.name], marker="o", label=d.name)
    ax.set(
        xlabel="draft position k",
        ylabel="P(first k draft tokens accepted)",
        ylim=(0, 1.02),
        xticks=positions,
        title=f"Acceptance per position\n{_conditions_line(results.conditions)}",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_tokens_per_step_per_bin(results: EvalResults, path: Path) -> None:
    """Grouped bars: one group per context bin, one bar per drafter, so drafters compare within a
    context length; tokens per target step over every step, with the 95 % interval over prompts."""
    c = results.conditions
    bins = [str(b) for b in c.context_bins]
    width = 0.8 / max(len(results.drafters), 1)
    fig = Figure(figsize=(max(7.5, 1.8 * len(bins)) + 2.4, 4.2))  # + the legend beside
    ax = fig.add_subplot()
    for i, d in enumerate(results.drafters):
        xs = [j + (i - (len(results.drafters) - 1) / 2) * width for j in range(len(bins))]
        values = [d.bin_value(b) for b in bins]
        lo_hi = [d.interval(TOKENS_PER_STEP.stat, b) for b in bins]
        err = [
            [max(v - lo, 0.0) if not math.isnan(lo) else 0.0 for v, (lo, _) in zip(values, lo_hi)],
            [max(hi - v, 0.0) if not math.isnan(hi) else 0.0 for v, (_, hi) in zip(values, lo_hi)],
        ]
        ax.bar(xs, values, width=width, label=d.name, yerr=err, capsize=3)
    ax.set_xticks(range(len(bins)), [f"{b}\n(n={c.prompts_per_bin.get(b, 0)})" for b in bins])
    top = max([d.bin_value(b) for d in results.drafters for b in bins if not math.isnan(d.bin_value(b))] or [1.0])
    ax.set(
        xlabel="context bin (tokens)",
        ylabel="tokens per target step (all steps)",
        ylim=(0, min(c.gamma + 1, max(2.0, 1.25 * top))),
        title=f"Tokens per target step per context bin\n{_conditions_line(c)}; bars: {CONFIDENCE:.0%} over prompts",
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the bars, not over them
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def plot_calibration(results: EvalResults, path: Path) -> bool:
    """Reliability curve of each confidence head; returns False (no file) when no drafter has one."""
    calibrated = [(d.name, d.calibration) for d in results.drafters if d.calibration is not None]
    if not calibrated:
        return False
    fig = Figure(figsize=(5, 5))
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect calibration")
    for name, cal in calibrated:
        pts = [(x, y) for x, y in zip(cal.bin_confidence, cal.bin_accuracy) if x is not None and y is not None]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{name} (ECE {cal.ece:.3f})")
    ax.set(
        xlabel="mean predicted confidence",
        ylabel="observed acceptance",
        xlim=(0, 1),
        ylim=(0, 1),
        title=f"Confidence calibration\n{_conditions_line(results.conditions)}",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def write_plots(results: EvalResults, out_dir: Path) -> dict[str, Path]:
    """All PNGs, keyed by name; calibration only when some drafter has a confidence head."""
    plots = {
        "acceptance_per_position": out_dir / "acceptance_per_position.png",
        "tokens_per_step_per_bin": out_dir / "tokens_per_step_per_bin.png",
    }
    plot_acceptance_per_position(results, plots["acceptance_per_position"])
    plot_tokens_per_step_per_bin(results, plots["tokens_per_step_per_bin"])
    calibration = out_dir / "calibration.png"
    if plot_calibration(results, calibration):
        plots["calibration"] = calibration
    return plots
