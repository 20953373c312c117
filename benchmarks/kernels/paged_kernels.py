"""Benchmark the Triton kernels on one GPU.

    python benchmarks/kernels/paged_kernels.py [--out kernels.json]          # the full run (H100/H200: minutes)
    python benchmarks/kernels/paged_kernels.py --smoke                        # tiny shapes; CPU works (interpreter)

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

    python benchmarks/kernels/paged_kernels.py --tiles [--out tiles.json]  # unsplit tile picks

--tiles measures, instead, the launcher's choice of tiles for unsplit decode launches
(kernels/paged_decode_launch.py UNSPLIT_CANDIDATES): every candidate and the one picked at each
decode-graph batch (--tile-batches) x context (--tile-contexts), with the picked one's time
against the first candidate's and the fastest's, summed over bands of batches.

Timings: every measured call is captured in a CUDA graph (no launch overhead in the numbers);
inputs smaller than the L2 are replicated and cycled through so each call reads from DRAM.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


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
    p.add_argument("--tiles", action="store_true",
                   help="only the unsplit tile candidates over --tile-batches x --tile-contexts")
    p.add_argument("--tile-batches", type=int, nargs="+", default=list(range(40, 513, 8)))
    p.add_argument("--tile-contexts", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else parse_args([])

from benchmarks.lib.timing import gpu_or_smoke  # noqa: E402

gpu_or_smoke(ARGS.smoke)

# These import our kernels: TRITON_INTERPRET must be set first.
from benchmarks.kernels.paged_kernels_cases import bench_copy_blocks, bench_prefill  # noqa: E402
from benchmarks.kernels.paged_kernels_common import LLAMA_8B, SMOKE, copy_bound  # noqa: E402
from benchmarks.kernels.paged_kernels_decode import (  # noqa: E402
    bench_decode,
    sweep_decode,
    sweep_unsplit_tiles,
)
from tandem.kernels._common import num_sms  # noqa: E402

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

    if args.tiles:
        results["tiles"] = report_tiles(args, shape, device)
        if args.out:
            args.out.write_text(json.dumps(results, indent=2, default=str))
        return

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


def report_tiles(args: argparse.Namespace, shape, device: torch.device) -> list[dict]:
    """The --tiles run: a line per batch x context, then the sums over bands of batches."""
    from tandem.kernels.paged_decode_launch import UNSPLIT_CANDIDATES

    batches, contexts = ([8, 16], [64]) if args.smoke else (args.tile_batches, args.tile_contexts)
    names = [f"{c.block_n}/{c.num_warps}/{c.num_stages}" for c in UNSPLIT_CANDIDATES]
    print("\nunsplit decode tiles (block_n/warps/stages): us each, the picked one's; "
          "x: picked / first, picked / fastest")
    rows = sweep_unsplit_tiles(batches, contexts, shape, args, device)
    for r in rows:
        print(f"B={r['batch']:<4} ctx={r['context']:<5} " + "  ".join(
            f"{n} {t:7.1f}" for n, t in zip(names, r["us"]))
            + f"  picked {r['picked_us']:7.1f}  x {r['picked_us'] / r['us'][0]:.3f} "
            f"{r['picked_us'] / min(r['us']):.3f}  err {r['rel_err']:.1e}")
    edges = sorted({0, 128, 256, max(batches)})
    print("\nbatches      picked / first   fastest each time / first   worst picked / first")
    for lo, hi in itertools.pairwise(edges):
        band = [r for r in rows if lo < r["batch"] <= hi]
        if band:
            first = sum(r["us"][0] for r in band)
            print(f"{lo + 1:>4}-{hi:<4} {sum(r['picked_us'] for r in band) / first:>14.3f} "
                  f"{sum(min(r['us']) for r in band) / first:>27.3f} "
                  f"{max(r['picked_us'] / r['us'][0] for r in band):>22.3f}")
    return rows


if __name__ == "__main__":
    main()
