"""SwiGLU (silu(gate) * up) and per-token FP8 (e4m3) quantization in one kernel, for an
activation whose output only feeds an FP8 matmul (torch._scaled_mm, the down projection): the
[T, I] product never goes to memory in bf16.

One program per row of x = [gate | up] [T, 2I]. Up to MAX_BLOCK columns (every Llama-class
intermediate size) the row is one tile, held in registers from its one read to its store:

    y = (silu(gate).to(dtype) * up).to(dtype)     s = max(max |y|, MIN_AMAX) / 448 (or static)
    q = clamp(y / s, -448, 448) in e4m3, rounded to nearest even

with silu_and_mul.py's rounding, so the result is the unfused pair's (silu_and_mul then
quant_fp8), and x is read once where the pair reads x, writes y and reads y again. Wider rows
loop over BLOCK columns twice: once for the amax, once (y computed again) for q.
"""

from __future__ import annotations

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
from tandem.kernels.fp8_quant import (
    Fp8Rows,
    check_static_scale,
    fp8_row_scale,
    quant_fp8_ref,
    store_fp8_row,
    to_fp8,
)
from tandem.kernels.silu_and_mul import silu_and_mul_ref

MAX_BLOCK = 16384  # 32 fp32 elements of gate and of up per thread at 16 warps


@triton.jit
def _silu_mul(gate_ptr, up_ptr, offs, mask):
    """silu(gate) * up as silu_and_mul.py rounds it (each step to the input dtype), in fp32;
    0 where masked."""
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(gate_ptr.dtype.element_ty).to(tl.float32)
    return (act * up).to(gate_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr,
    inter, stride_x, stride_q,
    BLOCK: tl.constexpr, ONE_TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    gate_ptr = x_ptr + row * stride_x
    up_ptr = gate_ptr + inter
    offs = tl.arange(0, BLOCK)
    if ONE_TILE:  # inter <= BLOCK: y stays in registers
        mask = offs < inter
        store_fp8_row(_silu_mul(gate_ptr, up_ptr, offs, mask), offs, mask,
                      q_ptr + row * stride_q, s_ptr + row, static_ptr)
    else:
        if static_ptr is not None:
            s = tl.load(static_ptr)
        else:
            amax = tl.zeros([BLOCK], tl.float32)
            for k0 in range(0, inter, BLOCK):
                y = _silu_mul(gate_ptr, up_ptr, k0 + offs, k0 + offs < inter)
                amax = tl.maximum(amax, tl.abs(y))
            s = fp8_row_scale(tl.max(amax, 0))
        tl.store(s_ptr + row, s)
        for k0 in range(0, inter, BLOCK):
            mask = k0 + offs < inter
            y = _silu_mul(gate_ptr, up_ptr, k0 + offs, mask)
            tl.store(q_ptr + row * stride_q + k0 + offs, to_fp8(y, s, q_ptr.dtype.element_ty),
                     mask=mask)


def silu_and_mul_quant_fp8(x: torch.Tensor, scale: torch.Tensor | None = None, *,
                           block: int | None = None, num_warps: int | None = None) -> Fp8Rows:
    """x: [T, 2I] (last dim contiguous); scale: a static fp32 activation scale of one element,
    or None for per-token scales. Returns Fp8Rows(q e4m3 [T, I], s fp32 [T, 1]).

    block, num_warps: the launch's shape (a power of two; benchmarks/kernels/fp8_fused_quant.py
    --sweep times others); default: the row in one tile up to MAX_BLOCK, block / 512 warps
    within [4, 16]."""
    check(x.dim() == 2 and x.shape[1] % 2 == 0,
          f"x must be [num_tokens, 2 * intermediate], got {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    check_static_scale(scale)
    check_same_device(x=x, **({} if scale is None else {"scale": scale}))
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    q = torch.empty((num_tokens, inter), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    block = block or min(triton.next_power_of_2(max(inter, 1)), MAX_BLOCK)
    check(block & (block - 1) == 0, f"block must be a power of two, got {block}")
    if num_tokens and inter:
        with device_guard(x):
            _silu_and_mul_quant_fp8_kernel[(num_tokens,)](
                x, q, s, scale, inter, x.stride(0), q.stride(0), BLOCK=block,
                ONE_TILE=inter <= block, num_warps=num_warps or min(max(block // 512, 4), 16))
    return Fp8Rows(q, s)


def silu_and_mul_quant_fp8_ref(x: torch.Tensor, scale: torch.Tensor | None = None) -> Fp8Rows:
    """The unfused pair in torch: silu_and_mul_ref, then quant_fp8_ref of its output."""
    return quant_fp8_ref(silu_and_mul_ref(x), scale)
