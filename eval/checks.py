"""The quality checks of an eval: the demo's targets (issue #6) and a preset's own goals, each a
:class:`~eval.results.Check` beside its measured value and its 95 % interval over prompts. A
check whose interval crosses its line is "inside the noise" instead of pass or fail."""

from __future__ import annotations

import math
from typing import Optional

from dspark.config import EvalConfig
from eval.acceptance import ACCEPT_PER_POS, TOKENS_PER_STEP
from eval.intervals import STATS, ratio_interval
from eval.results import Check, DrafterResult, EvalResults, speedup_row


def interval_text(interval: tuple[float, float] | None, digits: int = 3) -> str:
    """The text " [lo, hi]" of a 95 % interval, or "" where there is none."""
    if interval is None or any(math.isnan(x) for x in interval):
        return ""
    return f" [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"


def ratio_check(
    name: str,
    numerator_name: str,
    numerator: float,
    denominator_name: str,
    denominator: float,
    min_ratio: float,
    interval: tuple[float, float] | None = None,
) -> Check:
    """Pass when numerator / denominator >= min_ratio (e.g. tokens per step of ours over ngram's);
    ``interval``: the ratio's 95 % interval, which decides "inside the noise".

    A zero or NaN denominator gives a NaN ratio, which fails: no evidence is not a pass."""
    ratio = numerator / denominator if denominator else math.nan
    detail = (
        f"{numerator_name} {numerator:.3f} / {denominator_name} {denominator:.3f} = {ratio:.3f}"
        f"{interval_text(interval)} (need >= {min_ratio:g})"
    )
    return Check(
        name=name, measured=ratio, target=min_ratio, passed=ratio >= min_ratio, detail=detail, interval=interval
    )


def goal_check(name: str, label: str, measured: float, goal: float, interval: tuple[float, float]) -> Check:
    """Pass when ``measured`` reaches a preset's ``goal`` (``eval.target_tau``, ``eval.target_pos1``)."""
    return Check(
        name,
        measured,
        goal,
        measured >= goal,
        f"{label} {measured:.3f}{interval_text(interval)} (need >= {goal:g})",
        interval,
    )


def paired_interval(a: DrafterResult, b: DrafterResult, stat: str = TOKENS_PER_STEP.stat) -> tuple[float, float]:
    """The 95 % interval of stat(a) / stat(b) over the prompts both were measured on, resampled
    together (the same prompts: their own difficulty cancels)."""
    ca, cb = a.counts_by_prompt(), b.counts_by_prompt()
    common = [k for k in ca if k in cb]
    return ratio_interval([ca[k] for k in common], [cb[k] for k in common], STATS[stat], paired=True)


def quality_checks(results: EvalResults, e: Optional[EvalConfig] = None) -> list[Check]:
    """The targets of the demo (issue #6) and the preset's own goals (``eval.target_tau``,
    ``eval.target_pos1``), each beside its measured value and its 95 % interval over prompts.
    Every method is compared on tokens per target step over all steps (``eval.acceptance``); for
    our drafter, which drafts every step, that equals its tau."""
    by = {d.name: d for d in results.drafters}
    ours = by.get("dspark")
    if ours is None:
        return []
    checks = []
    tps = ours.tokens_per_step
    if e is not None and e.target_tau is not None:
        checks.append(
            goal_check(
                "tokens per target step on the eval set",
                "tokens/step dspark",
                tps,
                e.target_tau,
                ours.interval(TOKENS_PER_STEP.stat),
            )
        )
    pos1 = ACCEPT_PER_POS.value(ours.overall or {})
    if e is not None and e.target_pos1 is not None:
        checks.append(
            goal_check(
                "first-position acceptance on the eval set",
                "pos-1 acceptance",
                pos1,
                e.target_pos1,
                ours.interval(ACCEPT_PER_POS.stat),
            )
        )
    for other, label, line in (("markov-off", "its Markov-off ablation", 1.15), ("ngram", "vLLM ngram", 1.3)):
        if other in by:
            checks.append(
                ratio_check(
                    f"DSpark over {label}",
                    "tokens/step dspark",
                    tps,
                    f"tokens/step {other}",
                    by[other].tokens_per_step,
                    line,
                    paired_interval(ours, by[other]),
                )
            )
    bins = sorted(ours.per_bin, key=int)
    if len(bins) > 1:
        checks.append(
            ratio_check(
                "no long-context collapse",
                f"tokens/step @{bins[-1]}",
                TOKENS_PER_STEP.value(ours.per_bin[bins[-1]]),
                f"tokens/step @{bins[0]}",
                TOKENS_PER_STEP.value(ours.per_bin[bins[0]]),
                0.9,
                ours.fade()[1],  # paired over the prompts on a set whose bins hold the same ones
            )
        )
    served = [by[n] for n in ("llama.cpp-dspark", "llama.cpp-ngram-then-dspark") if n in by]
    for d in served or [ours]:  # a real server's wall clock, where llama.cpp served ours; else the reference loop's
        if d.measured_speedup is None:
            continue
        r = d.draft_cost_ratio
        pred = speedup_row(d.tokens_per_step, results.conditions.gamma, r).predicted if r is not None else math.nan
        where = "" if d is ours else f", {d.name}"
        checks.append(
            Check(
                f"wall-clock speedup over plain decoding (bs=1{where})",
                d.measured_speedup,
                1.0,
                d.measured_speedup >= 1.0,
                f"measured {d.measured_speedup:.2f}x, cost model predicts {pred:.2f}x",
            )
        )
    return checks
