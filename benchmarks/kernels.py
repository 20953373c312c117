"""Benchmark the Triton kernels on one GPU.

    python benchmarks/kernels.py [--out kernels.json]          # the full run (H100/H200: minutes)
    python benchmarks/kernels.py --smoke                        # tiny shapes; CPU works (interpreter)

What it measures, all in one run on one card (the card's name is printed and recorded):
  1. copy bandwidth: one large device-to-device copy, (bytes read + bytes written) / time;
  2. paged_decode_attention at Llama-3.1-8B attention shapes (32 q heads, 8 KV heads, D 128,
     bf16, block size 16) for batch x context, reading strided per-layer views of a block-major
     pool [N, L, 2, 16, 8, 128] through block tables of randomly permuted block ids: time,
     achieved bandwidth (KV + q + out + block-table bytes / time), its share of the copy
     bandwidth, and torch SDPA with the flash backend on the same KV laid out contiguously
     ([B, H, S, D]; GQA through enable_gqa, or by folding the query group into the query-length
     dimension, whichever is faster) -> the ratio paged / SDPA (< 1 means faster), plus the
     relative error between the two outputs;
  3. a sweep of decode tile configurations at batch 64 x 4k (to tune decode_config);
  4. paged_prefill_attention for a few chunk / cached-context shapes (TFLOP/s; SDPA flash
     causal for comparison where there is no cached context);
  5. copy_blocks: 128 random blocks of an 8B-shaped pool (32 layers, 8 KV heads, D 128,
     bs 16 = 2 MiB a block) vs one large copy of the same bytes and torch indexing.

Timings: every measured call is captured in a CUDA graph (no launch overhead in the numbers);
inputs smaller than the L2 are replicated and cycled through so each call reads from DRAM.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

L2_WORKING_SET = 256 << 20  # bytes of distinct inputs per timed graph (H100 L2: 50 MiB)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096, 8192, 32768])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=2,
                   help="layers of the benchmark pool (strided views); drops to 1 when a "
                        "shape does not fit otherwise")
    p.add_argument("--reps", type=int, default=10, help="timed graph replays (median)")
    p.add_argument("--no-sweep", action="store_true", help="skip the decode tile sweep")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--no-copy-blocks", action="store_true")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, to check the script; runs on CPU under TRITON_INTERPRET")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else parse_args([])

from benchmarks.timing import copy_bandwidth, eager_time, gpu_or_smoke, graph_time, rel_err  # noqa: E402

gpu_or_smoke(ARGS.smoke)

from kernels import (  # noqa: E402  (TRITON_INTERPRET must be set first)
    copy_blocks,
    paged_decode_attention,
    paged_prefill_attention,
)
from kernels._common import num_sms  # noqa: E402
from kernels.paged_decode_launch import (  # noqa: E402
    DecodeConfig,
    decode_config,
    decode_num_splits,
    decode_workspace_numel,
)


@dataclass(frozen=True)
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


LLAMA_8B = Shape(32, 8, 128, torch.bfloat16)
SMOKE = Shape(8, 2, 64, torch.float32)


# ----------------------------------------------------------------------------- timing

def bench(fns: list[Callable[[], object]], device: torch.device, reps: int,
          min_calls: int = 20) -> float:
    """Seconds per call, cycling through fns (one per input copy). On CUDA the calls run
    from one captured graph; if capture fails they run eagerly (with launch overhead)."""
    for f in fns:
        f()  # compile, warm up
    calls = fns * max(1, math.ceil(min_calls / len(fns)))
    if device.type == "cuda":
        try:
            return graph_time(calls, reps)
        except RuntimeError as e:  # a path that cannot be captured
            print(f"  (graph capture failed, timing eagerly: {str(e).splitlines()[0]})")
            torch.cuda.synchronize()
    return eager_time(calls, max(1, reps // 3) if device.type == "cpu" else reps, device)


def copies_for(nbytes: int) -> int:
    """How many copies of an input of nbytes make the timed working set exceed the L2."""
    if not torch.cuda.is_available():
        return 1
    return max(1, min(32, math.ceil(L2_WORKING_SET / max(nbytes, 1))))


def fits(nbytes: int, device: torch.device, slack: int = 2 << 30) -> bool:
    if device.type != "cuda":
        return nbytes < (4 << 30)
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes + slack < free


# ----------------------------------------------------------------------------- copy bandwidth

def copy_bound(device: torch.device, reps: int, smoke: bool) -> dict[str, float]:
    nbytes = (16 << 20) if smoke else (1 << 30)
    gbps = copy_bandwidth(device, nbytes, max(3, reps // 4))
    return {"bytes": nbytes, "seconds": 2 * nbytes / gbps / 1e9, "gbps": gbps}


# ----------------------------------------------------------------------------- decode

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


def make_decode_inputs(batch: int, ctx: int, shape: Shape, block_size: int, num_layers: int,
                       device: torch.device, contiguous: bool) -> DecodeInputs:
    nblk = ctx // block_size
    num_blocks = batch * nblk
    pool = torch.empty(num_blocks, num_layers, 2, block_size, shape.num_kv_heads,
                       shape.head_dim, dtype=shape.dtype, device=device)
    pool.normal_()
    layer = num_layers - 1
    k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, nblk)
    k_contig = v_contig = None
    if contiguous:
        k_contig = torch.empty(batch, shape.num_kv_heads, ctx, shape.head_dim,
                               dtype=shape.dtype, device=device)
        v_contig = torch.empty_like(k_contig)
        for b in range(batch):  # one sequence at a time keeps the temporaries small
            ids = tables[b].long()
            k_contig[b] = k_cache[ids].reshape(ctx, shape.num_kv_heads, -1).transpose(0, 1)
            v_contig[b] = v_cache[ids].reshape(ctx, shape.num_kv_heads, -1).transpose(0, 1)
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, dtype=shape.dtype, device=device)
    return DecodeInputs(q, k_cache, v_cache, tables.contiguous(),
                        torch.full((batch,), ctx, dtype=torch.int32, device=device),
                        torch.empty_like(q), k_contig, v_contig)


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


# ----------------------------------------------------------------------------- prefill

def bench_prefill(batch: int, chunk: int, cached: int, shape: Shape, args: argparse.Namespace,
                  device: torch.device) -> dict[str, Any]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bs = args.block_size
    seq_len = cached + chunk
    nblk = -(seq_len // -bs)
    el = torch.tensor([], dtype=shape.dtype).element_size()
    need = batch * nblk * bs * 2 * shape.num_kv_heads * shape.head_dim * el * 2
    row: dict[str, Any] = {"batch": batch, "chunk": chunk, "cached": cached}
    if not fits(need, device):
        row["skipped"] = "memory"
        return row
    pool = torch.randn(batch * nblk, 1, 2, bs, shape.num_kv_heads, shape.head_dim,
                       dtype=shape.dtype, device=device)
    tables = torch.randperm(batch * nblk, device=device).to(torch.int32).view(batch, nblk)
    q = torch.randn(batch * chunk, shape.num_q_heads, shape.head_dim, dtype=shape.dtype,
                    device=device)
    out = torch.empty_like(q)
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * chunk
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    scale = shape.head_dim ** -0.5
    t = bench([lambda: paged_prefill_attention(q, pool[:, 0, 0], pool[:, 0, 1], qsl, lens,
                                               tables.contiguous(), scale, chunk, out=out)],
              device, args.reps, min_calls=5)
    visible = batch * (chunk * cached + chunk * (chunk + 1) // 2)
    flops = 4 * shape.num_q_heads * shape.head_dim * visible
    row.update(us=t * 1e6, tflops=flops / t / 1e12)
    if cached == 0:
        # Same keys, contiguous, SDPA flash causal (aligned top-left = bottom-right here).
        k = pool[:, 0, 0][tables.long()].reshape(batch, -1, shape.num_kv_heads,
                                                 shape.head_dim)[:, :chunk].transpose(1, 2)
        v = pool[:, 0, 1][tables.long()].reshape(batch, -1, shape.num_kv_heads,
                                                 shape.head_dim)[:, :chunk].transpose(1, 2)
        k, v = k.contiguous(), v.contiguous()
        qb = q.view(batch, chunk, shape.num_q_heads, shape.head_dim).transpose(1, 2)
        backends = [SDPBackend.FLASH_ATTENTION] if device.type == "cuda" else [SDPBackend.MATH]

        def sdpa() -> torch.Tensor:
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(qb, k, v, is_causal=True, enable_gqa=True)

        try:
            ts = bench([sdpa], device, args.reps, min_calls=5)
            row.update(sdpa_us=ts * 1e6, ratio_vs_sdpa=t / ts,
                       rel_err_vs_sdpa=rel_err(out.view(batch, chunk, shape.num_q_heads, -1),
                                               sdpa().transpose(1, 2)))
        except RuntimeError as e:
            row["sdpa_error"] = str(e).splitlines()[0][:160]
    return row


# ----------------------------------------------------------------------------- copy_blocks

def bench_copy_blocks(args: argparse.Namespace, device: torch.device,
                      copy_gbps: float) -> dict[str, Any]:
    if args.smoke:
        block_shape, num_blocks, moved = (2, 2, 16, 2, 64), 64, 16
        dtype = torch.float32
    else:
        block_shape, num_blocks, moved = (32, 2, 16, 8, 128), 512, 128
        dtype = torch.bfloat16
    src = torch.randn(num_blocks, *block_shape, dtype=dtype, device=device)
    dst = torch.zeros_like(src)
    src_ids = torch.randperm(num_blocks, device=device)[:moved]
    dst_ids = torch.randperm(num_blocks, device=device)[:moved]
    block_bytes = src[0].numel() * src.element_size()
    payload = moved * block_bytes
    flat_src, flat_dst = src.view(-1), dst.view(-1)
    n = payload // src.element_size()

    t_kernel = bench([lambda: copy_blocks(src, dst, src_ids, dst_ids)], device, args.reps, 5)
    ok = torch.equal(dst[dst_ids], src[src_ids])
    t_cow = bench([lambda: copy_blocks(dst, dst, dst_ids[: moved // 2], dst_ids[moved // 2:])],
                  device, args.reps, 5)
    t_big = bench([lambda: flat_dst[:n].copy_(flat_src[:n])], device, args.reps, 5)

    def index_copy() -> None:
        dst[dst_ids] = src[src_ids]

    t_index = bench([index_copy], device, args.reps, 5)

    def gbps(t: float, nbytes: int = payload) -> float:
        return 2 * nbytes / t / 1e9  # read + write, as the copy bandwidth

    return {
        "blocks": moved, "block_bytes": block_bytes, "correct": ok,
        "copy_blocks_us": t_kernel * 1e6, "copy_blocks_gbps": gbps(t_kernel),
        "same_pool_cow_gbps": gbps(t_cow, payload // 2),
        "one_large_copy_us": t_big * 1e6, "one_large_copy_gbps": gbps(t_big),
        "torch_index_gbps": gbps(t_index),
        "vs_one_large_copy": t_big / t_kernel,
        "copy_share": gbps(t_kernel) / copy_gbps,
    }


# ----------------------------------------------------------------------------- report

def fmt(x: float, spec: str) -> str:
    return "-" if x != x else format(x, spec)  # NaN -> "-"


def main() -> None:
    args = ARGS
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SMOKE if args.smoke else LLAMA_8B
    if args.smoke:
        args.batches, args.contexts = [1, 2], [64, 128]
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    import triton
    print(f"card: {card}   torch {torch.__version__}   triton {triton.__version__}   "
          f"SMs {num_sms(device)}")
    print(f"shape: {shape.num_q_heads} q heads, {shape.num_kv_heads} kv heads, "
          f"D {shape.head_dim}, {str(shape.dtype).removeprefix('torch.')}, "
          f"block size {args.block_size}")
    results: dict[str, Any] = {"card": card, "torch": torch.__version__,
                               "triton": triton.__version__,
                               "shape": {**asdict(shape), "dtype": str(shape.dtype)},
                               "block_size": args.block_size}

    copy = copy_bound(device, args.reps, args.smoke)
    results["copy_bandwidth"] = copy
    print(f"\ncopy bandwidth: {copy['gbps']:.0f} GB/s (read + write, {copy['bytes'] >> 20} MiB)")

    rows = []
    for batch in args.batches:
        for ctx in args.contexts:
            row = bench_decode(batch, ctx, shape, args, device, copy["gbps"])
            rows.append(row)
            print(f"decode B={batch:<4} ctx={ctx:<6} "
                  + (f"skipped: {row.skipped}" if row.skipped else
                     f"{row.paged_us:9.1f} us  {row.gbps:7.0f} GB/s  "
                     f"{100 * row.copy_share:5.1f}% copy  splits {row.num_splits}  "
                     f"sdpa {fmt(row.sdpa_us, '9.1f')} us ({row.sdpa_variant})  "
                     f"ratio {fmt(row.ratio_vs_sdpa, '.3f')}  err {fmt(row.rel_err_vs_sdpa, '.1e')}"),
                  *row.notes, flush=True)
    results["decode"] = [asdict(r) for r in rows]

    if not args.no_sweep:
        sb, sc = (2, 128) if args.smoke else (64, 4096)
        print(f"\ndecode tile sweep at B={sb} ctx={sc} (fastest first):")
        sweep = sweep_decode(sb, sc, shape, args, device, copy["gbps"])
        results["decode_sweep"] = {"batch": sb, "context": sc, "results": sweep}
        for r in sweep[:8] + [r for r in sweep[8:] if r.get("default")]:
            if "us" in r:
                print(f"  block_n {r['block_n']:>3} warps {r['num_warps']} stages "
                      f"{r['num_stages']} splits {r['num_splits']:>2}: {r['us']:8.1f} us "
                      f"{100 * r['copy_share']:5.1f}% copy  err {r['rel_err']:.1e}"
                      + ("   <- default" if r["default"] else ""))
        failed = [r for r in sweep if "error" in r]
        if failed:
            print(f"  ({len(failed)} configs failed, e.g. {failed[0]['error']})")

    if not args.no_prefill:
        prefill_shapes = ([(1, 32, 0), (2, 16, 64)] if args.smoke else
                          [(1, 2048, 0), (4, 2048, 0), (1, 2048, 30720), (8, 512, 4096),
                           (16, 256, 8192)])
        print("\nprefill (batch x chunk over cached context):")
        pre = []
        for batch, chunk, cached in prefill_shapes:
            r = bench_prefill(batch, chunk, cached, shape, args, device)
            pre.append(r)
            print(f"  B={batch:<3} chunk={chunk:<5} cached={cached:<6} "
                  + (f"skipped: {r['skipped']}" if "skipped" in r else
                     f"{r['us']:9.1f} us  {r['tflops']:6.1f} TFLOP/s"
                     + (f"  sdpa {r['sdpa_us']:9.1f} us  ratio {r['ratio_vs_sdpa']:.3f}  "
                        f"err {r['rel_err_vs_sdpa']:.1e}" if "sdpa_us" in r else "")),
                  flush=True)
        results["prefill"] = pre

    if not args.no_copy_blocks:
        cb = bench_copy_blocks(args, device, copy["gbps"])
        results["copy_blocks"] = cb
        print(f"\ncopy_blocks: {cb['blocks']} x {cb['block_bytes'] >> 10} KiB blocks: "
              f"{cb['copy_blocks_us']:.1f} us, {cb['copy_blocks_gbps']:.0f} GB/s "
              f"({cb['vs_one_large_copy']:.2f} x one large copy at "
              f"{cb['one_large_copy_gbps']:.0f} GB/s; torch indexing {cb['torch_index_gbps']:.0f}"
              f" GB/s; same-pool {cb['same_pool_cow_gbps']:.0f} GB/s) correct={cb['correct']}")

    # The compact table, last.
    print(f"\n== paged decode, {card}, copy bandwidth {copy['gbps']:.0f} GB/s ==")
    print(f"{'batch':>5} {'ctx':>6} {'splits':>6} {'paged us':>9} {'GB/s':>6} {'%copy':>6} "
          f"{'sdpa us':>9} {'paged/sdpa':>10} {'err':>8}")
    for r in rows:
        if r.skipped:
            print(f"{r.batch:>5} {r.context:>6}  skipped: {r.skipped}")
            continue
        print(f"{r.batch:>5} {r.context:>6} {r.num_splits:>6} {r.paged_us:>9.1f} "
              f"{r.gbps:>6.0f} {100 * r.copy_share:>5.1f}% {fmt(r.sdpa_us, '>9.1f')} "
              f"{fmt(r.ratio_vs_sdpa, '>10.3f')} {fmt(r.rel_err_vs_sdpa, '>8.1e')}")
    target = next((r for r in rows if r.batch == 64 and r.context == 4096 and not r.skipped),
                  None)
    if target is None and not args.smoke:
        target = next((r for r in rows if r.batch == 64 and r.context in (2048, 8192)
                       and not r.skipped), None)
    if target is not None:
        ok_bw = target.copy_share >= 0.85
        ok_sdpa = target.ratio_vs_sdpa <= 1.05
        verdict = (f"target B={target.batch} ctx={target.context}: "
                   f"{100 * target.copy_share:.1f}% of copy bandwidth "
                   f"({'PASS' if ok_bw else 'FAIL'} >= 85%), "
                   f"{fmt(target.ratio_vs_sdpa, '.3f')} x SDPA flash "
                   f"({'PASS' if ok_sdpa else 'FAIL'} <= 1.05)")
        results["target"] = {"batch": target.batch, "context": target.context,
                             "copy_share": target.copy_share,
                             "ratio_vs_sdpa": target.ratio_vs_sdpa,
                             "pass": ok_bw and ok_sdpa}
        print(verdict)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
