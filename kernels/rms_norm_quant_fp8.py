"""RMSNorm (optionally with the residual add) and per-token FP8 (e4m3) quantization in one pass,
for a norm whose output only feeds an FP8 matmul (torch._scaled_mm): the normed row never goes
to memory in bf16.

One program per row; the whole row is one tile, as in rms_norm.py, whose row arithmetic it
shares (`normed_row`), so that the result is the unfused pair's (rms_norm then quant_fp8):

    h   = x + residual                        (in the input dtype: the new residual, stored)
    y   = weight * (h * rsqrt(mean(h^2) + eps)).to(dtype), rounded to dtype (the norm's output)
    s   = max(amax(|y|), MIN_AMAX) / 448      (per token; or the static scale when given)
    q   = clamp(y / s, -448, 448) in e4m3, rounded to nearest even

Reads x (and residual) once, writes the residual, q (one byte an element) and s.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.kernels._common import (
    FP8_DTYPE,
    check,
    check_last_dim_contiguous,
    check_same_device,
    device_guard,
)
from tandem.kernels.fp8_quant import check_static_scale, quant_fp8_ref, store_fp8_row
from tandem.kernels.rms_norm import RMSNormResidual, normed_row, rms_norm_ref


@triton.jit
def _rms_norm_quant_fp8_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, static_ptr,
    hidden, eps,
    stride_x, stride_res, stride_q, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y, offs, mask = normed_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, hidden, eps,
                               stride_x, stride_res, stride_res_out, HAS_RESIDUAL, BLOCK)
    # The norm's output as the unfused kernel would store it (masked lanes are 0).
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    store_fp8_row(y, offs, mask, q_ptr + row * stride_q, s_ptr + row, static_ptr)


class RMSNormFp8(NamedTuple):
    q: torch.Tensor  # e4m3 [T, H]: rms_norm(x [+ residual]) / scale
    scale: torch.Tensor  # fp32 [T, 1]
    residual: torch.Tensor | None  # x + residual in x's dtype, when a residual was given


def rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None, *,
                       scale: torch.Tensor | None = None) -> RMSNormFp8:
    """x: [T, H] (last dim contiguous); weight: [H]; scale: a static fp32 activation scale of
    one element, or None for per-token scales. Returns RMSNormFp8(q, scale, residual)."""
    check(x.dim() == 2, f"x must be [num_tokens, hidden], got {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    check(weight.shape == (hidden,) and weight.is_contiguous(),
          f"weight must be contiguous [{hidden}], got {tuple(weight.shape)}")
    check_last_dim_contiguous("x", x)
    check_static_scale(scale)
    extra = {} if scale is None else {"scale": scale}
    residual_out = None
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype,
              f"residual must be like x, got {residual.dtype} {tuple(residual.shape)}")
        check_last_dim_contiguous("residual", residual)
        check_same_device(x=x, weight=weight, residual=residual, **extra)
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        check_same_device(x=x, weight=weight, **extra)
    q = torch.empty((num_tokens, hidden), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    res = residual if residual is not None else x
    res_out = residual_out if residual_out is not None else x  # not written without residual
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        with device_guard(x):
            _rms_norm_quant_fp8_kernel[(num_tokens,)](
                x, res, weight, q, s, res_out, scale, hidden, eps,
                x.stride(0), res.stride(0), q.stride(0), res_out.stride(0),
                HAS_RESIDUAL=residual is not None, BLOCK=block,
                num_warps=min(max(block // 256, 1), 16),  # rms_norm.py's: the same sum order
            )
    return RMSNormFp8(q, s, residual_out)


def rms_norm_quant_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           residual: torch.Tensor | None = None, *,
                           scale: torch.Tensor | None = None) -> RMSNormFp8:
    """The unfused pair in torch: rms_norm_ref, then quant_fp8_ref of its output."""
    normed = rms_norm_ref(x, weight, eps, residual)
    out, res = (normed.out, normed.residual) if isinstance(normed, RMSNormResidual) \
        else (normed, None)
    q, s = quant_fp8_ref(out, scale)
    return RMSNormFp8(q, s, res)
