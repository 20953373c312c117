"""Decode attention in benchmarks/kernels/decode_ops.py: old (split + merge launches) vs new (one
launch) at each batch, and the batch-1 sweep of the split policy's min_split_tokens (in whole
tiles).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.kernels.decode_ops_common import (
    Report,
    Shape,
    bench,
    copies_for,
    count_kernels,
    make_kv,
    rnd,
)
from benchmarks.kernels.decode_ops_kernels import Attn, cdiv, new_active_splits, old_active_splits
from benchmarks.lib.timing import rel_err
from tandem.kernels import SplitPolicy, paged_decode_attention_ref
from tandem.kernels._common import num_sms
from tandem.kernels.paged_decode_launch import (
    DEFAULT_SPLIT_POLICY,
    decode_config,
    decode_num_splits,
)


def attention_bytes(b: int, ctx: int, shape: Shape) -> int:
    """K and V of the context, q and out, block-table entries."""
    hq, hkv, d, el = shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.el
    return b * (2 * ctx * hkv * d * el + 2 * hq * d * el + cdiv(ctx, shape.block_size) * 4)


class AttnInputs:
    """copies of (q, out) over one pool, each copy with its own blocks."""

    def __init__(self, shape: Shape, b: int, ctx: int, device: torch.device,
                 args: argparse.Namespace) -> None:
        self.n = copies_for(attention_bytes(b, ctx, shape), device, args)
        self.kv = make_kv(shape, b, ctx, args.graph_capacity, self.n, 2, device)
        self.k_cache, self.v_cache = self.kv.pool[:, 1, 0], self.kv.pool[:, 1, 1]
        self.qs = [rnd(shape, device, b, shape.num_q_heads, shape.head_dim)
                   for _ in range(self.n)]
        self.outs = [torch.empty_like(q) for q in self.qs]
        self.ref = paged_decode_attention_ref(self.qs[0], self.k_cache, self.v_cache,
                                              self.kv.tables[0], self.kv.seq_lens,
                                              shape.head_dim ** -0.5)

    def calls(self, fn: Callable[..., torch.Tensor]) -> list[Callable[[], torch.Tensor]]:
        return [lambda c=c: fn(self.qs[c], self.k_cache, self.v_cache, self.kv.tables[c],
                               self.kv.seq_lens, self.outs[c]) for c in range(self.n)]

    def error(self, fn: Callable[..., torch.Tensor]) -> float:
        self.calls(fn)[0]()
        return rel_err(self.outs[0], self.ref)


def bench_attention(b: int, shape: Shape, rep: Report, device: torch.device,
                    args: argparse.Namespace) -> None:
    """Old (split + merge launches) vs new (one launch), with the grid the engine's graphs use
    and, where different, one sized for the context."""
    ctx, cap = args.context, args.graph_capacity
    inp = AttnInputs(shape, b, ctx, device, args)
    sms, block_n = num_sms(device), decode_config(shape.head_dim).block_n
    grids = {f"(for {cap})": decode_num_splits(b, shape.num_kv_heads, cap, sms, block_n),
             f"(for {ctx})": decode_num_splits(b, shape.num_kv_heads, ctx, sms, block_n)}
    if len(set(grids.values())) == 1:
        grids = {"": grids[f"(for {ctx})"]}
    nbytes = attention_bytes(b, ctx, shape)
    for sized, splits in grids.items():
        attn = Attn(shape, b, splits, device)
        for label, fn, active in (
                ("old", attn.old, old_active_splits(ctx, splits, block_n)),
                ("new", attn.new, new_active_splits(ctx, splits, block_n,
                                                    attn.policy.min_split_tokens))):
            rep.check(f"B={b} attention {label} {sized} vs reference", inp.error(fn))
            calls = inp.calls(fn)
            rep.add(b, f"attention {ctx}", f"{label}: grid {splits}{' ' * bool(sized)}{sized}, {active} active",
                    bench(calls, device, args), nbytes, count_kernels(calls[0], device))
        if int(attn.counters.abs().sum()) != 0:
            rep.failures.append(f"B={b}: split counters not reset")


def sweep_splits(shape: Shape, rep: Report, device: torch.device, args: argparse.Namespace
                 ) -> list[dict[str, Any]]:
    """Batch-1 decode attention over min_split_tokens (in whole tiles), with the grid sized for
    the graph capacity (what the engine's graphs launch); old with a grid of as many splits as
    the new kernel runs (its best case: no one-tile splits)."""
    block_n = decode_config(shape.head_dim).block_n
    grid = decode_num_splits(1, shape.num_kv_heads, args.graph_capacity, num_sms(device),
                             block_n)
    default_mt = cdiv(DEFAULT_SPLIT_POLICY.min_split_tokens, block_n)
    print(f"\nsplit sweep, batch 1, new grid {grid} splits (sized for {args.graph_capacity} "
          "tokens); old grid = the splits the new one runs:")
    print(f"  {'context':>7} {'min_split_tiles':>15} {'active':>6} {'old us':>8} {'new us':>8}"
          f" {'new/old':>7}")
    results: list[dict[str, Any]] = []
    for ctx in args.sweep_contexts:
        inp = AttnInputs(shape, 1, ctx, device, args)
        tiles = cdiv(ctx, block_n)
        for mt in sorted({m for m in (1, 2, 4, 8, 16, 32, 64) if m <= tiles}
                         | {default_mt, tiles}):
            active = new_active_splits(ctx, grid, block_n, mt * block_n)
            new = Attn(shape, 1, grid, device, SplitPolicy(min_split_tokens=mt * block_n))
            old = Attn(shape, 1, active, device)
            times = {}
            for label, fn in (("old", old.old), ("new", new.new)):
                rep.check(f"sweep ctx={ctx} min_split_tiles={mt} {label}", inp.error(fn))
                times[label] = bench(inp.calls(fn), device, args) * 1e6
            r = {"context": ctx, "min_split_tiles": mt, "active_splits": active,
                 "old_us": times["old"], "new_us": times["new"], "default": mt == default_mt}
            results.append(r)
            print(f"  {ctx:>7} {mt:>15} {active:>6} {r['old_us']:>8.2f} {r['new_us']:>8.2f} "
                  f"{r['new_us'] / r['old_us']:>7.2f}" + ("   <- default" if r["default"] else ""),
                  flush=True)
        best = min((r for r in results if r["context"] == ctx), key=lambda r: r["new_us"])
        print(f"  best at {ctx}: min_split_tiles {best['min_split_tiles']} "
              f"({best['active_splits']} splits, {best['new_us']:.2f} us)")
    return results
