"""SwiGLU activation: x = [gate | up] along the last dim -> silu(gate) * up, rounding as
torch does for F.silu(gate) * up (silu rounded to the dtype, then the product)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import check, check_last_dim_contiguous, check_same_device, device_guard


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2I] (last dim contiguous) -> [T, I]."""
    check(x.dim() == 2 and x.shape[1] % 2 == 0,
          f"x must be [num_tokens, 2 * intermediate], got {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    check(out.shape == (num_tokens, inter) and out.dtype == x.dtype,
          f"out must be [{num_tokens}, {inter}] {x.dtype}")
    check_last_dim_contiguous("out", out)
    check_same_device(x=x, out=out)
    if num_tokens and inter:
        block = min(1024, triton.next_power_of_2(inter))
        with device_guard(x):
            _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
                x, out, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]
