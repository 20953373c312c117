"""Paged decode attention (one query token per sequence), GQA-aware, with split-KV.

One program owns one (sequence, KV head, split): it loads the GROUP query heads that share the
KV head as a [BLOCK_H >= 16, D] tile, so each KV token is read once for the whole group, and
walks its token range BLOCK_N tokens at a time, gathering them through the block table:

    tokens   t0 ................................ t0+BLOCK_N-1
    blocks   | bt[t0//bs] | bt[t0//bs + 1] | ...               (bs = block size, any power of 2)
    K tile   [D, BLOCK_N] <- k_cache[bt[t//bs], t%bs, kv_head, :]  (each token row: D contiguous)

    qk = q[BLOCK_H, D] @ K[D, BLOCK_N];  online softmax in fp32 (base 2);  acc += p @ V

Split-KV (flash-decoding): with few (sequence, KV head) pairs for the SMs, the context is cut
into NUM_SPLITS ranges of whole BLOCK_N tiles computed in parallel; each writes its normalised
partial output and log-sum-exp to a fp32 workspace, and a second kernel merges them. The split
length is computed per sequence in the kernel from seq_lens, so the grid depends on shapes only
(CUDA-graph friendly) and any NUM_SPLITS is correct for any context length.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._common import (
    check,
    check_interpretable,
    check_last_dim_contiguous,
    check_same_device,
    device_guard,
    is_pow2,
    num_sms,
)

LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    scale_log2,  # softmax scale * log2(e)
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_os, stride_oh, stride_osp,  # out [S, Hq, D] or workspace [S, Hq, NUM_SPLITS, D]
    stride_ls, stride_lh,  # lse workspace [S, Hq, NUM_SPLITS] (split stride 1)
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    if NUM_SPLITS == 1:
        start = 0
        end = seq_len
    else:
        # Whole tiles per split so that only the last tile of a sequence is ragged.
        split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
        if start >= seq_len:
            return  # the merge kernel ignores splits past the context

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h

    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh
                + offs_d[None, :], mask=head_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh

    for tile_start in range(start, end, BLOCK_N):
        t = tile_start + offs_n
        t_mask = t < end
        block = tl.load(bt_row + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot = t % BLOCK_SIZE
        k_off = block * stride_kb + slot * stride_kt
        k = tl.load(k_base + k_off[None, :] + offs_d[:, None], mask=t_mask[None, :], other=0.0)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
        qk = tl.where(t_mask[None, :], qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_off = block * stride_vb + slot * stride_vt
        v = tl.load(v_base + v_off[:, None] + offs_d[None, :], mask=t_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # seq_len 0 (padding rows) leaves l_i at 0: write zeros, not NaN.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = (o_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh
              + split * stride_osp + offs_d[None, :])
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=head_mask[:, None])
    if NUM_SPLITS > 1:
        lse = m_i + tl.log2(l_safe)
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, seq_lens_ptr, o_ptr,
    stride_ps, stride_ph, stride_psp,
    stride_ls, stride_lh,
    stride_os, stride_oh,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    num_active = tl.cdiv(seq_len, tl.maximum(split_len, 1))  # splits that saw any token

    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_active
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for inactive splits
    part = tl.load(part_ptr + seq.to(tl.int64) * stride_ps + head * stride_ph
                   + offs_s[:, None] * stride_psp + offs_d[None, :],
                   mask=s_mask[:, None], other=0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(o_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
             out.to(o_ptr.dtype.element_ty))


class DecodeConfig(NamedTuple):
    block_n: int  # KV tokens per inner iteration
    num_warps: int
    num_stages: int


def decode_config(head_dim: int) -> DecodeConfig:
    """Tile sizes: a 64-token K and V tile of D=128 bf16 is 2 x 16 KiB per pipeline stage."""
    if head_dim <= 128:
        return DecodeConfig(block_n=64, num_warps=4, num_stages=3)
    return DecodeConfig(block_n=32, num_warps=4, num_stages=3)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      block_n: int = 64) -> int:
    """How many ranges to cut each context into.

    Without a split there are num_seqs * num_kv_heads programs. From two per SM on, the card is
    busy and splitting only adds the merge pass. Below that, split until there are about two
    programs per SM, but keep each split at least 4 tiles long (shorter ones are dominated by
    the merge and the per-program prologue).
    """
    programs = num_seqs * num_kv_heads
    target = 2 * num_sms
    if programs >= target:
        return 1
    want = math.ceil(target / max(programs, 1))
    by_len = math.ceil(max_seq_len / (4 * block_n))
    return max(1, min(want, by_len, MAX_SPLITS))


def decode_workspace_numel(num_seqs: int, num_q_heads: int, head_dim: int,
                           num_splits: int) -> int:
    """fp32 elements of scratch a launch with num_splits > 1 needs: partial outputs
    [S, Hq, splits, D] + log-sum-exps [S, Hq, splits]."""
    return num_seqs * num_q_heads * num_splits * (head_dim + 1)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    q: [S, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (strided views of the
    block-major pool are fine; last dim contiguous); block_tables: int32 [S, max_blocks];
    seq_lens: int32 [S] (0 allowed: the row's output is zeros). Returns out [S, Hq, D].

    max_seq_len: host-side bound on seq_lens for the split heuristic (default: the block
    table's capacity; no device sync). num_splits forces the split count. workspace: a flat
    fp32 tensor of >= decode_workspace_numel(...) elements for split launches (allocated here
    if not given; pass one when capturing a CUDA graph). config overrides tile sizes.
    """
    check(q.dim() == 3, f"q must be [num_seqs, num_q_heads, head_dim], got {tuple(q.shape)}")
    num_seqs, num_q_heads, head_dim = q.shape
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
          f"k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
          f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, block_size, num_kv_heads, kd = k_cache.shape
    check(kd == head_dim, f"head_dim mismatch: q {head_dim}, cache {kd}")
    check(head_dim in (64, 128, 256) or (is_pow2(head_dim) and head_dim >= 16),
          f"head_dim must be a power of two >= 16, got {head_dim}")
    check(is_pow2(block_size) and block_size >= 8,
          f"block_size must be a power of two >= 8, got {block_size}")
    check(num_q_heads % num_kv_heads == 0,
          f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check(q.dtype == k_cache.dtype == v_cache.dtype,
          f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    check(block_tables.dtype == torch.int32 and block_tables.dim() == 2
          and block_tables.shape[0] == num_seqs,
          f"block_tables must be int32 [num_seqs, max_blocks], got {block_tables.dtype} "
          f"{tuple(block_tables.shape)}")
    check(block_tables.stride(1) == 1, "block_tables: last dimension must be contiguous")
    check(seq_lens.dtype == torch.int32 and seq_lens.shape == (num_seqs,)
          and seq_lens.is_contiguous(),
          f"seq_lens must be contiguous int32 [num_seqs], got {seq_lens.dtype} "
          f"{tuple(seq_lens.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    check_interpretable(q.dtype)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    check(out.shape == q.shape and out.dtype == q.dtype, "out must be like q")
    check_last_dim_contiguous("out", out)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      seq_lens=seq_lens, out=out)
    if num_seqs == 0:
        return out

    cfg = config or decode_config(head_dim)
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        num_splits = decode_num_splits(num_seqs, num_kv_heads, bound, num_sms(q.device),
                                       cfg.block_n)
    check(1 <= num_splits <= MAX_SPLITS, f"num_splits must be in [1, {MAX_SPLITS}]")
    group = num_q_heads // num_kv_heads
    block_h = max(16, triton.next_power_of_2(group))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"

    if num_splits == 1:  # no workspace: write the output directly
        part, lse = out, out  # lse unused
        part_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        need = decode_workspace_numel(num_seqs, num_q_heads, head_dim, num_splits)
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.float32, device=q.device)
        check(workspace.dtype == torch.float32 and workspace.is_contiguous()
              and workspace.numel() >= need,
              f"workspace must be contiguous fp32 with >= {need} elements")
        n_part = num_seqs * num_q_heads * num_splits * head_dim
        part = workspace[:n_part].view(num_seqs, num_q_heads, num_splits, head_dim)
        lse = workspace[n_part:need].view(num_seqs, num_q_heads, num_splits)
        part_strides = part.stride()[:3]
        lse_strides = lse.stride()[:2]

    with device_guard(q):
        _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, part, lse,
            scale * LOG2E,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0),
            *part_strides, *lse_strides,
            GROUP=group, BLOCK_H=block_h, BLOCK_N=cfg.block_n, BLOCK_SIZE=block_size,
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, DOT_PRECISION=precision,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if num_splits > 1:
            _merge_splits_kernel[(num_seqs, num_q_heads)](
                part, lse, seq_lens, out,
                *part_strides, *lse_strides,
                out.stride(0), out.stride(1),
                BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
                SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
                num_warps=4 if head_dim <= 128 else 8,
            )
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Plain torch, one sequence at a time, in fp32. Rows with seq_len 0 come out as zeros."""
    num_q_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    for s, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        nblocks = -(seq_len // -block_size)
        ids = block_tables[s, :nblocks].long()
        k = k_cache[ids].reshape(-1, num_kv_heads, q.shape[2])[:seq_len].float()
        v = v_cache[ids].reshape(-1, num_kv_heads, q.shape[2])[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[s].float(), k) * scale
        out[s] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
