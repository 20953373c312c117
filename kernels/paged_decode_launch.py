"""How a paged decode attention launch (kernels/paged_decode_attention.py) is shaped, on the
host: tile sizes (`decode_config`; for an unsplit launch on a GPU, the candidate that fills the
grid's last wave best: `UNSPLIT_CANDIDATES`, `fullest_last_wave`), how many split programs the
grid gets per (sequence, KV head) (`decode_num_splits`, under a `SplitPolicy`), how long each
sequence's splits are, as the kernel computes them (`decode_split_len`), the fp32 workspace a
split launch writes its partials to (`decode_workspace_numel`, `split_workspace`), a planned
launch's work items (`decode_plan`, `decode_plan_capacity`, `plan_config`, `plan_workspace`),
and the launcher's argument checks (`check_decode_args`: shapes, dtypes, layouts, devices, FP8 scales,
split policy).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from tandem.kernels._common import (
    check,
    check_paged_attention,
    check_same_device,
    output_like,
)

MAX_SPLITS = 64


class DecodeConfig(NamedTuple):
    block_n: int  # KV tokens per inner iteration
    num_warps: int
    num_stages: int
    # FP8 caches only: dot products in fp16 (e4m3 -> fp16 is exact and one conversion; q, a
    # bf16 row of moderate range, rounds to fp16) instead of converting tiles to q's dtype.
    fp8_dot_f16: bool = False
    # Registers a thread may use (ptxas's maxnreg; None: as many as it wants). Registers bound
    # how many programs an SM holds, and so how many tiles are in flight to hide memory latency.
    max_registers: int | None = None
    # fp32 elements of partial output the merging program of a split launch loads at once
    # (larger: fewer rounds of loads; smaller: fewer registers, on a path most programs skip).
    merge_tile: int = 4096


def decode_config(head_dim: int, *, fp8: bool = False) -> DecodeConfig:
    """Tile sizes: a 64-token K and V tile of D=128 bf16 is 2 x 16 KiB per pipeline stage.

    An FP8 cache (fp8) reads its tiles as fp16 in 128-token tiles, as many bytes as a 64-token
    bf16 tile, with registers capped at 160 a thread (below), split or not. Measured against
    bf16 KV with its own config (Llama-3.1-8B shapes, NVIDIA H200:
    benchmarks/kernels/decode_kv_dtype.py): unsplit, 0.82-0.95x the time at batch 1-512 x
    context 1k/4k, where converting to bf16 in 64-token tiles took 0.92-1.28x; split as a
    decode graph launches a few rows (batch 1-16, contexts 256 and 1,024, the grid sized for
    block tables of 448 and 8,192 tokens: --graph-len), 0.72-0.80x, where 64-token fp16 tiles
    took 0.89-1.05x (the 128-token tiles' 256-token minimum split is 2 of them: SplitPolicy).
    An unsplit launch on a GPU with head_dim <= 128 picks among its cache's UNSPLIT_CANDIDATES
    (the first is this one's) by its grid (paged_decode_attention's launcher), except a
    mixed-step graph's, whose grid is mostly rows without context: it passes this config
    (engine/attention/triton_backend.py)."""
    if head_dim <= 128:
        if fp8:
            return UNSPLIT_CANDIDATES_FP8[0]
        return DecodeConfig(64, 4, 3)
    return DecodeConfig(32, 4, 3, fp8)


# An unsplit launch (one program per (sequence, KV head), head_dim <= 128) takes one of these,
# by how full each leaves the grid's last wave: a grid just past a whole number of waves runs
# its last wave nearly empty, with too few programs on each SM to keep its share of the memory
# bandwidth. Registers bound how many programs an SM holds (the compiler keeps one K and one V
# tile in shared memory a program and loads the next only after the current one is used, so
# a program has little in flight and the SM's share of the bandwidth comes from holding many).
# bf16/fp16 caches: on an H200 with Triton 3.6 these hold 4, 5 and 8 programs an SM. Measured
# there over the decode graphs' batches of 40-512 sequences (8 KV heads, contexts 256-1,024:
# benchmarks/kernels/paged_kernels.py --tiles), the pick took 0.92, 0.95 and 0.98 of the first
# candidate's time for batches of 40-128, 136-256 and 264-512 (the fastest at each batch: 0.92,
# 0.95, 0.97), 0.79-0.85 at 72-96 sequences, and was never slower beyond the timing's noise
# (1%); capping their registers lost (benchmarks/kernels/decode_tiles.py).
UNSPLIT_CANDIDATES = (DecodeConfig(64, 4, 3), DecodeConfig(64, 4, 2), DecodeConfig(32, 2, 4))
# FP8 caches: 128-token fp16 tiles with registers capped at 160 and at 128 a thread, 3 and 4
# programs an SM (uncapped: 193 registers, 2). Same card, batches 40-512 x contexts 256-2,048
# (benchmarks/kernels/decode_tiles.py): the pick took 0.90 of the uncapped kernel's time summed
# over the shapes, 0.73-0.95 at each.
UNSPLIT_CANDIDATES_FP8 = (DecodeConfig(128, 4, 3, True, max_registers=160),
                          DecodeConfig(128, 4, 3, True, max_registers=128))
FILL_MARGIN = 0.02


def fullest_last_wave(programs: int, slots: tuple[int, ...]) -> int:
    """The index of the candidate to launch a grid of `programs` with, given how many programs
    each candidate's launch holds on the whole card at once (`slots`): the one that fills its
    last wave best (a grid within one wave: its share of the card), of those within
    FILL_MARGIN of that the one with the fewest waves, then the first."""
    waves = [programs / max(held, 1) for held in slots]
    fill = [w / math.ceil(w) for w in waves]
    best = max(fill)
    return min((i for i, f in enumerate(fill) if f >= best - FILL_MARGIN),
               key=lambda i: (math.ceil(waves[i]), i))


class SplitPolicy(NamedTuple):
    """How split-KV cuts contexts. Each split is a program that reads its range of KV tokens,
    and the last one of a (sequence, KV head) also merges; more splits spread the reads over
    more SMs, longer ones amortise each program's prologue and the merge."""

    programs_per_sm: int = 2  # split until the grid has about this many programs per SM
    # No split shorter than this many KV tokens, rounded up to whole BLOCK_N tiles (host and
    # kernel): 4 tiles of a 16-bit cache's 64, 2 of an FP8 cache's 128.
    min_split_tokens: int = 256


DEFAULT_SPLIT_POLICY = SplitPolicy()


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      block_n: int = 64, policy: SplitPolicy = DEFAULT_SPLIT_POLICY) -> int:
    """How many split programs the grid gets per (sequence, KV head): the launch's num_splits.

    Without a split there are num_seqs * num_kv_heads programs. From programs_per_sm per SM
    on, the card is busy and splitting only adds merge work: 1. Below that, split until there
    are about that many programs, but no more than a max_seq_len context can fill with splits
    of min_split_tokens (in whole block_n tiles). (The kernel applies the same minimum to each
    sequence's own length: see decode_split_len.)
    """
    programs = num_seqs * num_kv_heads
    target = policy.programs_per_sm * num_sms
    if programs >= target:
        return 1
    want = math.ceil(target / max(programs, 1))
    by_len = math.ceil(max_seq_len / min_split_len(policy.min_split_tokens, block_n))
    return max(1, min(want, by_len, MAX_SPLITS))


