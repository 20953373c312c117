"""The fused norm + FP8 and activation + FP8 kernels give what the unfused pairs the model ran
before give, byte for byte: the Triton pair (rms_norm then quant_fp8; silu_and_mul then
quant_fp8). Against the torch references (norm or activation, then quant_fp8_ref) they agree
within what the references' own norm and activation arithmetic allows (assert_close_to_reference).
"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import (
    quant_fp8,
    rms_norm,
    rms_norm_quant_fp8,
    rms_norm_quant_fp8_ref,
    silu_and_mul,
    silu_and_mul_quant_fp8,
    silu_and_mul_quant_fp8_ref,
)
from tandem.kernels._common import FP8_MAX

DTYPES = [torch.float32, torch.bfloat16]


def e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many e4m3 values apart a and b are (sign-magnitude bytes)."""
    def ordinal(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.uint8).to(torch.int32)
        mag = bits & 0x7F
        return torch.where(bits & 0x80 != 0, -mag, mag)

    return (ordinal(a) - ordinal(b)).abs()


def assert_same_bytes(got, want, seed):  # type: ignore[no-untyped-def]
    assert torch.equal(got.scale, want.scale), f"seed={seed}"
    assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8)), f"seed={seed}"


def assert_close_to_reference(got, want, dtype, seed):  # type: ignore[no-untyped-def]
    """Against the torch references the kernels' own norm or activation may round a row's
    largest element differently (an fp32 step in float32; in bfloat16 a bf16 step or two, the
    normed value being rounded before and after the weight), moving the row's scale by as
    much: scales within that, each element within one e4m3 step where the scales agree to an
    fp32 step, dequantized values within two e4m3 steps (2^-3 relative) where they do not."""
    assert got.q.shape == want.q.shape and got.scale.shape == want.scale.shape
    rtol = 2**-6 if dtype == torch.bfloat16 else 2**-20
    torch.testing.assert_close(got.scale, want.scale, rtol=rtol, atol=0,
                               msg=lambda m: f"seed={seed}\n{m}")
    same = ((got.scale - want.scale).abs() <= want.scale * 2**-20).squeeze(1)
    assert e4m3_steps(got.q[same], want.q[same]).max().item() <= 1, f"seed={seed}"
    a, b = (r.q[~same].float() * r.scale[~same] for r in (got, want))
    assert torch.all((a - b).abs() <= b.abs() * 2**-3 + want.scale[~same] * 2**-8), f"seed={seed}"


