"""The scales of a W8A8 product applied after the matmul, one launch:

    y[m, n] = acc[m, n] * row_scale[m] * col_scale[n] (+ bias[n])

acc is the unscaled product of e4m3 operands (torch._scaled_mm with scales of 1, which runs
cuBLASLt's tensor-wise FP8 GEMM), row_scale the activations' per-token scales and col_scale the
weight's per-channel scales. Together they compute what a row-wise scaled _scaled_mm computes,
faster where that one's kernel is slow (engine/quantization/fp8.py says where). The scales are
applied in fp32 to acc's value and y rounded once to out's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import check, check_same_device, device_guard


@triton.jit
def _scale_product_kernel(acc_ptr, row_ptr, col_ptr, bias_ptr, out_ptr, n_cols,
                          stride_acc, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    acc = tl.load(acc_ptr + row * stride_acc + offs, mask=mask, other=0.0).to(tl.float32)
    y = acc * tl.load(row_ptr + row) * tl.load(col_ptr + offs, mask=mask, other=0.0)
    if bias_ptr is not None:
        y += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_scale_product(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                      bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """acc [M, N] (fp32 or bf16, rows contiguous), row_scale fp32 [M, 1] or [M], col_scale
    fp32 [N], bias [N] or None -> y [M, N] in dtype (written over acc when acc has that dtype)."""
    check(acc.dim() == 2 and acc.stride(1) == 1,
          f"acc must be [M, N] with contiguous rows, got {tuple(acc.shape)}")
    m, n = acc.shape
    check(row_scale.dtype == torch.float32 and row_scale.numel() == m
          and row_scale.is_contiguous(), f"row_scale must be {m} contiguous fp32 scales")
    check(col_scale.dtype == torch.float32 and col_scale.numel() == n
          and col_scale.is_contiguous(), f"col_scale must be {n} contiguous fp32 scales")
    check(bias is None or (bias.numel() == n and bias.is_contiguous()),
          f"bias must be {n} contiguous values")
    check_same_device(acc=acc, row_scale=row_scale, col_scale=col_scale,
                      **({} if bias is None else {"bias": bias}))
    out = acc if acc.dtype == dtype else torch.empty(m, n, dtype=dtype, device=acc.device)
    if m and n:
        block = min(2048, triton.next_power_of_2(n))
        with device_guard(acc):
            _scale_product_kernel[(m, triton.cdiv(n, block))](
                acc, row_scale, col_scale, bias, out, n, acc.stride(0), out.stride(0),
                BLOCK=block, num_warps=4)
    return out


def fp8_scale_product_ref(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                          bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    y = acc.float() * row_scale.reshape(-1, 1) * col_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)
