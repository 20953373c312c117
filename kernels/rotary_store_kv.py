"""Rotary embedding of q and k (Neox style, in place) fused with the store of the rotated k and
of v into their slots of the paged caches: one launch where rotary_embedding + store_kv took
two, and k is read once.

One program per token t, over the strided head views of the qkv projection:

    qkv row t   [ q: Hq x D | k: Hkv x D | v: Hkv x D ]
                  rotate      rotate, write back, and to k_cache[slot // bs, slot % bs]
                                                    copy to v_cache[slot // bs, slot % bs]

The rotation is kernels/rotary_embedding.py's (cos_sin_cache row p = [cos | sin], x1' =
x1 cos - x2 sin, x2' = x2 cos + x1 sin in fp32, rounded once to k's dtype); the cache gets that
rounded k (quantized as store_kv quantizes it for an FP8 cache), so the result equals
rotary_embedding followed by store_kv. Slot -1 (CUDA-graph padding) still rotates q and k but
stores nothing.

A decode step has one token a sequence, so a program's time is its memory latencies. Every load
comes before the first store: a load placed after a store issues only once that store's data is
ready (the compiler cannot prove they do not alias), which chained q, k, the FP8 scales and v
one latency after another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import check, check_last_dim_contiguous, check_same_device, device_guard
from tandem.kernels.rotary_embedding import check_rotary_args, load_cos_sin, rotary_embedding_ref
from tandem.kernels.store_kv import check_store_kv_args, load_scale, quantize, store_kv_ref


# The step's positions and slots are views at offsets that vary with its token count: no
# specialisation on their alignment (one compiled variant; see paged_prefill_attention.py).
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rotary_store_kv_kernel(
    pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, cache_ptr,
    k_scale_ptr, v_scale_ptr,
    num_q_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    stride_cache,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_TAIL: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    keep = slot >= 0
    slot = tl.maximum(slot, 0)  # padding: any in-bounds address, every store masked off
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < HALF
    offs_h = tl.arange(0, BLOCK_HK)
    h_mask = offs_h < num_kv_heads

    # Loads: q's and k's halves, k's unrotated tail, v, the FP8 scales, cos and sin.
    offs_hq = tl.arange(0, BLOCK_HQ)
    q_mask = (offs_hq[:, None] < num_q_heads) & r_mask[None, :]
    q1_ptr = q_ptr + token * stride_qt + offs_hq[:, None] * stride_qh + offs_r[None, :]
    q1 = tl.load(q1_ptr, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q1_ptr + HALF, mask=q_mask, other=0.0).to(tl.float32)
    k_row = k_ptr + token * stride_kt + offs_h[:, None] * stride_kh  # [BLOCK_HK, 1]
    mask = h_mask[:, None] & r_mask[None, :]
    x1 = tl.load(k_row + offs_r[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_row + HALF + offs_r[None, :], mask=mask, other=0.0).to(tl.float32)
    offs_t = 2 * HALF + tl.arange(0, BLOCK_TAIL)
    t_mask = h_mask[:, None] & (offs_t < HEAD_DIM)[None, :] & keep
    if 2 * HALF < HEAD_DIM:  # partial rotary: the rest of k goes to the cache as it is
        tail = tl.load(k_row + offs_t[None, :], mask=t_mask)
    offs_d = tl.arange(0, BLOCK_D)
    v_mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :] & keep
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=v_mask)
    k_s = load_scale(k_scale_ptr, offs_h, h_mask)
    v_s = load_scale(v_scale_ptr, offs_h, h_mask)
    cos, sin = load_cos_sin(cache_ptr, pos, stride_cache, offs_r, r_mask, HALF)

    # Stores: q and k rotated in place, k and v to their slot.
    tl.store(q1_ptr, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q1_ptr + HALF, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    o1 = (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty)
    o2 = (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty)
    tl.store(k_row + offs_r[None, :], o1, mask=mask)
    tl.store(k_row + HALF + offs_r[None, :], o2, mask=mask)
    kc_row = (k_cache_ptr + block * stride_kcb + offset * stride_kct
              + offs_h[:, None] * stride_kch)
    tl.store(kc_row + offs_r[None, :], quantize(o1, k_s, k_scale_ptr, k_cache_ptr),
             mask=mask & keep)
    tl.store(kc_row + HALF + offs_r[None, :], quantize(o2, k_s, k_scale_ptr, k_cache_ptr),
             mask=mask & keep)
    if 2 * HALF < HEAD_DIM:
        tl.store(kc_row + offs_t[None, :], quantize(tail, k_s, k_scale_ptr, k_cache_ptr),
                 mask=t_mask)
    vc = (v_cache_ptr + block * stride_vcb + offset * stride_vct + offs_h[:, None] * stride_vch
          + offs_d[None, :])
    tl.store(vc, quantize(v, v_s, v_scale_ptr, v_cache_ptr), mask=v_mask)


def rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Rotate q and k in place, then write k and v into their cache slots.

    positions: int32/int64 [T] (contiguous); q: [T, Hq, D], k, v: [T, Hkv, D] (strided views of
    a qkv projection fine: last dim contiguous); cos_sin_cache: fp32 [max_pos, R], R even
    <= D; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (strided pool views fine);
    slot_mapping: contiguous int64 [T], -1 = store nothing for that token; k_scale, v_scale:
    fp32 [Hkv], for FP8 caches only (see store_kv).
    """
    check_rotary_args(positions, q, k, cos_sin_cache)
    check_store_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check(positions.is_contiguous(), "positions must be contiguous")
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("cos_sin_cache", cos_sin_cache)
    check_same_device(positions=positions, q=q, k=k, v=v, cos_sin_cache=cos_sin_cache,
                      k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    block_r = triton.next_power_of_2(half)
    block_hq = triton.next_power_of_2(num_q_heads)
    with device_guard(q):
        _rotary_store_kv_kernel[(num_tokens,)](
            positions, slot_mapping, q, k, v, k_cache, v_cache, cos_sin_cache,
            k_scale, v_scale, num_q_heads, k.shape[1],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            cos_sin_cache.stride(0),
            HALF=half, HEAD_DIM=head_dim, BLOCK_R=block_r, BLOCK_HQ=block_hq,
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_TAIL=triton.next_power_of_2(max(1, head_dim - rotary_dim)),
            BLOCK_SIZE=k_cache.shape[1],
            num_warps=4 if block_hq * block_r <= 2048 else 8,
        )


def rotary_store_kv_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> None:
    """The two kernels' references in sequence: rotary_embedding, then store_kv."""
    rotary_embedding_ref(positions, q, k, cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