def min_split_len(min_split_tokens: int, block_n: int) -> int:
    """The shortest split, in tokens: min_split_tokens rounded up to whole block_n tiles."""
    return _cdiv(min_split_tokens, block_n) * block_n


def decode_split_len(seq_len: int, num_splits: int, block_n: int, min_split_tokens: int) -> int:
    """Tokens per split of one sequence, as the split kernel computes it: whole tiles, at least
    min_split_len(min_split_tokens, block_n). The sequence has max(1, ceil(seq_len /
    split_len)) active splits."""
    tiles = _cdiv(_cdiv(seq_len, num_splits), block_n)
    return max(tiles * block_n, min_split_len(min_split_tokens, block_n))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_workspace_numel(num_seqs: int, num_q_heads: int, head_dim: int,
                           num_splits: int) -> int:
    """fp32 elements of scratch a launch with num_splits > 1 needs: partial outputs
    [S, Hq, splits, D] + log-sum-exps [S, Hq, splits]. Its contents never matter."""
    return num_seqs * num_q_heads * num_splits * (head_dim + 1)


class SplitWorkspace(NamedTuple):
    part: torch.Tensor  # fp32 [S, Hq, splits, D]: each active split's normalised output
    lse: torch.Tensor  # fp32 [S, Hq, splits]: its log-sum-exp (base 2)
    counters: torch.Tensor  # int32 [S * Hkv]: splits arrived, all 0 between launches


