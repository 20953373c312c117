"""Weight-only FP8 matmul for a few token rows (decode steps):

    y[M, N] = x[M, K] @ (W_q[N, K] * s_w[N, None])^T (+ b[N])

W_q e4m3 with one fp32 scale per output channel; x in bf16, fp16 or fp32 stays in its dtype
(no activation quantization); fp32 accumulation, y in x's dtype. The per-channel scale is
applied once to the accumulated row: y[m, n] = s_w[n] * sum_k x[m, k] * W_q[n, k] (+ b[n]).

At M <= 16 the step is bound by reading W_q (1 byte an element), so each program owns a
BLOCK_N slice of output channels and streams K in BLOCK_K tiles of it, converting e4m3 in
registers (e4m3 is exact in bf16, fp16 and fp32):

    grid = (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))

  - M == 1 (BLOCK_M = 1): a GEMV on the CUDA cores. Each thread loads 16 contiguous weight
    bytes a row (two K tiles an iteration) and keeps a [BLOCK_N, BLOCK_K] fp32 accumulator of
    products, reduced over K once at the end (no cross-thread reduction inside the loop).
  - M > 1 (BLOCK_M = 16, tl.dot's smallest tile): the transposed product acc[BLOCK_N, 16] +=
    W_tile[BLOCK_N, BLOCK_K] @ x_tile^T[BLOCK_K, 16] on the tensor cores in x's dtype (fp32 for
    fp32 x, and always under TRITON_INTERPRET=1, whose tl.dot cannot multiply bf16), rows past
    M masked to zero. One pass over W_q serves up to 16 rows; more rows re-read it per 16-row
    tile, which is why engine/quantization/fp8.py sends M > 16 to torch._scaled_mm.

No split-K: N >= 4096 for every Llama-3.1-8B projection, and the launcher halves BLOCK_N (down
to 8 for M == 1, 16 for tl.dot) until there are at least programs_per_sm programs per SM, so
the weight stream is spread over every SM without a second (reduction) launch. M varies
between steps and is not specialised on: two variants per (N, K, dtype), M == 1 and M > 1,
both compiled at start-up (engine/warm_up.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.kernels._common import (
    FP8_DTYPE,
    INTERPRET,
    check,
    check_last_dim_contiguous,
    check_same_device,
    device_guard,
    num_sms,
)


class Fp8GemvConfig(NamedTuple):
    """Tile sizes (benchmarks/kernels/fp8_gemv.py overrides them). block_n is the widest slice of
    output channels a program owns; the launcher halves it while cdiv(N, block_n) is below
    programs_per_sm * SMs. gemv_*: the M == 1 path; dot_*: M > 1, 16 rows a tile."""

    gemv_block_n: int = 16
    gemv_block_k: int = 512  # 16 weight bytes a thread, a warp a row: 512-byte row segments
    dot_block_n: int = 32
    dot_block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 4


DEFAULT_CONFIG = Fp8GemvConfig()
DOT_BLOCK_M = 16  # tl.dot's smallest dimension
_MIN_BLOCK_N = {1: 8, DOT_BLOCK_M: 16}


# M varies step to step (and M == 1 or a multiple of 16 would otherwise be its own variant). The
# row strides stay specialised: they are K and N for the model's contiguous activations, and
# their divisibility by 16 lets x's loads vectorise.
@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
    if BLOCK_M == 1:
        row = pid_m.to(tl.int64)
        x_row = x_ptr + row * stride_xm
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        # Two K tiles an iteration, both loads issued before either is used: twice the bytes in
        # flight (these loads are not software-pipelined: only tl.dot's operands are). x is
        # loaded 1-D and broadcast: a [1, BLOCK_K] load would impose its layout on the weight
        # tile (a shared-memory round trip of the tile, not of x).
        for k0 in range(0, K, 2 * BLOCK_K):
            ka = k0 + offs_k
            kb = ka + BLOCK_K
            wa = tl.load(w_rows + ka[None, :], mask=n_mask[:, None] & (ka < K)[None, :],
                         other=0.0)
            wb = tl.load(w_rows + kb[None, :], mask=n_mask[:, None] & (kb < K)[None, :],
                         other=0.0)
            xa = tl.load(x_row + ka, mask=ka < K, other=0.0).to(tl.float32)
            xb = tl.load(x_row + kb, mask=kb < K, other=0.0).to(tl.float32)
            acc2 += wa.to(tl.float32) * xa[None, :] + wb.to(tl.float32) * xb[None, :]
        out = tl.sum(acc2, axis=1) * scale
        if b_ptr is not None:
            out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < K
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xt = tl.load(x_cols + k[:, None], mask=k_mask[:, None] & m_mask[None, :], other=0.0)
            if DOT_F32:
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(xt.dtype), xt, acc)
        out = acc * scale[:, None]
        if b_ptr is not None:
            out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        y = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        tl.store(y, out.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def _block_n(widest: int, smallest: int, n: int, min_programs: int) -> int:
    block = max(smallest, min(widest, triton.next_power_of_2(n)))
    while block > smallest and triton.cdiv(n, block) < min_programs:
        block //= 2
    return block


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, *, config: Fp8GemvConfig | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] bf16/fp16/fp32 (last dim contiguous); w: e4m3 [N, K] (last dim contiguous);
    w_scale: contiguous fp32 [N]; bias: contiguous [N] or None. Returns y [M, N] in x's dtype."""
    check(x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16, torch.float32),
          f"x must be bf16/fp16/fp32 [M, K], got {x.dtype} {tuple(x.shape)}")
    check(w.dim() == 2 and w.dtype == FP8_DTYPE and w.shape[1] == x.shape[1],
          f"w must be e4m3 [N, {x.shape[1]}], got {w.dtype} {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    check(w_scale.dtype == torch.float32 and w_scale.shape == (n,) and w_scale.is_contiguous(),
          f"w_scale must be contiguous fp32 [{n}], got {w_scale.dtype} {tuple(w_scale.shape)}")
    check(bias is None or (bias.shape == (n,) and bias.is_contiguous()),
          f"bias must be contiguous [{n}]")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("w", w)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    check(out.shape == (m, n) and out.dtype == x.dtype, f"out must be [{m}, {n}] {x.dtype}")
    check_last_dim_contiguous("out", out)
    check_same_device(x=x, w=w, w_scale=w_scale, out=out,
                      **({} if bias is None else {"bias": bias}))
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
    cfg = config or DEFAULT_CONFIG
    block_m = 1 if m == 1 else DOT_BLOCK_M
    widest, block_k = ((cfg.gemv_block_n, cfg.gemv_block_k) if block_m == 1
                       else (cfg.dot_block_n, cfg.dot_block_k))
    block_n = _block_n(widest, _MIN_BLOCK_N[block_m], n, cfg.programs_per_sm * num_sms(x.device))
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    with device_guard(x):
        _fp8_gemv_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
            x, w, w_scale, bias, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_F32=INTERPRET or x.dtype == torch.float32,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out


def fp8_gemv_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ (w.float() * w_scale[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
