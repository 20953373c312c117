"""Rotary position embedding, Neox style (rotate halves), in place on q and k.

cos_sin_cache: [max_position, R] fp32, R = rotary dim (the head dim for the supported models):

    row p = [ cos(p * f_0) ... cos(p * f_{R/2-1}) | sin(p * f_0) ... sin(p * f_{R/2-1}) ]

For each head vector x (first R dims; any rest is left alone), x1 = x[:R/2], x2 = x[R/2:R]:
    x1' = x1 * cos - x2 * sin,    x2' = x2 * cos + x1 * sin        (in fp32, rounded once)
Scaling schemes (linear, llama3) only change the cache's contents.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import check, check_last_dim_contiguous, check_same_device, device_guard


@triton.jit
def load_cos_sin(cache_ptr, pos, stride_cache, offs_r, r_mask, HALF: tl.constexpr):
    """Row `pos` of the [max_pos, 2 * HALF] cos|sin cache, each as [1, BLOCK_R]; shared with
    kernels/rotary_store_kv.py."""
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + offs_r, mask=r_mask, other=0.0)[None, :]
    sin = tl.load(row + HALF + offs_r, mask=r_mask, other=0.0)[None, :]
    return cos, sin


@triton.jit
def rotate_heads(x_ptr, token, num_heads, stride_t, stride_h, cos, sin, offs_h, offs_r, r_mask,
                 HALF: tl.constexpr):
    """In place on one token's heads of x."""
    mask = (offs_h[:, None] < num_heads) & r_mask[None, :]
    p1 = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_r[None, :]
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr,
    num_q_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < HALF
    cos, sin = load_cos_sin(cache_ptr, pos, stride_cache, offs_r, r_mask, HALF)
    rotate_heads(q_ptr, token, num_q_heads, stride_qt, stride_qh, cos, sin,
                 tl.arange(0, BLOCK_HQ), offs_r, r_mask, HALF)
    rotate_heads(k_ptr, token, num_kv_heads, stride_kt, stride_kh, cos, sin,
                 tl.arange(0, BLOCK_HK), offs_r, r_mask, HALF)


def check_rotary_args(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      cos_sin_cache: torch.Tensor) -> None:
    """Shapes and dtypes of rotary_embedding's arguments (also rotary_store_kv's)."""
    check(q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2],
          f"q must be [T, Hq, D] and k [T, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    check(positions.shape == (q.shape[0],) and positions.dtype in (torch.int32, torch.int64),
          f"positions must be int32/int64 [T], got {positions.dtype} {tuple(positions.shape)}")
    rot = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    check(cos_sin_cache.dim() == 2 and cos_sin_cache.dtype == torch.float32
          and rot % 2 == 0 and rot <= q.shape[2],
          f"cos_sin_cache must be fp32 [max_pos, rotary_dim <= {q.shape[2]}] (even), got "
          f"{cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")
    check(q.dtype == k.dtype, f"q and k dtypes differ: {q.dtype}, {k.dtype}")


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """In place. positions: int [T] (contiguous); q: [T, Hq, D], k: [T, Hkv, D] (strided views
    of a qkv projection fine: last dim contiguous); cos_sin_cache: fp32 [max_pos, R]."""
    check_rotary_args(positions, q, k, cos_sin_cache)
    check(positions.is_contiguous(), "positions must be contiguous")
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[1] // 2
    block_r = triton.next_power_of_2(half)
    block_hq = triton.next_power_of_2(q.shape[1])
    with device_guard(q):
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos_sin_cache,
            q.shape[1], k.shape[1],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            HALF=half, BLOCK_R=block_r, BLOCK_HQ=block_hq,
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            num_warps=4 if block_hq * block_r <= 2048 else 8,
        )


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> None:
    """In place, like rotary_embedding."""
    check_rotary_args(positions, q, k, cos_sin_cache)
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin  # both before writing: x1 may alias x
        x[..., :half] = o1.to(x.dtype)
        x[..., half:2 * half] = o2.to(x.dtype)
