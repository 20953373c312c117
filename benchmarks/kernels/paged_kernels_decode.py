"""paged_decode_attention in benchmarks/kernels/paged_kernels.py: time, bandwidth and the ratio to torch SDPA
(flash) on the same KV laid out contiguously, per batch x context; and the sweep of decode tile
configurations and split counts at one shape.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.kernels.paged_kernels_common import Shape, bench, copies_for, fits
from benchmarks.lib.timing import rel_err
from tandem.kernels import paged_decode_attention
from tandem.kernels._common import num_sms
from tandem.kernels.paged_decode_launch import (
    UNSPLIT_CANDIDATES,
    DecodeConfig,
    decode_config,
    decode_num_splits,
    decode_workspace_numel,
)


@dataclass
class DecodeInputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    out: torch.Tensor
    k_contig: torch.Tensor | None  # [B, Hkv, S, D] for SDPA
    v_contig: torch.Tensor | None
    pool: torch.Tensor  # [blocks, layers, 2, block_size, Hkv, D]; k/v_cache: its last layer


def make_decode_inputs(batch: int, ctx: int, shape: Shape, block_size: int, num_layers: int,
                       device: torch.device, contiguous: bool, ordered: bool = False
                       ) -> DecodeInputs:
    """ordered: each sequence's blocks in order, one run after another (a fresh pool, as the
    engine's benchmarks allocate them); else block ids drawn at random (a pool long in use)."""
    nblk = -(-ctx // block_size)  # a context past a whole block takes one more
    num_blocks = batch * nblk
    pool = torch.empty(num_blocks, num_layers, 2, block_size, shape.num_kv_heads,
                       shape.head_dim, dtype=shape.dtype, device=device)
    pool.normal_()
    layer = num_layers - 1
    k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]
    order = (torch.arange(num_blocks, device=device) if ordered
             else torch.randperm(num_blocks, device=device))
    tables = order.to(torch.int32).view(batch, nblk)
    k_contig = v_contig = None
    if contiguous:
        k_contig = torch.empty(batch, shape.num_kv_heads, ctx, shape.head_dim,
                               dtype=shape.dtype, device=device)
        v_contig = torch.empty_like(k_contig)
        for b in range(batch):  # one sequence at a time keeps the temporaries small
            ids = tables[b].long()
            k_contig[b] = k_cache[ids].flatten(0, 1)[:ctx].transpose(0, 1)
            v_contig[b] = v_cache[ids].flatten(0, 1)[:ctx].transpose(0, 1)
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, dtype=shape.dtype, device=device)
    return DecodeInputs(q, k_cache, v_cache, tables.contiguous(),
                        torch.full((batch,), ctx, dtype=torch.int32, device=device),
                        torch.empty_like(q), k_contig, v_contig, pool)


