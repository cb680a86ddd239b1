"""The eval report on a W&B run: stable scalar names (``eval/<drafter>/...``), the plots and the
per-bin and speedup tables, logged in one call (:func:`eval.report.write_report` calls it when
given a run)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eval.acceptance import ACCEPTANCE_METRICS, TAU, TOKENS_PER_STEP, AcceptanceCounts
from eval.results import EvalResults, speedup_table

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run


def _wandb_scalars(results: EvalResults, speedups: list[dict[str, Any]]) -> dict[str, float]:
    """Stable metric names (eval/<drafter>/...); NaNs are left out so summaries stay numeric.
    Each of :data:`~eval.acceptance.ACCEPTANCE_METRICS` under its name (a per-position one under each
    position's, a per-bin one per context bin too); the headline's interval; the ECE; the speedups."""
    out: dict[str, float] = {}
    for d in results.drafters:
        key = f"eval/{d.name}"
        summary = AcceptanceCounts.from_dict(d.overall).summary()
        for m in ACCEPTANCE_METRICS:
            if m.per_position:
                out.update({f"{key}/{m.position_name(k)}": a for k, a in enumerate(summary[m.name], start=1)})
            else:
                out[f"{key}/{m.name}"] = m.value(summary)
            if m.per_bin:
                out.update(
                    {f"{key}/{m.name}_bin_{b}": d.bin_value(str(b), m.name) for b in results.conditions.context_bins}
                )
        lo, hi = d.interval(TOKENS_PER_STEP.stat)
        out[f"{key}/{TOKENS_PER_STEP.name}_lo"], out[f"{key}/{TOKENS_PER_STEP.name}_hi"] = lo, hi
        fade, (lo, hi) = d.fade()
        out[f"{key}/fade"], out[f"{key}/fade_lo"], out[f"{key}/fade_hi"] = fade, lo, hi
        if d.calibration is not None:
            out[f"{key}/ece"] = d.calibration.ece
    for row in speedups:
        for col in ("predicted", "measured"):
            if row[col] is not None:
                out[f"eval/{row['drafter']}/{col}_speedup"] = row[col]
    return {k: float(v) for k, v in out.items() if not math.isnan(v)}


def log_to_wandb(run: Run, results: EvalResults, plots: dict[str, Path]) -> None:
    """Scalars, plots and tables in one ``log`` call, so they share a step."""
    import wandb  # slow to import; only needed when a run is given

    speedups = speedup_table(results)
    bins = [str(b) for b in results.conditions.context_bins]
    bin_table = wandb.Table(
        columns=["drafter", TOKENS_PER_STEP.name, TAU.name] + bins,
        data=[[d.name, d.tokens_per_step, d.tau] + [d.bin_value(b) for b in bins] for d in results.drafters],
    )
    columns = ["drafter", "tokens_per_step", "p", "r", "predicted", "measured"]
    speedup = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in speedups])
    run.log(
        {
            **_wandb_scalars(results, speedups),
            **{f"eval/plots/{name}": wandb.Image(str(p)) for name, p in plots.items()},
            f"eval/{TOKENS_PER_STEP.name}_per_bin_table": bin_table,
            "eval/speedup_table": speedup,
        }
    )