def _rows(t: int, h: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rows of very different magnitudes (per-token scales matter), one of them all zero,
    with a row stride other than h."""
    base = torch.randn(t, h + 16, device=device) * torch.logspace(-2, 2, t, device=device)[:, None]
    base[1] = 0.0
    return base.to(dtype)[:, 8:8 + h]


# -- RMSNorm + quantization ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("hidden", [64, 200])
def test_rms_norm_quant_equals_the_unfused_pair(seed, device, dtype, with_residual, hidden):
    x = _rows(6, hidden, dtype, device)
    residual = torch.randn(6, hidden, device=device).to(dtype) if with_residual else None
    weight = (torch.rand(hidden, device=device) + 0.5).to(dtype)
    x0 = x.clone()
    got = rms_norm_quant_fp8(x, weight, 1e-5, residual)
    normed = rms_norm(x, weight, 1e-5, residual)
    out = normed.out if with_residual else normed
    assert_same_bytes(got, quant_fp8(out), seed)
    assert_close_to_reference(got, rms_norm_quant_fp8_ref(x, weight, 1e-5, residual), dtype,
                              seed)
    if with_residual:
        assert torch.equal(got.residual, normed.residual), f"seed={seed}"
        assert torch.equal(got.residual, x0 + residual), f"seed={seed}"
    else:
        assert got.residual is None
    assert torch.equal(x, x0), "x was modified"
    # Each nonzero row's largest element maps to e4m3's max; the zero row (no residual added)
    # stays zero.
    amax = got.q.float().abs().amax(1)
    assert torch.all(amax[[0, 2, 3, 4, 5]] == FP8_MAX), f"seed={seed}"
    assert amax[1] == (FP8_MAX if with_residual else 0.0), f"seed={seed}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rms_norm_quant_static_scale_saturates(seed, device, dtype):
    x = torch.randn(4, 96, device=device).to(dtype)
    x[2, 5] = 1e3  # normed to ~sqrt(96): far beyond 448 * 0.005
    residual = torch.randn(4, 96, device=device).to(dtype)
    weight = torch.ones(96, device=device, dtype=dtype)
    scale = torch.tensor([0.005], device=device)
    got = rms_norm_quant_fp8(x, weight, 1e-6, residual, scale=scale)
    assert torch.all(got.scale == 0.005)
    assert got.q[2, 5].float() == FP8_MAX
    normed = rms_norm(x, weight, 1e-6, residual)
    assert_same_bytes(got, quant_fp8(normed.out, scale), seed)
    ref = rms_norm_quant_fp8_ref(x, weight, 1e-6, residual, scale=scale)
    assert torch.equal(got.scale, ref.scale)
    assert_close_to_reference(got, ref, dtype, seed)


def test_rms_norm_quant_checks_its_arguments(device):
    x = torch.randn(3, 64, device=device)
    w = torch.ones(64, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_quant_fp8(x, torch.ones(32, device=device), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_quant_fp8(x, w, 1e-5, torch.randn(3, 32, device=device))
    with pytest.raises(ValueError, match="scale"):
        rms_norm_quant_fp8(x, w, 1e-5, scale=torch.ones(2, device=device))
    empty = rms_norm_quant_fp8(x[:0], w, 1e-5)
    assert empty.q.shape == (0, 64) and empty.scale.shape == (0, 1)


# -- SiLU-and-mul + quantization -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("inter", [64, 300])
@pytest.mark.parametrize("block", [None, 64], ids=["one-tile", "chunked"])
def test_silu_and_mul_quant_equals_the_unfused_pair(seed, device, dtype, inter, block):
    x = _rows(6, 2 * inter, dtype, device) * 4
    got = silu_and_mul_quant_fp8(x, block=block)  # 64 < inter: both passes loop over chunks
    assert_same_bytes(got, quant_fp8(silu_and_mul(x)), seed)
    assert_close_to_reference(got, silu_and_mul_quant_fp8_ref(x), dtype, seed)
    amax = got.q.float().abs().amax(1)
    assert torch.all(amax[[0, 2, 3, 4, 5]] == FP8_MAX) and amax[1] == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block", [None, 64], ids=["one-tile", "chunked"])
def test_silu_and_mul_quant_static_scale(seed, device, dtype, block):
    x = torch.randn(5, 2 * 96, device=device).to(dtype)
    x[3, 7], x[3, 96 + 7] = 30.0, 100.0  # silu(30) * 100 = 3000 > 448 * 0.5: saturates
    scale = torch.tensor([0.5], device=device)
    got = silu_and_mul_quant_fp8(x, scale, block=block)
    assert torch.all(got.scale == 0.5) and got.q[3, 7].float() == FP8_MAX
    assert_same_bytes(got, quant_fp8(silu_and_mul(x), scale), seed)
    assert_close_to_reference(got, silu_and_mul_quant_fp8_ref(x, scale), dtype, seed)


def test_silu_and_mul_quant_checks_its_arguments(device):
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul_quant_fp8(torch.randn(3, 65, device=device))
    with pytest.raises(ValueError, match="scale"):
        silu_and_mul_quant_fp8(torch.randn(3, 64, device=device),
                               torch.ones(1, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="block must be a power of two"):
        silu_and_mul_quant_fp8(torch.randn(3, 64, device=device), block=48)