def sdpa_decode_fns(inp: DecodeInputs, shape: Shape, device: torch.device
                    ) -> dict[str, Callable[[], torch.Tensor]]:
    """SDPA on contiguous KV, two ways of expressing GQA without copying K/V."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION] if device.type == "cuda" else [SDPBackend.MATH]
    b, hq, d = inp.q.shape
    k, v = inp.k_contig, inp.v_contig
    assert k is not None and v is not None
    q_gqa = inp.q.view(b, hq, 1, d)
    # Query heads of one group as a query "sequence" of length G over their KV head.
    q_fold = inp.q.view(b, shape.num_kv_heads, shape.group, d)

    def gqa() -> torch.Tensor:
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q_gqa, k, v, enable_gqa=True).view(b, hq, d)

    def fold() -> torch.Tensor:
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q_fold, k, v).view(b, hq, d)

    return {"enable_gqa": gqa, "fold_group": fold}


@dataclass
class DecodeRow:
    batch: int
    context: int
    num_layers: int = 0
    num_splits: int = 0
    paged_us: float = float("nan")
    gbps: float = float("nan")
    copy_share: float = float("nan")
    sdpa_us: float = float("nan")
    sdpa_variant: str = ""
    ratio_vs_sdpa: float = float("nan")
    rel_err_vs_sdpa: float = float("nan")
    skipped: str = ""
    notes: list[str] = field(default_factory=list)


def decode_bytes(batch: int, ctx: int, shape: Shape, block_size: int) -> int:
    el = torch.tensor([], dtype=shape.dtype).element_size()
    kv = 2 * batch * ctx * shape.num_kv_heads * shape.head_dim * el
    q_out = 2 * batch * shape.num_q_heads * shape.head_dim * el
    return kv + q_out + batch * (ctx // block_size) * 4


def bench_decode(batch: int, ctx: int, shape: Shape, args: argparse.Namespace,
                 device: torch.device, copy_gbps: float) -> DecodeRow:
    row = DecodeRow(batch, ctx)
    el = torch.tensor([], dtype=shape.dtype).element_size()
    kv_layer = 2 * batch * ctx * shape.num_kv_heads * shape.head_dim * el
    copies = copies_for(kv_layer)
    for layers in sorted({args.num_layers, 1}, reverse=True):
        if fits(copies * (layers + 1) * kv_layer, device):
            row.num_layers = layers
            break
    else:
        row.skipped = f"memory ({(2 * kv_layer) / 2**30:.0f} GiB needed at 1 layer)"
        return row
    inputs = [make_decode_inputs(batch, ctx, shape, args.block_size, row.num_layers, device,
                                 contiguous=True) for _ in range(copies)]
    splits = decode_num_splits(batch, shape.num_kv_heads, ctx, num_sms(device),
                               decode_config(shape.head_dim).block_n)
    row.num_splits = splits
    ws = torch.empty(decode_workspace_numel(batch, shape.num_q_heads, shape.head_dim, splits),
                     dtype=torch.float32, device=device)
    scale = shape.head_dim ** -0.5
    # The split merge's arrival counters, zero between launches (as the engine keeps them).
    counters = torch.zeros(batch * shape.num_kv_heads, dtype=torch.int32, device=device)

    def paged(inp: DecodeInputs) -> Callable[[], torch.Tensor]:
        return lambda: paged_decode_attention(inp.q, inp.k_cache, inp.v_cache,
                                              inp.block_tables, inp.seq_lens, scale,
                                              out=inp.out, max_seq_len=ctx, workspace=ws,
                                              counters=counters)

    t = bench([paged(i) for i in inputs], device, args.reps)
    row.paged_us = t * 1e6
    row.gbps = decode_bytes(batch, ctx, shape, args.block_size) / t / 1e9
    row.copy_share = row.gbps / copy_gbps

    best = None
    for name, _ in sdpa_decode_fns(inputs[0], shape, device).items():
        fns = [sdpa_decode_fns(i, shape, device)[name] for i in inputs]
        try:
            ts = bench(fns, device, args.reps)
        except RuntimeError as e:
            row.notes.append(f"sdpa {name}: {str(e).splitlines()[0][:120]}")
            continue
        if best is None or ts < best[0]:
            best = (ts, name, fns[0])
    if best is not None:
        row.sdpa_us, row.sdpa_variant = best[0] * 1e6, best[1]
        row.ratio_vs_sdpa = t / best[0]
        paged(inputs[0])()
        row.rel_err_vs_sdpa = rel_err(inputs[0].out, best[2]())
    del inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def sweep_decode(batch: int, ctx: int, shape: Shape, args: argparse.Namespace,
                 device: torch.device, copy_gbps: float) -> list[dict[str, Any]]:
    """Time decode tile configurations and split counts at one shape, fastest first."""
    el = torch.tensor([], dtype=shape.dtype).element_size()
    kv_layer = 2 * batch * ctx * shape.num_kv_heads * shape.head_dim * el
    copies = copies_for(kv_layer)
    if not fits(copies * 2 * kv_layer, device):
        return []
    inputs = [make_decode_inputs(batch, ctx, shape, args.block_size, 1, device, False)
              for _ in range(copies)]
    scale = shape.head_dim ** -0.5
    ref = paged_decode_attention(inputs[0].q, inputs[0].k_cache, inputs[0].v_cache,
                                 inputs[0].block_tables, inputs[0].seq_lens, scale).clone()
    default = decode_config(shape.head_dim)
    auto_splits = decode_num_splits(batch, shape.num_kv_heads, ctx, num_sms(device),
                                    default.block_n)
    if args.smoke:
        configs = [default, DecodeConfig(32, 4, 2)]
        split_options = [1, 2]
    else:
        configs = [DecodeConfig(n, w, s) for n in (32, 64, 128) for w in (4, 8)
                   for s in (2, 3, 4, 5) if not (n == 128 and s == 5)]
        split_options = sorted({1, 2, auto_splits})
    ws = torch.empty(decode_workspace_numel(batch, shape.num_q_heads, shape.head_dim,
                                            max(split_options)),
                     dtype=torch.float32, device=device)
    nbytes = decode_bytes(batch, ctx, shape, args.block_size)
    sweep_counters = torch.zeros(batch * shape.num_kv_heads, dtype=torch.int32, device=device)
    results = []
    for cfg in configs:
        for splits in split_options:
            def fn(inp: DecodeInputs, cfg: DecodeConfig = cfg, splits: int = splits
                   ) -> Callable[[], torch.Tensor]:
                return lambda: paged_decode_attention(
                    inp.q, inp.k_cache, inp.v_cache, inp.block_tables, inp.seq_lens, scale,
                    out=inp.out, num_splits=splits, workspace=ws, config=cfg,
                    counters=sweep_counters)
            entry: dict[str, Any] = {**cfg._asdict(), "num_splits": splits,
                                     "default": cfg == default and splits == auto_splits}
            try:
                t = bench([fn(i) for i in inputs], device, max(3, args.reps // 2))
                err = rel_err(inputs[0].out, ref)
            except Exception as e:  # noqa: BLE001 - out of shared memory, compile failure: skip the config
                entry["error"] = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                results.append(entry)
                continue
            entry.update(us=t * 1e6, gbps=nbytes / t / 1e9, copy_share=nbytes / t / 1e9 / copy_gbps,
                         rel_err=err)
            results.append(entry)
    del inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return sorted(results, key=lambda r: r.get("us", float("inf")))


def sweep_unsplit_tiles(batches: list[int], contexts: list[int], shape: Shape,
                        args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Each of UNSPLIT_CANDIDATES at every batch x context, unsplit, and the one the launcher
    picks (`config=None`): its time against the first candidate's and the fastest's. One
    block-major pool with the rows' block ids drawn at random from all of it."""
    nblk = max(contexts) // args.block_size
    num_blocks = max(batches) * nblk
    pool = torch.empty(num_blocks, args.num_layers, 2, args.block_size, shape.num_kv_heads,
                       shape.head_dim, dtype=shape.dtype, device=device)
    pool.uniform_(-1, 1)
    k_cache, v_cache = pool[:, -1, 0], pool[:, -1, 1]
    scale = shape.head_dim ** -0.5
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        for ctx in contexts:
            n = ctx // args.block_size
            tables = torch.randperm(num_blocks, generator=g)[:batch * n].view(batch, n)
            tables = tables.to(torch.int32).to(device)
            q = torch.randn(batch, shape.num_q_heads, shape.head_dim, dtype=shape.dtype,
                            device=device)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            outs = [torch.empty_like(q) for _ in range(2)]

            def fn(out: torch.Tensor, cfg: DecodeConfig | None, q: torch.Tensor = q,
                   tables: torch.Tensor = tables, seq_lens: torch.Tensor = seq_lens
                   ) -> Callable[[], torch.Tensor]:
                return lambda: paged_decode_attention(q, k_cache, v_cache, tables, seq_lens,
                                                      scale, out=out, num_splits=1, config=cfg)

            times = [bench([fn(o, c) for o in outs], device, args.reps)
                     for c in (*UNSPLIT_CANDIDATES, None)]
            ref = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale,
                                         num_splits=1, config=UNSPLIT_CANDIDATES[0])
            err = rel_err(paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale,
                                                 num_splits=1), ref)
            rows.append({"batch": batch, "context": ctx, "us": [t * 1e6 for t in times[:-1]],
                         "picked_us": times[-1] * 1e6, "rel_err": err})
    del pool
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows
