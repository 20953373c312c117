"""Paged decode attention (one query token per sequence), GQA-aware, with split-KV in one launch.

One program owns one (sequence, KV head, split): it loads the GROUP query heads that share the
KV head as a [BLOCK_H >= 16, D] tile, so each KV token is read once for the whole group, and
walks its token range BLOCK_N tokens at a time, gathering them through the block table:

    tokens   t0 ................................ t0+BLOCK_N-1
    blocks   | bt[t0//bs] | bt[t0//bs + 1] | ...               (bs = block size, any power of 2)
    K tile   [D, BLOCK_N] <- k_cache[bt[t//bs], t%bs, kv_head, :]  (each token row: D contiguous)

    qk = q[BLOCK_H, D] @ K[D, BLOCK_N];  online softmax in fp32 (base 2);  acc += p @ V

Split-KV (flash-decoding): with few (sequence, KV head) pairs for the SMs, the grid gets
num_splits programs per pair, and each sequence's context is cut into ranges of whole BLOCK_N
tiles, at least min_split_tokens long (rounded up to whole tiles). The ranges are computed in
the kernel from seq_lens, so the grid depends on shapes only and one captured CUDA graph serves
every context length; a graph sized for long contexts still cuts a short one into few, long
splits:

    seq_len 1000, BLOCK_N 64, num_splits 33, min_split_tokens 256  ->  split_len 256 tokens
    split     0          1           2           3           4 .. 32
    tokens    [0, 256)   [256, 512)  [512, 768)  [768, 1000)  none: exit at once

Each active split writes its normalised partial output and log-sum-exp (base 2) to a fp32
workspace, then increments the (sequence, KV head)'s counter. The program that brings the
counter to the number of active splits is the last one: it merges all the partials (in split
order, so the result does not depend on which program came last), writes the output and sets
the counter back to 0, so one zeroed counter buffer serves every later launch and CUDA-graph
replay. A sequence with a single active split writes its output directly.

    workspace (fp32)  partial [S, Hq, num_splits, D] | lse [S, Hq, num_splits]
    counters  (int32) [S, Hkv], all 0 between launches

A plan (the engine's launches; paged_decode_launch.py decode_plan) replaces the grid's
(sequence, KV head, split) with work items the host lists per step: one split length for the
whole step, chosen so the contexts' total fills about 8 programs an SM (unless no context is
much longer than it), every sequence cut into splits of it, longest first. In a mixed batch a
context several times the average would otherwise keep the launch waiting on its one program
(a served ShareGPT-like step of ~100 decodes: 30-40% of the copy bandwidth without a plan, ~70%
with one). A graph's grid is the plan's capacity; unused items exit at once. Partials are
indexed by item, a sequence's in consecutive rows, and merged as above.

FP8 caches (e4m3, kernels/_common.py) come with one fp32 scale per KV head for K and for V.
A program serves one KV head, so dequantizing costs no per-element multiply: K tiles are
converted to q's dtype and k_scale folds into the softmax scale; V tiles likewise, and v_scale
multiplies the accumulator once at the end (softmax weights sum V linearly). With
DecodeConfig.fp8_dot_f16 the tiles become fp16 instead (exact for e4m3, one conversion) and a
bf16 q is rounded to fp16 once per program (fp32 queries keep fp32 dot products).

This module holds the kernels, their launcher (`paged_decode_attention`) and the plain-torch
reference; kernels/paged_decode_launch.py holds the host-side shaping the launcher uses: its
argument checks, tile sizes, split count and split workspace.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import (
    check,
    check_same_device,
    device_guard,
    num_sms,
    resident_programs,
)
from tandem.kernels.paged_decode_launch import (
    DEFAULT_SPLIT_POLICY,
    MAX_SPLITS,
    UNSPLIT_CANDIDATES,
    UNSPLIT_CANDIDATES_FP8,
    DecodeConfig,
    SplitPolicy,
    check_decode_args,
    decode_config,
    decode_num_splits,
    fullest_last_wave,
    min_split_len,
    plan_config,
    plan_workspace,
    split_workspace,
)

LOG2E = 1.4426950408889634


@triton.jit
def _attend(
    q_ptr, k_ptr, v_ptr, bt_ptr, k_scale_ptr, v_scale_ptr, seq, kv_head, start, end, scale_log2,
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_F16: tl.constexpr,
):
    """Online softmax of the group's query heads over tokens [start, end) of one sequence.
    Returns (acc [BLOCK_H, D], running max m [BLOCK_H], running sum l [BLOCK_H]), unnormalised.
    With scales (an FP8 cache) K and V are dequantized: k_scale into the softmax scale, v_scale
    into acc."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h

    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh
                + offs_d[None, :], mask=head_mask[:, None], other=0.0)
    if DOT_F16:  # an FP8 cache read as fp16 (exact), q rounded to fp16 once
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    if k_scale_ptr is not None:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)

    for tile_start in range(start, end, BLOCK_N):
        t = tile_start + offs_n
        t_mask = t < end
        block = tl.load(bt_row + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot = t % BLOCK_SIZE
        k_off = block * stride_kb + slot * stride_kt
        k = tl.load(k_base + k_off[None, :] + offs_d[:, None], mask=t_mask[None, :], other=0.0)
        k = k.to(q.dtype)  # FP8 -> q's dtype; a no-op otherwise
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
        qk = tl.where(t_mask[None, :], qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_off = block * stride_vb + slot * stride_vt
        v = tl.load(v_base + v_off[:, None] + offs_d[None, :], mask=t_mask[:, None], other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if v_scale_ptr is not None:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    return acc, m_i, l_i


# Step-varying arguments are not specialised on (see paged_prefill_attention.py): the block
# table's width and the metadata's offsets change with the batch; the split count is an
# argument, so the split kernel has one variant per power of two up to its merge chunk.
@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["bt_ptr", "seq_lens_ptr"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, o_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2,  # softmax scale * log2(e)
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_os, stride_oh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_F16: tl.constexpr,
):
    """No split: one program per (sequence, KV head) over the whole context."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    acc, _, l_i = _attend(
        q_ptr, k_ptr, v_ptr, bt_ptr, k_scale_ptr, v_scale_ptr, seq, kv_head, 0, seq_len,
        scale_log2,
        stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_bt, GROUP, BLOCK_H, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PRECISION, DOT_F16)

    # seq_len 0 (padding rows) leaves l_i at 0: write zeros, not NaN.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_h
    o_ptrs = o_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(offs_h < GROUP)[:, None])


@triton.jit
def _merge_splits(
    part_ptr, lse_ptr, o_ptr, kv_head, num_active,
    stride_psp, stride_ph,
    stride_lh,
    stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
):
    """out[h] = sum_s 2^(lse_s - M) part_s / sum_s 2^(lse_s - M) over the num_active splits of
    one (sequence, KV head), for the group's query heads: part_ptr, lse_ptr and o_ptr point at
    that sequence's first split and output row; the partial of split s, head h is at
    part_ptr + s * stride_psp + h * stride_ph, its log-sum-exp at lse_ptr + s + h * stride_lh.
    MERGE_CHUNK splits at a time, as [GROUP_PAD, MERGE_CHUNK, D] tiles: one pass for the
    largest log-sum-exp, one to sum. Loads bypass L1 (.cg): the partials were written by other
    SMs during this launch."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = tl.arange(0, MERGE_CHUNK)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    lse_rows = lse_ptr + heads[:, None] * stride_lh  # [GROUP_PAD, 1]
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    for s0 in range(0, num_active, MERGE_CHUNK):
        s = s0 + offs_c
        lse = tl.load(lse_rows + s[None, :], mask=g_mask[:, None] & (s[None, :] < num_active),
                      other=float("-inf"), cache_modifier=".cg")
        m = tl.maximum(m, tl.max(lse, 1))
    m = tl.where(m == float("-inf"), 0.0, m)

    part_rows = part_ptr + heads[:, None, None] * stride_ph + offs_d[None, None, :]
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    for s0 in range(0, num_active, MERGE_CHUNK):
        s = s0 + offs_c
        mask = g_mask[:, None] & (s[None, :] < num_active)  # [GROUP_PAD, MERGE_CHUNK]
        lse = tl.load(lse_rows + s[None, :], mask=mask, other=float("-inf"),
                      cache_modifier=".cg")
        w = tl.exp2(lse - m[:, None])  # 0 where masked
        part = tl.load(part_rows + s[None, :, None] * stride_psp, mask=mask[:, :, None],
                       other=0.0, cache_modifier=".cg")
        acc += tl.sum(part * w[:, :, None], 1)
        denom += tl.sum(w, 1)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(o_ptr + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _finish_split(
    acc, m_i, l_i, o_ptr, part_ptr, lse_ptr, counter_ptr, kv_head, split, num_active,
    stride_oh, stride_psp, stride_ph, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr, MERGE_CHUNK: tl.constexpr,
):
    """One split's result for a (sequence, KV head): o_ptr, part_ptr and lse_ptr point at the
    sequence's output row and its first split's partial and log-sum-exp, counter_ptr at its
    counter. A sole split writes the output; otherwise the split writes its partial, and the
    last to arrive merges them all and sets the counter back to 0."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    head_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    if num_active == 1:
        tl.store(o_ptr + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=head_mask[:, None])
    else:
        tl.store(part_ptr + split * stride_psp + heads[:, None] * stride_ph + offs_d[None, :],
                 out, mask=head_mask[:, None])
        tl.store(lse_ptr + heads * stride_lh + split, m_i + tl.log2(l_safe), mask=head_mask)
        # Every thread's stores before the counter moves (one thread does the atomic;
        # acq_rel at GPU scope publishes them to, and orders the loads of, the merger).
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == num_active - 1:  # the last active split of this (sequence, KV head)
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
            _merge_splits(part_ptr, lse_ptr, o_ptr, kv_head, num_active,
                          stride_psp, stride_ph, stride_lh, stride_oh,
                          GROUP, GROUP_PAD, HEAD_DIM, MERGE_CHUNK)


@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_ps", "stride_ph",
                               "stride_ls", "stride_lh"],
            do_not_specialize_on_alignment=["bt_ptr", "seq_lens_ptr"])
def _paged_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, o_ptr, part_ptr, lse_ptr, counter_ptr,
    k_scale_ptr, v_scale_ptr,
    scale_log2,  # softmax scale * log2(e)
    min_split_len,  # tokens, whole BLOCK_N tiles (paged_decode_launch.min_split_len)
    num_splits,  # split programs per (sequence, KV head): the grid's third dimension
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_os, stride_oh,
    stride_ps, stride_ph, stride_psp,  # partial outputs [S, Hq, num_splits, D]
    stride_ls, stride_lh,  # log-sum-exps [S, Hq, num_splits] (split stride 1)
    stride_cs,  # counters [S, Hkv] (KV-head stride 1)
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_F16: tl.constexpr, GROUP_PAD: tl.constexpr, MERGE_CHUNK: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Whole tiles per split so that only the last tile of a sequence is ragged; >= 1 token
    # even for seq_len 0, whose single active split writes zeros.
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N,
                           min_split_len)
    num_active = tl.maximum(tl.cdiv(seq_len, split_len), 1)
    if split < num_active:
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
        acc, m_i, l_i = _attend(
            q_ptr, k_ptr, v_ptr, bt_ptr, k_scale_ptr, v_scale_ptr, seq, kv_head, start, end,
            scale_log2,
            stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
            stride_vh, stride_bt, GROUP, BLOCK_H, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PRECISION,
            DOT_F16)
        seq64 = seq.to(tl.int64)
        _finish_split(
            acc, m_i, l_i, o_ptr + seq64 * stride_os, part_ptr + seq64 * stride_ps,
            lse_ptr + seq64 * stride_ls, counter_ptr + seq64 * stride_cs + kv_head, kv_head,
            split, num_active, stride_oh, stride_psp, stride_ph, stride_lh,
            GROUP, BLOCK_H, HEAD_DIM, GROUP_PAD, MERGE_CHUNK)


@triton.jit(do_not_specialize=["stride_bt", "stride_pi", "stride_ph", "stride_lh"],
            do_not_specialize_on_alignment=["bt_ptr", "seq_lens_ptr", "plan_ptr"])
def _paged_decode_plan_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, o_ptr, plan_ptr, part_ptr, lse_ptr, counter_ptr,
    k_scale_ptr, v_scale_ptr,
    scale_log2,  # softmax scale * log2(e)
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_os, stride_oh,
    stride_pi, stride_ph,  # partial outputs [capacity, Hq, D]
    stride_lh,  # log-sum-exps [Hq, capacity] (item stride 1)
    stride_cs,  # counters [S, Hkv] (KV-head stride 1)
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_F16: tl.constexpr, GROUP_PAD: tl.constexpr, MERGE_CHUNK: tl.constexpr,
):
    """One program per (work item of the plan, KV head): plan row 0 holds the step's split
    length, row 1 + i item i (sequence, split), a sequence's splits in consecutive rows;
    unused rows have sequence -1."""
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(plan_ptr + 2 * item + 2)
    if seq >= 0:
        split = tl.load(plan_ptr + 2 * item + 3)
        split_len = tl.load(plan_ptr)
        seq_len = tl.load(seq_lens_ptr + seq)
        num_active = tl.maximum(tl.cdiv(seq_len, split_len), 1)
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
        acc, m_i, l_i = _attend(
            q_ptr, k_ptr, v_ptr, bt_ptr, k_scale_ptr, v_scale_ptr, seq, kv_head, start, end,
            scale_log2,
            stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
            stride_vh, stride_bt, GROUP, BLOCK_H, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PRECISION,
            DOT_F16)
        first = (item - split).to(tl.int64)  # the item of the sequence's split 0
        seq64 = seq.to(tl.int64)
        _finish_split(
            acc, m_i, l_i, o_ptr + seq64 * stride_os, part_ptr + first * stride_pi,
            lse_ptr + first, counter_ptr + seq64 * stride_cs + kv_head, kv_head,
            split, num_active, stride_oh, stride_pi, stride_ph, stride_lh,
            GROUP, BLOCK_H, HEAD_DIM, GROUP_PAD, MERGE_CHUNK)


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
    counters: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    policy: SplitPolicy = DEFAULT_SPLIT_POLICY,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    plan: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context: one kernel launch.

    q: [S, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (strided views of the
    block-major pool are fine; last dim contiguous); block_tables: int32 [S, max_blocks];
    seq_lens: int32 [S] (0 allowed: the row's output is zeros). Returns out [S, Hq, D].

    max_seq_len: host-side bound on seq_lens for the split heuristic (default: the block
    table's capacity; no device sync). num_splits forces the grid's split count (each
    sequence still gets splits of at least policy.min_split_tokens, in whole tiles). For split
    launches: workspace, a flat fp32 tensor of >= decode_workspace_numel(...) elements, any
    contents; counters, a flat int32 tensor of >= S * Hkv elements that must be all zero and
    that every launch leaves all zero. Both are allocated here if not given; pass them when capturing a
    CUDA graph (and never share them between launches that may run concurrently). config
    overrides tile sizes; policy the split heuristic. k_scale, v_scale: fp32 [Hkv], with FP8
    caches only: the caches hold values / scale in e4m3.

    plan: the step's work items from the host (paged_decode_launch.decode_plan), int32
    [capacity + 1, 2]: the grid is one program per (item, KV head), every sequence cut into
    splits of the plan's one length, so that a long context does not keep a whole launch
    waiting on its one program; num_splits and policy are then unused, and workspace must
    hold decode_workspace_numel(capacity, Hq, D, 1) elements.
    """
    out = check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, out, policy,
                            k_scale, v_scale)
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return out

    fp8 = k_scale is not None
    if plan is not None:
        _launch_plan(q, k_cache, v_cache, block_tables, seq_lens, out, scale, plan, workspace,
                     counters, config, k_scale, v_scale)
        return out
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        block_n = (config or decode_config(head_dim, fp8=fp8)).block_n
        num_splits = decode_num_splits(num_seqs, num_kv_heads, bound, num_sms(q.device),
                                       block_n, policy)
    check(1 <= num_splits <= MAX_SPLITS, f"num_splits must be in [1, {MAX_SPLITS}]")
    group = num_q_heads // num_kv_heads
    common = (
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
    )
    consts = kernel_consts(group, block_size, head_dim, q.dtype)

    if num_splits == 1:  # no workspace: write the output directly
        args = (q, k_cache, v_cache, block_tables, seq_lens, out, k_scale, v_scale,
                scale * LOG2E, *common)
        cfg = config or _unsplit_config(args, consts, num_seqs * num_kv_heads, fp8)
        with device_guard(q):
            _paged_decode_kernel[(num_seqs, num_kv_heads)](*args, **consts, **_tiles(cfg, q, fp8))
        return out

    cfg = config or decode_config(head_dim, fp8=fp8)
    part, lse, counters = split_workspace(q, num_kv_heads, num_splits, workspace, counters)
    group_pad = triton.next_power_of_2(group)
    splits_pad = triton.next_power_of_2(num_splits)
    with device_guard(q):
        _paged_decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, out, part, lse, counters,
            k_scale, v_scale, scale * LOG2E, min_split_len(policy.min_split_tokens, cfg.block_n),
            num_splits,
            *common,
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1),
            num_kv_heads,
            GROUP_PAD=group_pad,
            MERGE_CHUNK=max(1, min(splits_pad, cfg.merge_tile // (group_pad * head_dim))),
            **consts, **_tiles(cfg, q, fp8),
        )
    return out


def _launch_plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                 scale: float, plan: torch.Tensor, workspace: torch.Tensor | None,
                 counters: torch.Tensor | None, config: DecodeConfig | None,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check(plan.dtype == torch.int32 and plan.dim() == 2 and plan.shape[1] == 2
          and plan.shape[0] >= 2 and plan.is_contiguous(),
          f"plan must be contiguous int32 [capacity + 1, 2], got {plan.dtype} "
          f"{tuple(plan.shape)}")
    capacity = plan.shape[0] - 1
    part, lse, counters = plan_workspace(q, num_kv_heads, capacity, workspace, counters)
    check_same_device(q=q, plan=plan)
    fp8 = k_scale is not None
    cfg = config or plan_config(head_dim, fp8=fp8)
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    with device_guard(q):
        _paged_decode_plan_kernel[(capacity, num_kv_heads)](
            q, k_cache, v_cache, block_tables, seq_lens, out, plan, part, lse, counters,
            k_scale, v_scale, scale * LOG2E,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            part.stride(0), part.stride(1), lse.stride(0), num_kv_heads,
            GROUP_PAD=group_pad, MERGE_CHUNK=max(1, cfg.merge_tile // (group_pad * head_dim)),
            **kernel_consts(group, block_size, head_dim, q.dtype), **_tiles(cfg, q, fp8),
        )


def kernel_consts(group: int, block_size: int, head_dim: int, dtype: torch.dtype) -> dict:
    """The kernels' shape constants: a program's query heads padded to the 16 rows a tensor-core
    product needs, and fp32 queries (CPU runs) multiplied exactly."""
    return dict(GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
                BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")


def _tiles(cfg: DecodeConfig, q: torch.Tensor, fp8: bool) -> dict:
    """A launch's tile arguments from its config."""
    return tile_args(cfg, q.dtype, fp8, q.device.type == "cuda")


def tile_args(cfg: DecodeConfig, dtype: torch.dtype, fp8: bool, cuda: bool) -> dict:
    """The kernels' tile constants and launch options for queries of `dtype`, a cache FP8 or
    not, on a GPU or not."""
    # fp32 queries (CPU runs) keep fp32 dot products: fp16 would round them.
    tiles = dict(BLOCK_N=cfg.block_n,
                 DOT_F16=bool(cfg.fp8_dot_f16 and fp8 and dtype != torch.float32),
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.max_registers is not None and cuda:
        tiles["maxnreg"] = cfg.max_registers
    return tiles


# (device, dtypes, constants) -> programs each of UNSPLIT_CANDIDATES holds on the whole card
_UNSPLIT_SLOTS: dict[tuple, tuple[int, ...]] = {}


def _unsplit_config(args: tuple, consts: dict, programs: int, fp8: bool) -> DecodeConfig:
    """An unsplit launch's tiles: on a GPU, with head_dim <= 128, the one of its cache's
    candidates (UNSPLIT_CANDIDATES, UNSPLIT_CANDIDATES_FP8) that fills the grid's last wave
    best (paged_decode_launch.py), from what the compiled candidates hold on an SM (compiled
    once per device and constants)."""
    q, k_cache = args[0], args[1]
    if q.device.type != "cuda" or consts["HEAD_DIM"] > 128:
        return decode_config(consts["HEAD_DIM"], fp8=fp8)
    candidates = UNSPLIT_CANDIDATES_FP8 if fp8 else UNSPLIT_CANDIDATES
    key = (q.device, q.dtype, k_cache.dtype, *sorted(consts.items()))
    slots = _UNSPLIT_SLOTS.get(key)
    if slots is None:
        sms = num_sms(q.device)
        with device_guard(q):
            slots = _UNSPLIT_SLOTS[key] = tuple(
                sms * resident_programs(_paged_decode_kernel.warmup(
                    *args, grid=(1, 1), **consts, **_tiles(c, q, fp8)), q.device)
                for c in candidates)
    return candidates[fullest_last_wave(programs, slots)]


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, one sequence at a time, in fp32. Rows with seq_len 0 come out as zeros.
    FP8 caches are dequantized (element * its KV head's scale)."""
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
        if k_scale is not None:
            k, v = k * k_scale[:, None], v * v_scale[:, None]
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[s].float(), k) * scale
        out[s] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
