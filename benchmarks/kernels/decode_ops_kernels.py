"""The decode attention that benchmarks/kernels/decode_ops.py measures the production kernel against:
the replaced design (a split kernel that writes each split's partial, then a merge launch), kept
here as the baseline; the splits each design runs for a context; and Attn, old and new with
their workspaces for one grid size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from benchmarks.kernels.decode_ops_common import Shape
from tandem.kernels import SplitPolicy, paged_decode_attention
from tandem.kernels.paged_decode_attention import LOG2E, _attend
from tandem.kernels.paged_decode_launch import (
    DEFAULT_SPLIT_POLICY,
    decode_config,
    decode_split_len,
    decode_workspace_numel,
)

# ----------------------------------------------------------------------------- the old kernels

@triton.jit
def _old_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, part_ptr, lse_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2,
    stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ps, stride_ph, stride_psp, stride_ls, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The replaced design's split pass: each split writes its partial; no minimum length, so
    a grid sized for long contexts cuts a short one into one-tile splits."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    if start < seq_len:
        end = tl.minimum(start + split_len, seq_len)
        acc, m_i, l_i = _attend(
            q_ptr, k_ptr, v_ptr, bt_ptr, k_scale_ptr, v_scale_ptr, seq, kv_head, start, end,
            scale_log2,
            stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
            stride_vh, stride_bt, GROUP, BLOCK_H, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PRECISION,
            False)  # DOT_F16: a bf16 cache
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + offs_h
        head_mask = offs_h < GROUP
        tl.store(part_ptr + seq.to(tl.int64) * stride_ps + heads[:, None] * stride_ph
                 + split * stride_psp + offs_d[None, :], acc / l_safe[:, None],
                 mask=head_mask[:, None])
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, m_i + tl.log2(l_safe),
                 mask=head_mask)


@triton.jit
def _old_merge_kernel(
    part_ptr, lse_ptr, seq_lens_ptr, o_ptr,
    stride_ps, stride_ph, stride_psp, stride_ls, stride_lh, stride_os, stride_oh,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """The replaced design's second launch: one program per (sequence, query head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    num_active = tl.cdiv(seq_len, tl.maximum(split_len, 1))
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_active
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    part = tl.load(part_ptr + seq.to(tl.int64) * stride_ps + head * stride_ph
                   + offs_s[:, None] * stride_psp + offs_d[None, :],
                   mask=s_mask[:, None], other=0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(o_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
             out.to(o_ptr.dtype.element_ty))


def old_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         out: torch.Tensor, num_splits: int, workspace: torch.Tensor
                         ) -> torch.Tensor:
    """The replaced paged_decode_attention: split kernel + merge kernel (no split: the
    unchanged single kernel)."""
    if num_splits == 1:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                      out=out, num_splits=1)
    s, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    cfg = decode_config(d)
    n_part = s * hq * num_splits * d
    part = workspace[:n_part].view(s, hq, num_splits, d)
    lse = workspace[n_part:n_part + s * hq * num_splits].view(s, hq, num_splits)
    _old_split_kernel[(s, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part, lse, None, None, scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), *part.stride()[:3], *lse.stride()[:2],
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.block_n,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=d, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _old_merge_kernel[(s, hq)](
        part, lse, seq_lens, out, *part.stride()[:3], *lse.stride()[:2],
        out.stride(0), out.stride(1), BLOCK_N=cfg.block_n, HEAD_DIM=d, NUM_SPLITS=num_splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        num_warps=4 if d <= 128 else 8)
    return out


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def old_active_splits(ctx: int, num_splits: int, block_n: int) -> int:
    """Splits that see tokens in the old kernel (no minimum split length)."""
    return cdiv(ctx, cdiv(cdiv(ctx, num_splits), block_n) * block_n)


def new_active_splits(ctx: int, num_splits: int, block_n: int, min_split_tokens: int) -> int:
    if num_splits == 1:
        return 1
    return cdiv(ctx, decode_split_len(ctx, num_splits, block_n, min_split_tokens))


class Attn:
    """Old and new decode attention with their workspaces, for one grid size."""

    def __init__(self, shape: Shape, batch: int, num_splits: int, device: torch.device,
                 policy: SplitPolicy = DEFAULT_SPLIT_POLICY) -> None:
        self.num_splits = num_splits
        self.policy = policy
        numel = decode_workspace_numel(batch, shape.num_q_heads, shape.head_dim, num_splits)
        self.ws_old = torch.empty(numel, dtype=torch.float32, device=device)
        self.ws_new = torch.empty(numel, dtype=torch.float32, device=device)
        self.counters = torch.zeros(batch * shape.num_kv_heads, dtype=torch.int32,
                                    device=device)
        self.scale = shape.head_dim ** -0.5

    def new(self, q, k_cache, v_cache, tables, seq_lens, out):  # type: ignore[no-untyped-def]
        return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, self.scale,
                                      out=out, num_splits=self.num_splits,
                                      workspace=self.ws_new, counters=self.counters,
                                      policy=self.policy)

    def old(self, q, k_cache, v_cache, tables, seq_lens, out):  # type: ignore[no-untyped-def]
        return old_decode_attention(q, k_cache, v_cache, tables, seq_lens, self.scale, out,
                                    self.num_splits, self.ws_old)
