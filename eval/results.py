"""The eval's result records, declared once: the reference loop and the vLLM runs fill them,
the report reads them, and ``results.json`` is their ``asdict``.

Counting follows vLLM's spec-decode counters: one *draft* is one verification step that
proposed gamma tokens; ``accepted_per_pos[k]`` counts drafts whose first k+1 tokens were all
accepted (vLLM's ``num_accepted_tokens_per_pos``), so acceptance at position k is
unconditional. tau = 1 + accepted / drafts (the bonus token included).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass
class AcceptanceCounts:
    """Spec-decode counters over a set of requests (what vLLM's metrics report)."""

    gamma: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # length gamma

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.gamma

    def add_step(self, num_proposed: int, num_accepted: int) -> None:
        """One verification step: ``num_proposed`` draft tokens, the first ``num_accepted`` kept."""
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

    def minus(self, before: "AcceptanceCounts") -> "AcceptanceCounts":
        """Counters accumulated since ``before`` (vLLM's counters are cumulative: warm-up excluded)."""
        return AcceptanceCounts(
            self.gamma,
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted - before.num_accepted,
            [a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos)],
        )

    @property
    def tau(self) -> float:
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else float("nan")

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
            "accept_per_pos": self.accept_per_pos,
            "accept_cond_per_pos": self.accept_cond_per_pos,
        }


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

    @property
    def tau(self) -> float:
        return float(self.overall["tau"])

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
            "drafters": [{**asdict(d), "tau": d.tau, "measured_speedup": d.measured_speedup} for d in self.drafters],
        }
