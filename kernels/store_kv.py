"""Write the step's new K/V into their slots of the paged cache.

slot = block_id * block_size + offset; token t's [Hkv, D] rows go to
k_cache[slot // block_size, slot % block_size] (and likewise V). Slot -1 marks a padding token
(CUDA-graph padding) and is skipped.

FP8 caches (float8_e4m3fn) take per-KV-head fp32 scales and store clamp(x / scale) in e4m3
(kernels/_common.py); other caches store x in their own dtype and take no scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import (
    FP8_MAX,
    check,
    check_kv_scales,
    check_last_dim_contiguous,
    check_same_device,
    device_guard,
    quantize_fp8_ref,
)

_FP8_MAX = tl.constexpr(FP8_MAX)  # a jitted function reads globals only as constexprs


@triton.jit
def load_scale(scale_ptr, offs_h, h_mask):
    """The scales of KV heads offs_h, fp32 [BLOCK_H] (ones without scales: scale_ptr None)."""
    s = tl.full(offs_h.shape, 1.0, tl.float32)
    if scale_ptr is not None:
        s = tl.load(scale_ptr + offs_h, mask=h_mask, other=1.0)
    return s


@triton.jit
def quantize(x, s, scale_ptr, cache_ptr):
    """x [BLOCK_H, ...] (rows = KV heads, their scales s from load_scale) as the cache stores it:
    with scales (an FP8 cache), clamp(x / s[h]) in fp32, correctly rounded, then e4m3; else x in
    the cache's dtype. scale_ptr None is a compile-time branch. Load the scales before a
    kernel's first store: a load after a store waits for that store's data."""
    if scale_ptr is not None:
        x = tl.div_rn(x.to(tl.float32), s[:, None])
        x = tl.minimum(tl.maximum(x, -_FP8_MAX), _FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])  # a view at a varying offset
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_kv_heads, head_dim,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    t64 = t.to(tl.int64)

    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)
    kc = (k_cache_ptr + block * stride_kcb + offset * stride_kct + offs_h[:, None] * stride_kch
          + offs_d[None, :])
    vc = (v_cache_ptr + block * stride_vcb + offset * stride_vct + offs_h[:, None] * stride_vch
          + offs_d[None, :])
    h_mask = offs_h < num_kv_heads
    k_s = load_scale(k_scale_ptr, offs_h, h_mask)
    v_s = load_scale(v_scale_ptr, offs_h, h_mask)
    tl.store(kc, quantize(k, k_s, k_scale_ptr, k_cache_ptr), mask=mask)
    tl.store(vc, quantize(v, v_s, v_scale_ptr, v_cache_ptr), mask=mask)


def check_store_kv_args(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> None:
    """store_kv's argument contract (also rotary_store_kv's)."""
    check(k.dim() == 3 and k.shape == v.shape,
          f"k, v must both be [T, num_kv_heads, head_dim], got {tuple(k.shape)}, {tuple(v.shape)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape
          and tuple(k_cache.shape[2:]) == (num_kv_heads, head_dim),
          f"caches must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], got "
          f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    check(k.dtype == v.dtype and k_cache.dtype == v_cache.dtype,
          f"dtypes: k {k.dtype} v {v.dtype} k_cache {k_cache.dtype} v_cache {v_cache.dtype}")
    check(slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,)
          and slot_mapping.is_contiguous(),
          f"slot_mapping must be contiguous int64 [T], got {slot_mapping.dtype} "
          f"{tuple(slot_mapping.shape)}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    check_kv_scales(k_cache, num_kv_heads, k_scale=k_scale, v_scale=v_scale)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, Hkv, D] (views of a qkv projection fine: last dim contiguous);
    k_cache, v_cache: [num_blocks, block_size, Hkv, D] (strided pool views fine);
    slot_mapping: int64 [T], -1 = skip; k_scale, v_scale: fp32 [Hkv], for FP8 caches only."""
    check_store_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    with device_guard(k):
        _store_kv_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
            num_kv_heads, head_dim,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
            num_warps=4 if block_h * block_d <= 2048 else 8,
        )


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = x[keep]
        cache[blocks, offsets] = (quantize_fp8_ref(x, scale) if scale is not None
                                  else x.to(cache.dtype))
