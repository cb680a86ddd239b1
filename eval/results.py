"""The eval's result records, declared once: the reference loop and the vLLM runs fill them,
the report reads them, and ``results.json`` is their ``asdict``.

A :class:`DrafterResult` is one method on the whole prompt set: its summed counters overall and
per context bin, and one record per prompt (:mod:`eval.acceptance` counts and names the
figures; :mod:`eval.intervals` gives their 95 % intervals over the prompts).

The speedup model (Leviathan et al. 2023; README "Glossary"): with measured E = tokens per
target step and measured draft cost ratio r, the predicted speedup is E / (1 + r). The i.i.d.
per-token acceptance p that gives the same E under E(p) = (1 - p^(gamma+1)) / (1 - p) is
reported beside it, so drafters can be compared on one number that does not depend on gamma.

``results.json`` is written by :func:`results_json` and read back by :func:`load_results` and
:func:`load_checks`, side by side here; strict JSON has no NaN, so :func:`nan_to_none` writes
null and the reader recomputes the derived figures from the counters.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from eval.acceptance import TOKENS_PER_STEP, AcceptanceCounts
from eval.intervals import CONFIDENCE, STATS, bootstrap_interval, ratio_interval, speedup_interval


@dataclass
class Calibration:
    """Confidence-head calibration: predicted P(accept) against the observed acceptance of
    each drafted position that was verified."""

    ece: float
    bin_edges: list[float]
    bin_confidence: list[Optional[float]]  # mean predicted confidence per bin (None if empty)
    bin_accuracy: list[Optional[float]]  # observed acceptance rate per bin
    bin_count: list[int]


def pair_key(prompt: dict[str, Any]) -> Optional[str]:
    """The prompt a per-prompt record is at another length, for sets whose bins hold the same
    prompts (:mod:`eval.prompts`' ``fixed_passage`` ids, ``fixed-s{seed}-b{bin}-{i}``); None for
    sets whose bins hold other documents."""
    pid, b = str(prompt["prompt_id"]), f"-b{prompt['bin']}-"
    return pid.replace(b, "-", 1) if pid.startswith("fixed-") and b in pid else None


@dataclass
class DrafterResult:
    """One drafter (or baseline) on the whole prompt set."""

    name: str  # e.g. "dspark", "dspark-markov-off", "ngram", "dflash-export"
    runner: str  # "reference" (PyTorch loop) | "vllm"
    method: str  # vLLM method name or "dspark"/"dflash" for the reference loop
    overall: dict[str, Any]  # AcceptanceCounts.summary()
    per_bin: dict[str, dict[str, Any]]  # str(bin) -> AcceptanceCounts.summary() + {"num_prompts": n}
    calibration: Optional[Calibration] = None
    draft_cost_ratio: Optional[float] = None  # r = draft time / target verify time per step
    tokens_per_s: Optional[float] = None  # wall clock, this drafter
    baseline_tokens_per_s: Optional[float] = None  # wall clock, plain decoding of the same target
    notes: str = ""
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    """One record per prompt: {"prompt_id", "bin", **asdict(AcceptanceCounts), "output_ids"}, for the
    intervals and the greedy-output comparison (:func:`outputs_equal`; older runs lack the ids)."""

    @property
    def tau(self) -> float:
        """vLLM's tau: over the drafted steps."""
        return float(self.overall["tau"])

    @property
    def tokens_per_step(self) -> float:
        """The headline: tokens per target step over every step."""
        return AcceptanceCounts.from_dict(self.overall).tokens_per_step

    def bin_value(self, bin: str, key: str = TOKENS_PER_STEP.name) -> float:
        """A figure of one context bin (``key`` of its summary), NaN where this drafter has no
        counts for the bin, so tables and bars show a gap."""
        if bin not in self.per_bin:
            return math.nan
        v = self.per_bin[bin].get(key)
        return math.nan if v is None else float(v)

    def prompt_counts(self, bin: Optional[str] = None) -> list[AcceptanceCounts]:
        """The per-prompt counters (of one context bin), in the eval set's order."""
        return [AcceptanceCounts.from_dict(p) for p in self.per_prompt if bin is None or str(p["bin"]) == bin]

    def counts_by_prompt(self) -> dict[str, AcceptanceCounts]:
        return {str(p["prompt_id"]): AcceptanceCounts.from_dict(p) for p in self.per_prompt}

    def interval(self, stat: str, bin: Optional[str] = None) -> tuple[float, float]:
        """The bootstrap interval over prompts of ``stat`` (a key of :data:`STATS`)."""
        counts = self.prompt_counts(bin)
        return bootstrap_interval(counts, STATS[stat]) if counts else (float("nan"), float("nan"))

    def intervals(self) -> dict[str, Any]:
        """Every interval the report shows: overall and per bin, for each of :data:`STATS`."""
        return {
            "confidence": CONFIDENCE,
            "overall": {s: list(self.interval(s)) for s in STATS},
            "per_bin": {b: {s: list(self.interval(s, b)) for s in STATS} for b in self.per_bin},
        }

    def fade(self) -> tuple[float, tuple[float, float]]:
        """Tokens/step at the longest context bin over the shortest's, with its 95 % interval: paired
        where the bins hold the same prompts at other lengths (``fixed_passage``: :func:`pair_key`),
        resampled apart otherwise. NaN with fewer than two bins."""
        bins = sorted(self.per_bin, key=int)
        nan = float("nan")
        if len(bins) < 2:
            return nan, (nan, nan)
        hi, lo = bins[-1], bins[0]
        den = AcceptanceCounts.from_dict(self.per_bin[lo]).tokens_per_step
        value = AcceptanceCounts.from_dict(self.per_bin[hi]).tokens_per_step / den if den else nan
        by = {
            b: {pair_key(p): AcceptanceCounts.from_dict(p) for p in self.per_prompt if str(p["bin"]) == b}
            for b in (hi, lo)
        }
        common = [k for k in by[hi] if k is not None and k in by[lo]]
        if common and len(common) == len(by[hi]) == len(by[lo]):
            counts = [by[hi][k] for k in common], [by[lo][k] for k in common]
            return value, ratio_interval(*counts, STATS[TOKENS_PER_STEP.stat], paired=True)
        return value, ratio_interval(
            self.prompt_counts(hi), self.prompt_counts(lo), STATS[TOKENS_PER_STEP.stat], paired=False
        )

    @property
    def measured_speedup(self) -> Optional[float]:
        if self.tokens_per_s and self.baseline_tokens_per_s:
            return self.tokens_per_s / self.baseline_tokens_per_s
        return None


@dataclass
class EvalConditions:
    """What every figure in a report was measured under."""

    target: str
    target_path: str
    gamma: int
    temperature: float
    max_new_tokens: int
    prompt_source: str  # "offline" | "aa_lcr"
    context_bins: list[int]
    prompts_per_bin: dict[str, int]
    checkpoint: str = ""
    export_dir: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalResults:
    conditions: EvalConditions
    drafters: list[DrafterResult]

    def to_dict(self) -> dict[str, Any]:
        return {
            "conditions": asdict(self.conditions),
            "drafters": [
                {
                    **asdict(d),
                    "tau": d.tau,
                    "tokens_per_step": d.tokens_per_step,
                    "intervals": d.intervals(),
                    "measured_speedup": d.measured_speedup,
                }
                for d in self.drafters
            ],
        }


# --- speedup model ---------------------------------------------------------------------------

_BISECTION_STEPS = 60  # halves [0, 1) down to 2^-60, below float resolution near p = 1


@dataclass(frozen=True)
class SpeedupRow:
    """The speedup model (module docstring) evaluated at one drafter's measured tau and r."""

    tokens_per_step: float  # E: measured tokens per target step, every step counted
    p: float  # i.i.d. per-token acceptance that gives E
    r: float  # draft cost / target verify cost per step
    predicted: float  # E / (1 + r)


def expected_tokens(p: float, gamma: int) -> float:
    """E[tokens per step] when each of gamma draft tokens is accepted i.i.d. with probability p
    (the bonus token included); the limit gamma + 1 at p = 1."""
    if p >= 1.0:
        return float(gamma + 1)
    return (1.0 - p ** (gamma + 1)) / (1.0 - p)


def fit_p(tau: float, gamma: int) -> float:
    """The p with ``expected_tokens(p, gamma) == tau``, by bisection (E is increasing in p).

    tau outside (1, gamma + 1) is clamped to p = 0 or 1: sampling noise can put a measured tau
    on or past the ends, and the model has no p there."""
    if math.isnan(tau):
        return math.nan
    if tau <= 1.0:
        return 0.0
    if tau >= gamma + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        if expected_tokens(mid, gamma) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def speedup_row(tokens_per_step: float, gamma: int, r: float) -> SpeedupRow:
    """Predicted speedup from measured tokens per target step and measured cost ratio (both, not
    assumed)."""
    return SpeedupRow(
        tokens_per_step=tokens_per_step,
        p=fit_p(tokens_per_step, gamma),
        r=r,
        predicted=tokens_per_step / (1.0 + r),
    )


def speedup_table(results: EvalResults) -> list[dict[str, Any]]:
    """One row per drafter that has a cost ratio or a wall-clock speedup, so the model's
    prediction and the measurement sit side by side; the prediction is None without r."""
    rows = []
    gamma = results.conditions.gamma
    plain = {d.runner: d for d in results.drafters if d.method == "none"}  # a server's own plain-decoding row
    for d in results.drafters:
        measured = d.measured_speedup
        if d.draft_cost_ratio is None and measured is None:
            continue
        e = d.tokens_per_step
        if d.draft_cost_ratio is None:
            model: dict[str, Any] = {"tokens_per_step": e, "p": fit_p(e, gamma), "r": None, "predicted": None}
        else:
            model = asdict(speedup_row(e, gamma, d.draft_cost_ratio))
        base = plain.get(d.runner)
        interval = (
            list(speedup_interval(d.per_prompt, base.per_prompt))
            if measured is not None and base is not None
            else [float("nan"), float("nan")]
        )
        rows.append({"drafter": d.name, **model, "measured": measured, "measured_interval": interval})
    return rows


# --- quality checks --------------------------------------------------------------------------

INSIDE_NOISE = "inside the noise"


@dataclass(frozen=True)
class Check:
    """One quality gate shown as "target vs measured" (e.g. ours beats the ngram baseline).
    ``passed`` is the point estimate's side of the line; ``interval`` (95 %, over prompts) says
    whether the eval set can tell: when it crosses the line the verdict is "inside the noise"."""

    name: str
    measured: float
    target: float
    passed: bool
    detail: str
    interval: tuple[float, float] | None = None

    @property
    def inside_noise(self) -> bool:
        if self.interval is None or any(math.isnan(x) for x in self.interval):
            return False
        lo, hi = self.interval
        return lo < self.target <= hi

    @property
    def verdict(self) -> str:
        """PASS, MISS, or "inside the noise" when the interval crosses the line."""
        return INSIDE_NOISE if self.inside_noise else ("PASS" if self.passed else "MISS")


# --- results.json ----------------------------------------------------------------------------


def nan_to_none(obj: Any) -> Any:
    """Strict JSON has no NaN/inf; an empty bin's tau is NaN, so it becomes null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [nan_to_none(v) for v in obj]
    return obj


def results_payload(results: EvalResults, checks: list[Check] | None = None) -> dict[str, Any]:
    """What ``results.json`` holds: the records, the speedup table, and the checks if any."""
    payload = {**results.to_dict(), "speedup": speedup_table(results)}
    if checks is not None:
        payload["checks"] = [asdict(c) for c in checks]
    return nan_to_none(payload)


def results_json(results: EvalResults, checks: list[Check] | None = None) -> str:
    """The text of ``results.json`` (strict JSON), which :func:`load_results` reads back."""
    return json.dumps(results_payload(results, checks), indent=2, allow_nan=False) + "\n"


def _summary_from_counts(summary: dict[str, Any]) -> dict[str, Any]:
    """Recompute tau and the acceptance rates from the raw counters, which restores the NaNs
    that JSON stored as null; extra keys (``num_prompts``) are kept."""
    return {**summary, **AcceptanceCounts.from_dict(summary).summary()}


def drafter_from_dict(d: dict[str, Any]) -> DrafterResult:
    """A :class:`DrafterResult` from its ``asdict`` as JSON stored it (derived keys recomputed)."""
    cal = d.get("calibration")
    calibration = None
    if cal is not None:
        ece = math.nan if cal["ece"] is None else cal["ece"]
        calibration = Calibration(**{**cal, "ece": ece})
    return DrafterResult(
        name=d["name"],
        runner=d["runner"],
        method=d["method"],
        overall=_summary_from_counts(d["overall"]),
        per_bin={b: _summary_from_counts(s) for b, s in d["per_bin"].items()},
        calibration=calibration,
        draft_cost_ratio=d.get("draft_cost_ratio"),
        tokens_per_s=d.get("tokens_per_s"),
        baseline_tokens_per_s=d.get("baseline_tokens_per_s"),
        notes=d.get("notes", ""),
        per_prompt=list(d.get("per_prompt") or []),
    )


def load_results(path: Path) -> EvalResults:
    """Rebuild the records from a ``results.json`` (derived keys such as tau are recomputed)."""
    data = json.loads(Path(path).read_text())
    return EvalResults(
        conditions=EvalConditions(**data["conditions"]), drafters=[drafter_from_dict(d) for d in data["drafters"]]
    )


def load_checks(path: Path) -> list[Check] | None:
    """The checks stored in a ``results.json``, or None when it has none."""
    data = json.loads(Path(path).read_text())
    if "checks" not in data:
        return None
    out = []
    for c in data["checks"]:
        iv = c.get("interval")
        iv = None if iv is None else tuple(math.nan if x is None else x for x in iv)
        out.append(Check(**{**c, "measured": math.nan if c["measured"] is None else c["measured"], "interval": iv}))
    return out


def outputs_equal(per_prompt: list[dict[str, Any]], reference: dict[str, list[int]]) -> tuple[int, int]:
    """(prompts whose ``output_ids`` equal ``reference[prompt_id]`` token for token, prompts both
    have): a check that two decoders of the same target produce the same greedy text."""
    both = [p for p in per_prompt if p.get("output_ids") is not None and str(p["prompt_id"]) in reference]
    return sum(list(p["output_ids"]) == list(reference[str(p["prompt_id"])]) for p in both), len(both)
