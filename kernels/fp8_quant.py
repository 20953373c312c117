"""Activations to FP8 (e4m3) for an FP8 matmul (torch._scaled_mm), one launch per call.

One program per row (token) m of x [M, K]:

    dynamic (no scale given):  s[m] = max(amax(|x[m, :]|), MIN_AMAX) / 448   (per token)
    static (scale given):      s[m] = scale                                     (calibrated)
    q[m, k] = clamp(x[m, k] / s[m], -448, 448) in e4m3, rounded to nearest even

so that x ~= q * s[:, None], the row-wise scale_a _scaled_mm takes. The dynamic pass reads the
row twice (amax, then quantize), BLOCK_K elements at a time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.kernels._common import (
    FP8_DTYPE,
    FP8_MAX,
    check,
    check_last_dim_contiguous,
    check_same_device,
    device_guard,
)

MIN_AMAX = 1e-6  # an all-zero row gets a tiny scale, not a division by zero
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


class Fp8Rows(NamedTuple):
    """Token rows in e4m3 with their scales: x[m] ~= q[m] * scale[m]."""

    q: torch.Tensor  # e4m3 [M, K], contiguous
    scale: torch.Tensor  # fp32 [M, 1] (the row-wise scale_a of torch._scaled_mm)


@triton.jit
def fp8_row_scale(amax):
    """A row's dynamic scale from its amax (fp32 scalar); shared with the fused kernels."""
    return tl.div_rn(tl.maximum(amax, _MIN_AMAX), _FP8_MAX)


@triton.jit
def to_fp8(x, s, fp8_ty: tl.constexpr):
    """fp32 x / s saturated to e4m3's range, rounded to nearest even."""
    return tl.minimum(tl.maximum(tl.div_rn(x, s), -_FP8_MAX), _FP8_MAX).to(fp8_ty)


@triton.jit
def store_fp8_row(y, offs, mask, q_row_ptr, s_ptr, static_ptr):
    """A whole row y (fp32 [BLOCK], 0 where masked) quantized: its scale (static_ptr's, else
    from its amax) stored at s_ptr, its e4m3 values at q_row_ptr + offs; for the fused
    kernels, which hold their row in registers."""
    if static_ptr is not None:
        s = tl.load(static_ptr)
    else:
        s = fp8_row_scale(tl.max(tl.abs(y), 0))
    tl.store(s_ptr, s)
    tl.store(q_row_ptr + offs, to_fp8(y, s, q_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr,
    num_cols, stride_xm, stride_qm,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    offs = tl.arange(0, BLOCK_K)
    if static_ptr is not None:
        s = tl.load(static_ptr)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, num_cols, BLOCK_K):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < num_cols, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        s = fp8_row_scale(tl.max(amax, 0))
    tl.store(s_ptr + row, s)
    for k0 in range(0, num_cols, BLOCK_K):
        mask = k0 + offs < num_cols
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_qm + k0 + offs, to_fp8(x, s, q_ptr.dtype.element_ty),
                 mask=mask)


def quant_fp8(x: torch.Tensor, scale: torch.Tensor | None = None) -> Fp8Rows:
    """x: [M, K] (last dim contiguous, any float dtype); scale: a static fp32 scale of one
    element, or None for per-token scales. Returns Fp8Rows(q e4m3 [M, K], s fp32 [M, 1])."""
    check(x.dim() == 2, f"x must be [M, K], got {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    check_static_scale(scale)
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    check_same_device(x=x, **({} if scale is None else {"scale": scale}))
    if m == 0:
        return Fp8Rows(q, s)
    block_k = min(triton.next_power_of_2(k), 4096)
    with device_guard(x):
        _quant_fp8_kernel[(m,)](x, q, s, scale, k, x.stride(0), q.stride(0), BLOCK_K=block_k,
                                num_warps=4 if block_k <= 1024 else 8)
    return Fp8Rows(q, s)


def check_static_scale(scale: torch.Tensor | None) -> None:
    check(scale is None or (scale.dtype == torch.float32 and scale.numel() == 1),
          "scale must be one fp32 element")


def quant_fp8_ref(x: torch.Tensor, scale: torch.Tensor | None = None) -> Fp8Rows:
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX)
        # A tensor divisor: torch on CUDA turns division by a Python number into multiplication
        # by its reciprocal, an ulp away from the correctly rounded quotient the kernel takes.
        s = amax / torch.full_like(amax, FP8_MAX)
    else:
        s = scale.reshape(1, 1).expand(x.shape[0], 1).float()
    q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Rows(q, s.contiguous())
