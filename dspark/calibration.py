"""Confidence-head calibration, one definition for training validation and the eval report.

Predicted acceptance ``p`` in [0, 1] against realised acceptance ``y`` in [0, 1], over
``num_bins`` equal-width bins (bin = floor(p * num_bins), p = 1 in the last bin). The per-bin
sums add across batches and data-parallel ranks, so a sharded validation all-reduces them and
computes the same ECE as one process would.
"""

from __future__ import annotations

import torch

NUM_BINS = 10


def calibration_sums(p: torch.Tensor, y: torch.Tensor, num_bins: int = NUM_BINS) -> torch.Tensor:
    """[N] predictions and outcomes -> [num_bins, 3]: count, sum of p, sum of y per bin (float64)."""
    p, y = p.detach().double().flatten().cpu(), y.detach().double().flatten().cpu()
    b = (p * num_bins).long().clamp(0, num_bins - 1)
    out = torch.zeros(num_bins, 3, dtype=torch.float64)
    out[:, 0].index_add_(0, b, torch.ones_like(p))
    out[:, 1].index_add_(0, b, p)
    out[:, 2].index_add_(0, b, y)
    return out


def expected_calibration_error(sums: torch.Tensor) -> float:
    """ECE = sum over bins of |sum p - sum y| / N; NaN when there are no predictions."""
    total = float(sums[:, 0].sum())
    return float((sums[:, 1] - sums[:, 2]).abs().sum()) / total if total else float("nan")
