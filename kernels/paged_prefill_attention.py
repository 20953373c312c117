"""Paged prefill attention: causal attention of packed query chunks over their paged context.

The chunk's own K/V are already in the cache (store_kv runs first), so every key is read from
the pool. Sequence b's queries are q[query_start_loc[b] : query_start_loc[b+1]]; with
qlen = that count and ctx = seq_lens[b] - qlen cached tokens before the chunk:

    keys     0 ........................ ctx-1 | ctx ............ seq_len-1
             (cached context)                 | (this chunk)
    query i  sits at position ctx + i and sees keys 0 ..= ctx + i

One program owns BLOCK_Q query tokens x the GROUP query heads of one KV head, flattened into
BLOCK_M = BLOCK_Q * GROUP rows (row r: token r // GROUP, head r % GROUP), so each K/V tile is
loaded once for the whole group. It walks keys BLOCK_N at a time up to its last query's
position (causal early exit) with an fp32 online softmax, as in FlashAttention-2.

The grid is (work items, KV heads). A work item is one (sequence, query tile) pair, read from
`tiles` (int32 [N, 2]; a sequence of -1 marks an unused item, which exits at once):

    tiles:  (0, 2) (0, 1) (0, 0) (1, 0) (2, 0) (-1, 0) (-1, 0)
             └ seq 0's 3 tiles, last first ┘  └ 1-token seqs ┘ └ spare capacity ┘

so the grid depends only on the list's capacity, not on the chunks' lengths: a step captured
in a CUDA graph replays with any chunks that fit its capacity (engine/attention/base.py
prefill_tiles builds the list; a decode is a one-token chunk).

FP8 caches (e4m3) carry one fp32 scale per KV head for K and for V; a program serves one KV
head, so K's scale folds into the softmax scale and V's multiplies the accumulator once
(see paged_decode_attention.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.kernels._common import (
    check,
    check_paged_attention,
    check_same_device,
    device_guard,
    is_pow2,
    output_like,
)

LOG2E = 1.4426950408889634


# Arguments that vary from step to step are not specialised on (value 1, multiples of 16,
# 16-byte aligned addresses): each distinct specialisation is a compile on first use, and the
# engine compiles every variant at start-up (engine/warm_up.py), not in a request's step.
@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["qsl_ptr", "seq_lens_ptr", "bt_ptr", "tiles_ptr"])
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, tiles_ptr, k_scale_ptr,
    v_scale_ptr,
    scale_log2,  # softmax scale * log2(e)
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    item = tl.program_id(0).to(tl.int64) * 2
    seq = tl.load(tiles_ptr + item)
    if seq < 0:
        return
    q_tile = tl.load(tiles_ptr + item + 1)
    kv_head = tl.program_id(1)

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    tok = q_tile * BLOCK_Q + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    pos = ctx_len + tok  # each row's position in its sequence

    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=row_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    if k_scale_ptr is not None:  # FP8 cache: K's scale folds into the softmax scale
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
    # Keys past the tile's last query are masked for every row: stop there.
    kv_end = ctx_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)

    # Key 0 is visible to every row, so each row's running max is finite after tile 0.
    for n_start in range(0, kv_end, BLOCK_N):
        n = n_start + offs_n
        n_mask = n < kv_end
        block = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = n % BLOCK_SIZE
        k = tl.load(k_base + (block * stride_kb + slot * stride_kt)[None, :] + offs_d[:, None],
                    mask=n_mask[None, :], other=0.0).to(q.dtype)  # FP8 -> q's dtype
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = (n[None, :] <= pos[:, None]) & n_mask[None, :]
        qk = tl.where(visible, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (block * stride_vb + slot * stride_vt)[:, None] + offs_d[None, :],
                    mask=n_mask[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if v_scale_ptr is not None:  # FP8 cache: softmax weights sum V linearly
        acc = acc * tl.load(v_scale_ptr + kv_head)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])


class PrefillConfig(NamedTuple):
    block_m: int  # query rows (tokens x group heads) per program
    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int


def prefill_config(head_dim: int, group: int) -> PrefillConfig:
    """Tiles for head_dim <= 128: 64 rows (16 tokens x a group of 4) and 64-token K/V tiles, 4
    warps, 3 stages. Against 128 rows, 8 warps, 2 stages (Llama-3.1-8B shapes, NVIDIA H200,
    chunks of 64-2,048 tokens over 0-500 cached): 0.78-0.97 of the time at every shape, 0.86
    summed. A mixed step's chunk of a few hundred tokens gave 128-row programs a grid of a few
    dozen programs for 132 SMs; a 2,048-token chunk gains too (0.87) (BENCHMARKS "Kernels and
    the decode step")."""
    if head_dim <= 128:
        cfg = PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    else:
        cfg = PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
    if group > cfg.block_m:
        cfg = cfg._replace(block_m=triton.next_power_of_2(group))
    return cfg


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    *,
    tiles: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of B packed query chunks over their paged contexts.

    q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (strided views fine,
    last dim contiguous) already holding the chunks' K/V; query_start_loc: int32 [B + 1];
    seq_lens: int32 [B], context length after the chunk; block_tables: int32 [B, max_blocks];
    max_query_len: host-side max of the chunk lengths. Returns out [T, Hq, D].
    tiles: int32 [N, 2], the work items (the module's doc; engine/attention/base.py
    prefill_tiles for the config's block_q); default: every (sequence, tile) pair max_query_len allows, late tiles first.
    k_scale, v_scale: fp32 [Hkv], with FP8 caches only (they hold values / scale in e4m3).
    """
    num_q_heads, head_dim, block_size, num_kv_heads = check_paged_attention(
        q, k_cache, v_cache, k_scale, v_scale, rows="num_tokens")
    num_tokens = q.shape[0]
    num_seqs = seq_lens.shape[0]
    check(seq_lens.dtype == torch.int32 and seq_lens.dim() == 1 and seq_lens.is_contiguous(),
          f"seq_lens must be contiguous int32 [B], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    check(query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,)
          and query_start_loc.is_contiguous(),
          f"query_start_loc must be contiguous int32 [B + 1], got {query_start_loc.dtype} "
          f"{tuple(query_start_loc.shape)}")
    check(block_tables.dtype == torch.int32 and block_tables.dim() == 2
          and block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1,
          f"block_tables must be int32 [B, max_blocks] (last dim contiguous), got "
          f"{block_tables.dtype} {tuple(block_tables.shape)}")
    out = output_like(q, out)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      seq_lens=seq_lens, query_start_loc=query_start_loc, out=out)
    if num_seqs == 0 or num_tokens == 0 or max_query_len <= 0:
        return out

    group = num_q_heads // num_kv_heads
    cfg = config or prefill_config(head_dim, group)
    check(group <= cfg.block_m and is_pow2(cfg.block_m) and cfg.block_m >= 16,
          f"block_m {cfg.block_m} must be a power of two >= max(16, group {group})")
    block_q = cfg.block_m // group
    if tiles is None:
        tiles = _all_tiles(num_seqs, triton.cdiv(max_query_len, block_q), q.device)
    check(tiles.dtype == torch.int32 and tiles.dim() == 2 and tiles.shape[1] == 2
          and tiles.is_contiguous(), f"tiles must be contiguous int32 [N, 2], got "
          f"{tiles.dtype} {tuple(tiles.shape)}")
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    with device_guard(q):
        _paged_prefill_kernel[(tiles.shape[0], num_kv_heads)](
            q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, tiles, k_scale,
            v_scale, scale * LOG2E,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out.stride(0), out.stride(1),
            block_tables.stride(0),
            GROUP=group, BLOCK_M=cfg.block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n,
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, DOT_PRECISION=precision,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out


def prefill_block_q(head_dim: int, group: int) -> int:
    """Query tokens per work item at the default config."""
    return prefill_config(head_dim, group).block_m // group


def _all_tiles(num_seqs: int, num_q_tiles: int, device: torch.device) -> torch.Tensor:
    """Every (sequence, tile) pair, late tiles first; items past a sequence's chunk exit."""
    seq = torch.arange(num_seqs, dtype=torch.int32, device=device).repeat(num_q_tiles)
    tile = torch.arange(num_q_tiles - 1, -1, -1, dtype=torch.int32,
                        device=device).repeat_interleave(num_seqs)
    return torch.stack((seq, tile), dim=1)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                block_tables: torch.Tensor, scale: float,
                                query_chunk: int = 256, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, one sequence (and query_chunk queries) at a time, scores in fp32; FP8
    caches dequantized (element * its KV head's scale)."""
    out = torch.zeros_like(q)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    block_size = k_cache.shape[1]
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[b], qsl[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        nblocks = -(seq_len // -block_size)
        ids = block_tables[b, :nblocks].long()
        k = k_cache[ids].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = v_cache[ids].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        if k_scale is not None:
            k, v = k * k_scale[:, None], v * v_scale[:, None]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        keys = torch.arange(seq_len, device=q.device)
        for c in range(0, q_len, query_chunk):
            rows = slice(start + c, min(start + c + query_chunk, end))
            scores = torch.einsum("qhd,khd->hqk", q[rows].float(), k) * scale
            # Query i of the chunk sits at position seq_len - q_len + i.
            qpos = torch.arange(seq_len - q_len + c, seq_len - q_len + c + scores.shape[1],
                                device=q.device)
            scores = scores.masked_fill(keys[None, :] > qpos[:, None], float("-inf"))
            out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
