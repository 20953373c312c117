"""RMSNorm, optionally fused with the residual add, rounding as Hugging Face's LlamaRMSNorm:

    h   = x + residual                   (in the input dtype: the new residual)
    out = weight * (h * rsqrt(mean(h^2) + eps)).to(input dtype)     (statistics in fp32)

One program per row; the whole row is one tile.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.kernels._common import check, check_last_dim_contiguous, check_same_device, device_guard


@triton.jit
def normed_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, hidden, eps,
               stride_x, stride_res, stride_res_out,
               HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One row's RMSNorm output, weight * normed in fp32 before its rounding to the output dtype
    (masked lanes are 0), after the residual add, whose sum it stores. Returns (y, offs, mask).
    Shared by this kernel and rms_norm_quant_fp8's."""
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return normed * w, offs, mask


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    hidden, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y, offs, mask = normed_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, hidden, eps,
                               stride_x, stride_res, stride_res_out, HAS_RESIDUAL, BLOCK)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


class RMSNormResidual(NamedTuple):
    out: torch.Tensor  # rms_norm(x + residual)
    residual: torch.Tensor  # x + residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None) -> torch.Tensor | RMSNormResidual:
    """x: [T, H] (last dim contiguous); weight: [H]. Without residual returns the normed x
    (dtype of x); with residual returns RMSNormResidual(out, residual=x + residual)."""
    check(x.dim() == 2, f"x must be [num_tokens, hidden], got {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    check(weight.shape == (hidden,) and weight.is_contiguous(),
          f"weight must be contiguous [{hidden}], got {tuple(weight.shape)}")
    check_last_dim_contiguous("x", x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    check(out.shape == x.shape and out.dtype == x.dtype, "out must be like x")
    check_last_dim_contiguous("out", out)
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype,
              f"residual must be like x, got {residual.dtype} {tuple(residual.shape)}")
        check_last_dim_contiguous("residual", residual)
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        check(residual_out.shape == x.shape and residual_out.dtype == x.dtype,
              "residual_out must be like x")
        check_last_dim_contiguous("residual_out", residual_out)
        check_same_device(x=x, weight=weight, out=out, residual=residual,
                          residual_out=residual_out)
    else:
        check_same_device(x=x, weight=weight, out=out)
    res = residual if residual is not None else x
    res_out = residual_out if residual_out is not None else out
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        with device_guard(x):
            _rms_norm_kernel[(num_tokens,)](
                x, res, weight, out, res_out, hidden, eps,
                x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
                HAS_RESIDUAL=residual is not None, BLOCK=block,
                num_warps=min(max(block // 256, 1), 16),
            )
    if residual is None:
        return out
    assert residual_out is not None
    return RMSNormResidual(out, residual_out)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | RMSNormResidual:
    """Hugging Face LlamaRMSNorm (output cast to x's dtype)."""
    h = x if residual is None else x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * normed.to(x.dtype)).to(x.dtype)
    return out if residual is None else RMSNormResidual(out, h)