def split_workspace(q: torch.Tensor, num_kv_heads: int, num_splits: int,
                    workspace: torch.Tensor | None, counters: torch.Tensor | None
                    ) -> SplitWorkspace:
    """A split launch's scratch for q [S, Hq, D]: `workspace` and `counters` checked (each
    allocated when None) and the workspace viewed as partial outputs and log-sum-exps."""
    num_seqs, num_q_heads, head_dim = q.shape
    need = decode_workspace_numel(num_seqs, num_q_heads, head_dim, num_splits)
    workspace, counters = _scratch(q, num_kv_heads, need, workspace, counters)
    n_part = num_seqs * num_q_heads * num_splits * head_dim
    part = workspace[:n_part].view(num_seqs, num_q_heads, num_splits, head_dim)
    lse = workspace[n_part:need].view(num_seqs, num_q_heads, num_splits)
    return SplitWorkspace(part, lse, counters)


def _scratch(q: torch.Tensor, num_kv_heads: int, need: int, workspace: torch.Tensor | None,
             counters: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A launch's fp32 workspace of >= need elements and its int32 counters, one per
    (sequence, KV head): checked, each allocated when None."""
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=q.device)
    check(workspace.dtype == torch.float32 and workspace.is_contiguous()
          and workspace.numel() >= need,
          f"workspace must be contiguous fp32 with >= {need} elements")
    if counters is None:
        counters = torch.zeros(q.shape[0] * num_kv_heads, dtype=torch.int32, device=q.device)
    check(counters.dtype == torch.int32 and counters.is_contiguous()
          and counters.numel() >= q.shape[0] * num_kv_heads,
          f"counters must be contiguous int32 with >= {q.shape[0] * num_kv_heads} elements")
    check_same_device(q=q, workspace=workspace, counters=counters)
    return workspace, counters


# A planned launch (decode_plan): tiles, and how many programs the plan aims to spread a step's
# KV over (this many an SM). Picked on an H200 (8B shapes, the contexts of a served
# ShareGPT-like run's steps, replayed from its scheduler) over 2, 4 and 8 an SM and the
# unsplit launch's three tiles; benchmarks/kernels/decode_plan.py measures the pick.
PLAN_PROGRAMS_PER_SM = 8
PLAN_MIN_SPLIT_TOKENS = 256  # rounded up to whole tiles, as SplitPolicy's
PLAN_TILES = DecodeConfig(64, 4, 2, merge_tile=1024)
# When the longest context is at most this many split lengths long, none is cut: a split that
# short buys little balance and costs a merge (batches of equal contexts split for nothing).
PLAN_KEEP_WHOLE = 1.5


def plan_config(head_dim: int, *, fp8: bool = False) -> DecodeConfig:
    """A planned launch's tiles (an FP8 cache's: decode_config's, 128 tokens)."""
    if head_dim <= 128 and not fp8:
        return PLAN_TILES
    return decode_config(head_dim, fp8=fp8)


def decode_plan_capacity(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """The most work items decode_plan lists for num_seqs sequences: one each, plus at most
    one more per PLAN_PROGRAMS_PER_SM * num_sms / num_kv_heads of their total context."""
    return num_seqs + _cdiv(PLAN_PROGRAMS_PER_SM * num_sms, num_kv_heads)


def decode_plan(seq_lens: list[int] | np.ndarray, num_kv_heads: int, num_sms: int, block_n: int,
                capacity: int = 0, keep_whole: float = PLAN_KEEP_WHOLE) -> np.ndarray:
    """A planned decode launch's work, int32 [capacity + 1, 2] (kernels/
    paged_decode_attention.py, `plan`): row 0 (split_len, items), then one (sequence, split)
    row per item, unused rows (-1, 0); capacity 0: exactly the items.

    Every sequence is cut into splits of split_len tokens (whole block_n tiles, at least
    PLAN_MIN_SPLIT_TOKENS), the length at which the contexts' total fills about
    PLAN_PROGRAMS_PER_SM programs an SM: a context many times the step's average no longer
    keeps the launch waiting on its one program. When the longest context is at most
    keep_whole split lengths, the split length is it and nothing is cut. Sequences longest
    first, each one's splits in consecutive rows (the merge finds them there). A sequence of
    length 0 has one item, which writes zeros."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    tiles = max(_cdiv(PLAN_MIN_SPLIT_TOKENS, block_n),
                _cdiv(int(lens.sum()) * num_kv_heads, PLAN_PROGRAMS_PER_SM * num_sms * block_n))
    split_len = tiles * block_n
    longest = int(lens.max(initial=0))
    if longest <= keep_whole * split_len:
        split_len = max(split_len, _cdiv(longest, block_n) * block_n)
    order = np.argsort(-lens, kind="stable")
    splits = np.maximum(1, -(-lens[order] // split_len))
    items = int(splits.sum())
    rows = max(capacity, items)
    assert rows == capacity or not capacity, "more work items than the capacity"
    plan = np.empty((rows + 1, 2), dtype=np.int32)
    plan[0] = split_len, items
    plan[1:items + 1, 0] = np.repeat(order, splits)
    plan[1:items + 1, 1] = np.arange(items) - np.repeat(np.cumsum(splits) - splits, splits)
    plan[items + 1:] = -1, 0
    return plan


class PlanWorkspace(NamedTuple):
    part: torch.Tensor  # fp32 [capacity, Hq, D]: each split item's normalised output
    lse: torch.Tensor  # fp32 [Hq, capacity]: its log-sum-exp (base 2)
    counters: torch.Tensor  # int32 [S * Hkv]: splits arrived, all 0 between launches


def plan_workspace(q: torch.Tensor, num_kv_heads: int, capacity: int,
                   workspace: torch.Tensor | None, counters: torch.Tensor | None
                   ) -> PlanWorkspace:
    """A planned launch's scratch for q [S, Hq, D] and `capacity` items (as split_workspace)."""
    _, num_q_heads, head_dim = q.shape
    need = decode_workspace_numel(capacity, num_q_heads, head_dim, 1)
    workspace, counters = _scratch(q, num_kv_heads, need, workspace, counters)
    n_part = capacity * num_q_heads * head_dim
    return PlanWorkspace(workspace[:n_part].view(capacity, num_q_heads, head_dim),
                         workspace[n_part:need].view(num_q_heads, capacity), counters)


def check_decode_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      out: torch.Tensor | None, policy: SplitPolicy,
                      k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
                      ) -> torch.Tensor:
    """The launcher's argument checks (shapes, dtypes, layouts, devices, the FP8 scales, the
    split policy), as paged_decode_attention documents its arguments. Returns out, allocated
    like q when None."""
    num_seqs = q.shape[0] if q.dim() == 3 else 0
    check_paged_attention(q, k_cache, v_cache, k_scale, v_scale, rows="num_seqs")
    check(block_tables.dtype == torch.int32 and block_tables.dim() == 2
          and block_tables.shape[0] == num_seqs,
          f"block_tables must be int32 [num_seqs, max_blocks], got {block_tables.dtype} "
          f"{tuple(block_tables.shape)}")
    check(block_tables.stride(1) == 1, "block_tables: last dimension must be contiguous")
    check(seq_lens.dtype == torch.int32 and seq_lens.shape == (num_seqs,)
          and seq_lens.is_contiguous(),
          f"seq_lens must be contiguous int32 [num_seqs], got {seq_lens.dtype} "
          f"{tuple(seq_lens.shape)}")
    check(policy.programs_per_sm >= 1 and policy.min_split_tokens >= 1,
          f"bad split policy {policy}")
    out = output_like(q, out)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      seq_lens=seq_lens, out=out)
    return out
