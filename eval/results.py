"""The eval's result records, declared once: the reference loop and the vLLM runs fill them,
the report reads them, and ``results.json`` is their ``asdict``.

Two figures per method, because vLLM counts a *draft* only on steps where the proposer proposed
something (``Scheduler.make_spec_decoding_stats`` returns early on an empty proposal):

- ``tokens_per_step`` = 1 + accepted / steps, over **every** target verification step, with or
  without a draft (the bonus token included). A user pays for target forwards, so this is the
  headline and the E of the speedup model E / (1 + r). ngram proposes nothing where the last
  tokens have no earlier match, and those steps count here.
- ``tau`` = 1 + accepted / drafts, vLLM's mean acceptance length over the drafted steps only.

``draft_share`` = drafts / steps says how far apart the two are. A drafter that drafts on every
step (ours) has tokens_per_step == tau. ``accepted_per_pos[k]`` counts drafts whose first k+1
tokens were all accepted (vLLM's ``num_accepted_tokens_per_pos``), so acceptance at position k
is unconditional, per draft.

Noise: every figure is over a few prompts, so :func:`bootstrap_interval` resamples the prompts
(seeded) and gives the 95 % interval of any figure of summed counters; :func:`paired_ratio_interval`
does the same for the ratio of two methods run on the same prompts.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Optional, Sequence


@dataclass
class AcceptanceCounts:
    """Spec-decode counters over a set of requests (what vLLM's metrics report)."""

    gamma: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # length gamma
    num_steps: int = 0  # every target verification step after prefill, drafted or not

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.gamma

    def add_step(self, num_proposed: int, num_accepted: int) -> None:
        """One verification step: ``num_proposed`` draft tokens, the first ``num_accepted`` kept.
        A step with nothing proposed is a step but not a draft (vLLM's rule)."""
        if num_accepted > num_proposed:
            raise ValueError(f"{num_accepted} tokens accepted of {num_proposed} proposed")
        self.num_steps += 1
        if num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted += num_accepted
        for k in range(num_accepted):
            self.accepted_per_pos[k] += 1

    def merge(self, other: "AcceptanceCounts") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted += other.num_accepted
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos)]
        self.num_steps += other.num_steps

    def minus(self, before: "AcceptanceCounts") -> "AcceptanceCounts":
        """Counters accumulated since ``before`` (vLLM's counters are cumulative: warm-up excluded)."""
        return AcceptanceCounts(
            self.gamma,
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted - before.num_accepted,
            [a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos)],
            self.num_steps - before.num_steps,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AcceptanceCounts":
        """The counters of a summary or ``asdict`` (extra keys ignored). A record written before
        steps were counted has no ``num_steps``: 0, so its tokens_per_step is NaN (unknown)."""
        names = {f.name for f in fields(cls)}
        c = cls(**{k: (list(v) if k == "accepted_per_pos" else v) for k, v in d.items() if k in names})
        c.num_steps = int(c.num_steps or 0)
        return c

    @property
    def tau(self) -> float:
        """vLLM's mean acceptance length: over the drafted steps only."""
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """Tokens per target verification step over every step (the bonus token included): what a
        user gets per target forward. NaN when steps were not counted."""
        return 1.0 + self.num_accepted / self.num_steps if self.num_steps else float("nan")

    @property
    def draft_share(self) -> float:
        """The share of verification steps on which the proposer proposed something."""
        return self.num_drafts / self.num_steps if self.num_steps else float("nan")

    @property
    def accept_per_pos(self) -> list[float]:
        """Unconditional acceptance at each draft position (vLLM's per-position rate)."""
        return [a / self.num_drafts if self.num_drafts else float("nan") for a in self.accepted_per_pos]

    @property
    def accept_cond_per_pos(self) -> list[float]:
        """P(position k accepted | positions < k accepted)."""
        out, prev = [], self.num_drafts
        for a in self.accepted_per_pos:
            out.append(a / prev if prev else float("nan"))
            prev = a
        return out

    def summary(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "tau": self.tau,
            "tokens_per_step": self.tokens_per_step,
            "draft_share": self.draft_share,
            "accept_per_pos": self.accept_per_pos,
            "accept_cond_per_pos": self.accept_cond_per_pos,
        }


# --- noise ----------------------------------------------------------------------------------

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0

STATS: dict[str, Callable[[AcceptanceCounts], float]] = {
    "tokens_per_step": lambda c: c.tokens_per_step,
    "tau": lambda c: c.tau,
    "pos1": lambda c: c.accept_per_pos[0] if c.accept_per_pos else float("nan"),
}
"""The figures that get an interval, each a function of summed counters."""


def _percentiles(values: list[float], confidence: float) -> tuple[float, float]:
    values = sorted(v for v in values if v == v)  # NaN (a resample with no drafts) has no place
    if not values:
        return (float("nan"), float("nan"))
    tail = (1.0 - confidence) / 2
    lo = values[int(tail * (len(values) - 1))]
    hi = values[int(round((1.0 - tail) * (len(values) - 1)))]
    return (lo, hi)


def _resampled_sum(counts: Sequence[AcceptanceCounts], picks: list[int]) -> AcceptanceCounts:
    total = AcceptanceCounts(counts[0].gamma)
    for i in picks:
        total.merge(counts[i])
    return total


def bootstrap_interval(
    counts: Sequence[AcceptanceCounts],
    stat: Callable[[AcceptanceCounts], float],
    *,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    confidence: float = CONFIDENCE,
) -> tuple[float, float]:
    """The percentile interval of ``stat`` of the summed counters when the prompts are resampled
    with replacement (seeded: the same counts give the same interval). One prompt or none: no
    spread can be seen, so the interval is NaN."""
    n = len(counts)
    if n < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    return _percentiles(
        [stat(_resampled_sum(counts, [rng.randrange(n) for _ in range(n)])) for _ in range(resamples)], confidence
    )


def ratio_interval(
    numerator: Sequence[AcceptanceCounts],
    denominator: Sequence[AcceptanceCounts],
    stat: Callable[[AcceptanceCounts], float],
    *,
    paired: bool,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    confidence: float = CONFIDENCE,
) -> tuple[float, float]:
    """The interval of stat(numerator) / stat(denominator). ``paired``: the two lists are the same
    prompts in the same order (two methods on one eval set), resampled together, so the prompts'
    own difficulty cancels; otherwise (two context bins) each side is resampled on its own."""
    n, m = len(numerator), len(denominator)
    if n < 2 or m < 2 or (paired and n != m):
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        a = [rng.randrange(n) for _ in range(n)]
        b = a if paired else [rng.randrange(m) for _ in range(m)]
        den = stat(_resampled_sum(denominator, b))
        ratios.append(stat(_resampled_sum(numerator, a)) / den if den else float("nan"))
    return _percentiles(ratios, confidence)


@dataclass
class Calibration:
    """Confidence-head calibration: predicted P(accept) against the observed acceptance of
    each drafted position that was verified."""

    ece: float
    bin_edges: list[float]
    bin_confidence: list[Optional[float]]  # mean predicted confidence per bin (None if empty)
    bin_accuracy: list[Optional[float]]  # observed acceptance rate per bin
    bin_count: list[int]


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
    """One record per prompt: {"prompt_id", "bin", **asdict(AcceptanceCounts)}, for the intervals."""

    @property
    def tau(self) -> float:
        """vLLM's tau: over the drafted steps."""
        return float(self.overall["tau"])

    @property
    def tokens_per_step(self) -> float:
        """The headline: tokens per target step over every step."""
        return AcceptanceCounts.from_dict(self.overall).tokens_per_step

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
