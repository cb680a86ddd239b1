"""fp8 shard storage: the round trip stays within the bound dspark/core/fp8.py states, for
ordinary, large-norm and zero rows, and the names agree across config, format and codec."""

import pytest
import torch

from dspark.core import fp8
from dspark.formats.shard_format import STORE_DTYPES

FORMATS = list(fp8.FORMATS.values())


def element_bound(x: torch.Tensor, scale: torch.Tensor, fmt: fp8.Fp8Format) -> torch.Tensor:
    """The docstring's bound, with slack for the fp32 divide and multiply."""
    floor = 2.0**fmt.min_exponent * scale.unsqueeze(-1)
    return fmt.rel_bound * torch.maximum(x.abs(), floor) * (1 + 1e-6) + 1e-30


def states(seed: int = 0) -> torch.Tensor:
    """[T, L, H] like a target's: Gaussian rows, one attention-sink token 300x larger, outlier
    channels 50x larger, values spanning many binades, and an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, 128, generator=g)
    x[0] *= 300.0  # the sink token
    x[:, :, 7] *= 50.0  # an outlier channel
    x[5] *= torch.logspace(-8, 2, 128)  # magnitudes deep into each format's subnormals
    x[9, 1] = 0.0
    return x


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_trip_within_the_stated_bound_per_element(fmt):
    x = states()
    values, scales = fp8.quantize(x, fmt)
    assert values.dtype == fmt.torch_dtype and values.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == x.shape[:-1]
    x_hat = fp8.dequantize(values, scales)
    err = (x - x_hat).abs()
    assert (err <= element_bound(x, scales, fmt)).all()
    assert torch.isfinite(x_hat).all()
    normal = (x.abs() >= 2.0**fmt.min_exponent * scales.unsqueeze(-1)) & (x != 0)
    assert (err[normal] / x.abs()[normal]).max() <= fmt.rel_bound * (1 + 1e-6)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_large_norm_tokens_do_not_saturate(fmt):
    x = states()
    big = x[0] * 1e4  # far beyond max_finite: the per-row scale absorbs it
    x_hat = fp8.dequantize(*fp8.quantize(big, fmt))
    assert ((big - x_hat).norm(dim=-1) / big.norm(dim=-1)).max() <= fmt.row_rel_bound(big.shape[-1])
    amax = big.abs().amax(dim=-1)
    assert torch.allclose(x_hat.abs().amax(dim=-1), amax, rtol=1e-6)  # the largest value lands exactly


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_zero_rows_have_scale_zero_and_decode_to_zeros(fmt):
    x = torch.zeros(4, 2, 16)
    x[1, 0, 3] = -2.5
    values, scales = fp8.quantize(x, fmt)
    assert scales[0].tolist() == [0.0, 0.0] and scales[1, 0] == 2.5 / fmt.max_finite
    x_hat = fp8.dequantize(values, scales)
    assert torch.equal(x_hat, x)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_row_bound_holds_for_random_rows(fmt):
    x = torch.randn(512, 576, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 512).unsqueeze(-1)
    x_hat = fp8.dequantize(*fp8.quantize(x, fmt))
    rel = (x - x_hat).norm(dim=-1) / x.norm(dim=-1)
    assert rel.max() <= fmt.row_rel_bound(576)
    assert rel.mean() < fmt.rel_bound / 2  # a typical row sits well inside the worst case


def test_dequantize_returns_the_dtype_asked_for():
    values, scales = fp8.quantize(torch.randn(3, 2, 8), fp8.FORMATS["float8_e4m3"])
    assert fp8.dequantize(values, scales, torch.bfloat16).dtype == torch.bfloat16


def test_store_dtypes_are_the_dense_dtypes_and_the_fp8_codecs_with_their_sizes():
    assert STORE_DTYPES == {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3": 1, "float8_e5m2": 1}
    assert fp8.FORMATS["float8_e4m3"].rel_bound == 2**-4 and fp8.FORMATS["float8_e5m2"].rel_bound == 2**-3
    for fmt in FORMATS:
        assert fmt.max_finite == torch.finfo(fmt.torch_dtype).max
        assert 2.0**fmt.min_exponent == torch.finfo(fmt.torch_dtype).smallest_normal
