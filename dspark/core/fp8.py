"""fp8 storage of hidden states: one fp32 scale per (token, captured layer) row.

A target's hidden states have a few tokens (the first one, attention sinks) whose norm is tens
of times the others', so one scale per tensor would push ordinary tokens into fp8's subnormals
and one per channel would not follow a single large token. A scale per row maps each row's
largest magnitude to the format's largest finite value: no row saturates, and every value keeps
the format's relative precision unless it is below ``2**min_exponent`` times its row's maximum.
Measured against a scale per tensor and per channel (``benchmarks/shard_fp8.py``, docs/benchmarks.md
"Where the scale lives"): the per-row scale has the lowest mean, p99 and max error of the four.

Error bound (round to nearest, checked by tests/dspark/test_fp8.py), per element ``x`` of a row
with scale ``s = amax / max_finite``::

    |x - dequantize(quantize(x))| <= 2**-(mantissa_bits + 1) * max(|x|, 2**min_exponent * s)

that is a relative error of at most 2**-4 for e4m3 (3 mantissa bits) and 2**-3 for e5m2 (2 bits)
for values in the normal range, and in the subnormal range (``|x| / s < 2**min_exponent``: below
2**-6 * amax / 448 for e4m3, 2**-14 * amax / 57344 for e5m2) an absolute error of at most half
the subnormal step times the scale. The fp32 divide and multiply add about 2**-24 relative.
An all-zero row gets scale 0 and decodes to exact zeros.

Imports torch only, so it runs in a vLLM-only environment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    """One fp8 storage format: its torch dtype and the numbers its error bound is made of."""

    name: str
    torch_dtype: torch.dtype
    mantissa_bits: int
    min_exponent: int
    """The smallest normal value is 2**min_exponent."""
    max_finite: float

    @property
    def rel_bound(self) -> float:
        """Largest relative error of one element in the normal range (half a unit in the last place)."""
        return 2.0 ** -(self.mantissa_bits + 1)

    def row_rel_bound(self, hidden: int) -> float:
        """Bound on ||x - x_hat|| / ||x|| for one row of ``hidden`` values: the per-element bound
        summed in quadrature, with the subnormal term taken at its worst (every element below the
        normal range, the scale at its largest, ||x|| / max_finite)."""
        return self.rel_bound * (1.0 + math.sqrt(hidden) * 2.0**self.min_exponent / self.max_finite)


FORMATS = {
    "float8_e4m3": Fp8Format("float8_e4m3", torch.float8_e4m3fn, mantissa_bits=3, min_exponent=-6, max_finite=448.0),
    "float8_e5m2": Fp8Format("float8_e5m2", torch.float8_e5m2, mantissa_bits=2, min_exponent=-14, max_finite=57344.0),
}
"""Store dtype name (``data.store_dtype``) -> format. e4m3 is the "fn" variant (no infinities,
largest finite 448), the one GPUs compute in."""

SCALE_DTYPE = torch.float32
SCALE_BYTES = 4


def quantize(x: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., H] states -> (fp8 values [..., H], fp32 scales [...]), one scale per row of H.

    The scale is amax / max_finite so the row's largest magnitude lands on the largest finite
    fp8 value; a zero row gets scale 0 (divided by 1, so its values stay 0). A row holding
    NaN or inf gets a non-finite scale, which the shard checks report rather than hide.
    """
    x = x.to(SCALE_DTYPE)
    scale = x.abs().amax(dim=-1) / fmt.max_finite  # [...]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / safe.unsqueeze(-1)).clamp(-fmt.max_finite, fmt.max_finite)  # rounding may step past max
    return q.to(fmt.torch_dtype), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(fp8 values [..., H], fp32 scales [...]) -> states [..., H] in ``dtype``, computed in fp32."""
    out = values.to(SCALE_DTYPE) * scales.to(SCALE_DTYPE).unsqueeze(-1)
    return out if dtype == SCALE_DTYPE else out.to(dtype)
