"""The handoff between workers of different tensor-parallel sizes: each decode rank copies the
KV heads it owns from whichever prefill ranks hold them.

Heads per rank (rank_heads below): rank r of N holds a contiguous run of the model's
KV heads, or, when N exceeds their number, a replica of one. Model with 4 KV heads:

    prefill TP 2:   rank 0 [h0 h1]        rank 1 [h2 h3]
    decode  TP 1:   rank 0 [h0 h1 h2 h3]  ◀─ h0 h1 from P0, h2 h3 from P1
    decode  TP 4:   rank 0 [h0] ◀─ P0   rank 1 [h1] ◀─ P0   rank 2 [h2] ◀─ P1   rank 3 [h3] ◀─ P1

Every prefill rank's pool uses the same block ids (rank 0's block pool allocates them), so a
request's one lease names its blocks on every rank. A copy moves, for each block pair, the
[layers, K/V, tokens, heads] rows of one run of heads: a whole block when both pools hold the
same heads.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from tandem.errors import InvalidArgument
from tandem.kvtransfer.remote import TransferStats, check_block_ids


# -- which KV heads a rank holds (engine/parallel.py shards the model by the same rule) ----------
def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    return max(1, num_kv_heads // tp)


def kv_head_start(num_kv_heads: int, tp: int, rank: int) -> int:
    """The first of the model's KV heads that rank `rank` of `tp` holds: with tp <= heads each
    rank holds heads/tp of them; with more ranks (tp a multiple of heads) each head is
    replicated on tp/heads ranks."""
    if tp <= num_kv_heads:
        return rank * (num_kv_heads // tp)
    return rank // (tp // num_kv_heads)


def rank_heads(num_kv_heads: int, tp: int, rank: int) -> range:
    """The model's KV heads rank `rank` of a group of `tp` holds in its pool, in pool order."""
    start = kv_head_start(num_kv_heads, tp, rank)
    return range(start, start + kv_heads_per_rank(num_kv_heads, tp))


class HeadCopy(NamedTuple):
    """Heads [src_head, src_head + count) of prefill rank src_rank's pool go to heads
    [dst_head, dst_head + count) of this decode rank's pool (local indices)."""

    src_rank: int
    src_head: int
    dst_head: int
    count: int


def head_plan(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[HeadCopy]:
    """What decode rank dst_rank (of dst_tp) copies from a prefill worker of src_tp ranks.
    Where several prefill ranks hold a head (replicas), decode ranks spread over them."""
    if src_tp % dst_tp and dst_tp % src_tp:
        raise InvalidArgument("tensor_parallel_size", f"prefill TP {src_tp} and decode TP "
                                                      f"{dst_tp}: neither divides the other")
    want = rank_heads(num_kv_heads, dst_tp, dst_rank)
    plan: list[HeadCopy] = []
    h = want.start
    while h < want.stop:
        holders = [p for p in range(src_tp) if h in rank_heads(num_kv_heads, src_tp, p)]
        p = holders[dst_rank % len(holders)]
        have = rank_heads(num_kv_heads, src_tp, p)
        n = min(want.stop, have.stop) - h
        plan.append(HeadCopy(p, h - have.start, h - want.start, n))
        h += n
    return plan


def pull_heads(src_pools: Sequence[torch.Tensor], local: torch.Tensor, num_kv_heads: int,
               dst_rank: int, dst_tp: int, src_block_ids: Sequence[int],
               dst_block_ids: Sequence[int]) -> TransferStats:
    """Copy this rank's heads of blocks src_block_ids (in every prefill rank's pool,
    src_pools[p] being rank p's) into blocks dst_block_ids of `local`. When this returns the
    copy is complete (the lease may be released)."""
    plan = head_plan(num_kv_heads, len(src_pools), dst_tp, dst_rank)
    for c in plan:
        _check(src_pools[c.src_rank], local, c, src_block_ids, dst_block_ids)
    n = len(src_block_ids)
    if n == 0:
        return TransferStats(0, 0, 0.0)
    start = time.perf_counter()
    dev = local.device
    dst_ids = torch.tensor(list(dst_block_ids), dtype=torch.int64, device=dev)
    src_ids = torch.tensor(list(src_block_ids), dtype=torch.int64, device=dev)
    moved = 0
    # As bytes: pages move unchanged, and the CPU has no index_copy_ for float8.
    dst = local.view(torch.uint8)
    for c in plan:
        src = src_pools[c.src_rank].view(torch.uint8)
        rows = src.index_select(0, src_ids)[:, :, :, :, c.src_head:c.src_head + c.count]
        if c.count == local.shape[4] and c.dst_head == 0:
            dst.index_copy_(0, dst_ids, rows.contiguous())
        else:
            dst[dst_ids, :, :, :, c.dst_head:c.dst_head + c.count] = rows
        moved += rows.numel()
    if local.is_cuda:
        torch.cuda.current_stream(dev).synchronize()
    return TransferStats(num_blocks=n, bytes=moved, seconds=time.perf_counter() - start)


def _check(src: torch.Tensor, dst: torch.Tensor, c: HeadCopy, src_ids: Sequence[int],
           dst_ids: Sequence[int]) -> None:
    # Ids out of range would read or write out of bounds on the GPU: checked here first.
    if src.dtype != dst.dtype or src.shape[1:4] != dst.shape[1:4] or src.shape[5] != dst.shape[5]:
        raise InvalidArgument("local", f"pool {dst.dtype} {tuple(dst.shape)} cannot take heads "
                                       f"of {src.dtype} {tuple(src.shape)}")
    if c.src_head + c.count > src.shape[4] or c.dst_head + c.count > dst.shape[4]:
        raise InvalidArgument("num_kv_heads", f"heads {c} outside pools of {src.shape[4]} and "
                                              f"{dst.shape[4]} heads")
    check_block_ids(src, dst, src_ids, dst_ids)
