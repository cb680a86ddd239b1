"""The noise in the eval's figures: bootstrap intervals over prompts.

Every figure is over a few prompts, so :func:`bootstrap_interval` resamples the prompts (seeded)
and gives the 95 % interval of any figure of summed counters (:data:`STATS`);
:func:`ratio_interval` does the same for the ratio of two methods run on the same prompts
(``paired``) or of two context bins, and :func:`speedup_interval` for a measured wall-clock
speedup.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

from eval.acceptance import AcceptanceCounts

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


def speedup_interval(
    row: Sequence[dict[str, Any]],
    baseline: Sequence[dict[str, Any]],
    *,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    confidence: float = CONFIDENCE,
) -> tuple[float, float]:
    """The interval of a measured wall-clock speedup, (decode tokens / decode time) of ``row``
    over the same of ``baseline``, from per-prompt records with ``decode_tokens`` and
    ``decode_ms``: the prompts both measured are resampled together (paired, as in
    :func:`ratio_interval`), so a long prompt's weight in both sums moves together. NaN with
    fewer than two such prompts."""
    base = {str(p["prompt_id"]): p for p in baseline if p.get("decode_ms")}
    pairs = [(p, base[str(p["prompt_id"])]) for p in row if p.get("decode_ms") and str(p["prompt_id"]) in base]
    n = len(pairs)
    if n < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        picks = [pairs[rng.randrange(n)] for _ in range(n)]
        ours = sum(a["decode_tokens"] for a, _ in picks) / sum(a["decode_ms"] for a, _ in picks)
        plain = sum(b["decode_tokens"] for _, b in picks) / sum(b["decode_ms"] for _, b in picks)
        ratios.append(ours / plain if plain else float("nan"))
    return _percentiles(ratios, confidence)
