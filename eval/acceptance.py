"""Spec-decode counting and the acceptance figures every report shows, declared once.

:class:`AcceptanceCounts` holds what vLLM's metrics report, summed over requests; the reference
loop, the vLLM and llama.cpp runs and the serving benchmark fill it. Two figures per method,
because vLLM counts a *draft* only on steps where the proposer proposed something
(``Scheduler.make_spec_decoding_stats`` returns early on an empty proposal):

- ``tokens_per_step`` = 1 + accepted / steps, over **every** target verification step, with or
  without a draft (the bonus token included). A user pays for target forwards, so this is the
  headline and the E of the speedup model E / (1 + r) (:mod:`eval.results`). ngram proposes
  nothing where the last tokens have no earlier match, and those steps count here.
- ``tau`` = 1 + accepted / drafts, vLLM's mean acceptance length over the drafted steps only.

``draft_share`` = drafts / steps says how far apart the two are. A drafter that drafts on every
step (ours) has tokens_per_step == tau. ``accepted_per_pos[k]`` counts drafts whose first k+1
tokens were all accepted (vLLM's ``num_accepted_tokens_per_pos``), so acceptance at position k
is unconditional, per draft.

:data:`ACCEPTANCE_METRICS` declares each figure once (its name, its columns, its format): the
summary, report.md, W&B, the checks and serve_bench read it there.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any


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
        """The counters and every figure: each of :data:`ACCEPTANCE_METRICS` (the property of its
        name), then ``accept_cond_per_pos``. Tau comes first, as in every ``results.json`` written
        before the list; a figure added to the list comes after the others."""
        names = dict.fromkeys([TAU.name, *(m.name for m in ACCEPTANCE_METRICS)])
        return {
            **asdict(self),
            **{name: getattr(self, name) for name in names},
            "accept_cond_per_pos": self.accept_cond_per_pos,
        }


@dataclass(frozen=True)
class AcceptanceMetric:
    """One acceptance figure of a method, declared once in :data:`ACCEPTANCE_METRICS` (as
    training declares ``dspark.loss.LOSS_TERMS``): report.md's figures tables, its W&B scalars,
    the checks and serve_bench's table and W&B scalars read it there."""

    name: str  # its key in AcceptanceCounts.summary(), results.json, serve_bench.json's spec and W&B
    label: str  # report.md's column
    serve_label: str  # serve_bench.md's column
    description: str
    share: bool = False  # shown as a whole percentage, else with 3 decimals
    per_position: bool = False  # a list over draft positions: tables show position 1, report W&B each
    stat: str = ""  # its key in eval.intervals.STATS where report.md shows its 95 % interval beside it
    per_bin: bool = False  # report W&B also logs it per context bin (<name>_bin_<bin>)

    def value(self, summary: dict[str, Any]) -> float:
        """Its figure in a summary (per position: position 1); NaN where it is missing or None."""
        v = summary.get(self.name)
        if self.per_position:
            v = v[0] if v else None
        return math.nan if v is None else float(v)

    def position_name(self, k: int) -> str:
        """Position k's W&B name, as training names it: ``accept_per_pos`` -> ``accept_pos_k``."""
        return f"{self.name.removesuffix('_per_pos')}_pos_{k}"


ACCEPTANCE_METRICS = (
    AcceptanceMetric(
        "tokens_per_step",
        "tokens/step (all steps)",
        "tok/step",
        "1 + accepted / every target verification step, drafted or not: the headline",
        stat="tokens_per_step",
        per_bin=True,
    ),
    AcceptanceMetric(
        "tau", "tau (drafted steps)", "tau (drafted steps)", "1 + accepted / drafts: vLLM's counter", per_bin=True
    ),
    AcceptanceMetric("draft_share", "drafted", "drafted", "drafts / steps", share=True),
    AcceptanceMetric(
        "accept_per_pos",
        "pos-1",
        "accept pos 1",
        "P(first k drafted tokens all accepted), per draft",
        per_position=True,
        stat="pos1",
    ),
)
"""The acceptance figures every report shows, in their column order. ``accept_cond_per_pos`` and
``num_steps`` are in the summary and report.md but not here: W&B and serve_bench show neither."""
TOKENS_PER_STEP, TAU, DRAFT_SHARE, ACCEPT_PER_POS = ACCEPTANCE_METRICS


def per_bin_summary(
    prompt_bins: list[int], counts: list[AcceptanceCounts], gamma: int
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The summed counters of every prompt, and of each context bin's (with its ``num_prompts``):
    a :class:`DrafterResult`'s ``overall`` and ``per_bin``."""
    total, per = AcceptanceCounts(gamma), {}
    for b in sorted(set(prompt_bins)):
        c = AcceptanceCounts(gamma)
        for pb, pc in zip(prompt_bins, counts):
            if pb == b:
                c.merge(pc)
        per[str(b)] = {**c.summary(), "num_prompts": prompt_bins.count(b)}
        total.merge(c)
    return total.summary(), per
