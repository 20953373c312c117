"""Unsplit paged decode attention (one program per (sequence, KV head)) over its tile
configurations, registers capped or not (DecodeConfig.max_registers, ptxas's maxnreg: registers
bound how many programs an SM holds, and so how many KV tiles are in flight). Per KV dtype (bf16,
FP8 e4m3), batch and context: each configuration's time, its share of the copy bandwidth and the
programs one SM holds, against the launcher's own pick among its cache's UNSPLIT_CANDIDATES.

    python benchmarks/kernels/decode_tiles.py [--out decode_tiles.json]   # one GPU, ~1 minute
    python benchmarks/kernels/decode_tiles.py --smoke                     # CPU, the interpreter

Llama-3.1-8B attention shapes, 16-token blocks of randomly permuted ids (--ordered-blocks: in
order, as from a fresh pool), inputs replicated past
the L2, each call replayed from a CUDA graph (paged_kernels_common). The last lines are a
table: per dtype, each configuration's time over the launcher pick's, summed over the shapes,
and at its best and worst shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.decode_kv_dtype import to_fp8
from benchmarks.kernels.paged_kernels_common import (
    LLAMA_8B,
    SMOKE,
    add_sweep_args,
    bench,
    config_key,
    copies_for,
    copy_bound,
    fits,
    sweep_device,
)
from benchmarks.kernels.paged_kernels_decode import make_decode_inputs
from benchmarks.lib.timing import rel_err
from tandem.kernels import paged_decode_attention
from tandem.kernels._common import FP8_DTYPE, quantize_fp8_ref, resident_programs
from tandem.kernels.paged_decode_attention import (
    LOG2E,
    _paged_decode_kernel,
    _tiles,
    kernel_consts,
)
from tandem.kernels.paged_decode_launch import (
    UNSPLIT_CANDIDATES,
    UNSPLIT_CANDIDATES_FP8,
    DecodeConfig,
)

D = DecodeConfig
CONFIGS = {  # the candidates the launcher picks among first, then others for comparison
    "bf16": [*UNSPLIT_CANDIDATES, D(64, 4, 3, max_registers=96), D(64, 4, 2, max_registers=80),
             D(32, 2, 4, max_registers=96), D(128, 8, 3)],
    "fp8": [*UNSPLIT_CANDIDATES_FP8, D(128, 4, 3, True), D(64, 4, 3, True),
            D(64, 4, 3, True, 128), D(64, 4, 4, True, 96), D(32, 2, 4, True, 128),
            D(128, 8, 3, True, 128)],
}


def key(cfg: DecodeConfig | None) -> str:
    return "launcher" if cfg is None else config_key(cfg)


def held(inp, k, v, ks, vs, cfg: DecodeConfig, fp8: bool, device: torch.device) -> int:
    """Programs of this configuration one SM holds (from the compiled kernel)."""
    if device.type != "cuda":
        return 0
    shape_consts = kernel_consts(LLAMA_8B.group, k.shape[1], k.shape[3], inp.q.dtype)
    args = (inp.q, k, v, inp.block_tables, inp.seq_lens, inp.out, ks, vs, LOG2E,
            inp.q.stride(0), inp.q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), inp.block_tables.stride(0),
            inp.out.stride(0), inp.out.stride(1))
    compiled = _paged_decode_kernel.warmup(*args, grid=(1, 1), **shape_consts,
                                           **_tiles(cfg, inp.q, fp8))
    return resident_programs(compiled, device)


def run_shape(dtype: str, batch: int, ctx: int, args: argparse.Namespace,
              device: torch.device, bw: float) -> dict[str, Any]:
    shape = SMOKE if args.smoke else LLAMA_8B
    fp8 = dtype == "fp8"
    el = 1 if fp8 else 2
    kv_layer = 2 * batch * ctx * shape.num_kv_heads * shape.head_dim * el
    copies = copies_for(kv_layer)
    if not fits(copies * 3 * kv_layer * (2 if fp8 else 1) * args.layers, device):
        return {"dtype": dtype, "batch": batch, "context": ctx, "skipped": "memory"}
    inputs = [make_decode_inputs(batch, ctx, shape, args.block_size, args.layers, device, False,
                                 args.ordered_blocks)
              for _ in range(copies)]
    caches = []
    for inp in inputs:
        if fp8:  # the whole pool in e4m3, its last layer's views (the engine's layout)
            ks, vs = to_fp8(inp.k_cache)[1], to_fp8(inp.v_cache)[1]
            pool8 = torch.empty(inp.pool.shape, dtype=FP8_DTYPE, device=device)
            pool8[:, :, 0] = quantize_fp8_ref(inp.pool[:, :, 0], ks)
            pool8[:, :, 1] = quantize_fp8_ref(inp.pool[:, :, 1], vs)
            caches.append((pool8[:, -1, 0], pool8[:, -1, 1], ks, vs))
        else:
            caches.append((inp.k_cache, inp.v_cache, None, None))
    scale = shape.head_dim ** -0.5

    def call(i: int, cfg: DecodeConfig | None):
        inp, (k, v, ks, vs) = inputs[i], caches[i]
        return lambda: paged_decode_attention(
            inp.q, k, v, inp.block_tables, inp.seq_lens, scale, out=inp.out, max_seq_len=ctx,
            num_splits=1, config=cfg, k_scale=ks, v_scale=vs)

    reps = max(3, args.reps)
    ref = call(0, None)().clone()
    row: dict[str, Any] = {"dtype": dtype, "batch": batch, "context": ctx, "configs": {}}
    for cfg in [None, *(CONFIGS[dtype] if not args.smoke else CONFIGS[dtype][:2])]:
        try:
            t = bench([call(i, cfg) for i in range(copies)], device, reps)
            err = rel_err(call(0, cfg)(), ref)
            k, v, ks, vs = caches[0]
            n = held(inputs[0], k, v, ks, vs, cfg, fp8, device) if cfg is not None else 0
        except Exception as e:  # noqa: BLE001 - out of resources, compile failure: skip it
            row["configs"][key(cfg)] = {"error": (str(e).splitlines() or [repr(e)])[0][:160]}
            continue
        row["configs"][key(cfg)] = {"us": t * 1e6, "of_copy_bw": kv_layer / t / 1e9 / bw,
                                    "per_sm": n, "rel_err": err}
    inputs.clear()
    caches.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    add_sweep_args(p, [40, 64, 96, 128, 192, 256, 512], [256, 448, 1024, 2048])
    p.add_argument("--layers", type=int, default=1,
                   help="layers in the KV pool (the engine's block-major layout; one is timed)")
    p.add_argument("--ordered-blocks", action="store_true",
                   help="each sequence's blocks in order (a fresh pool) instead of at random")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.contexts, args.reps = [2], [32], 1
    device, card = sweep_device()
    bw = copy_bound(device, args.reps, args.smoke)["gbps"]
    rows = [run_shape(d, b, c, args, device, bw) for d in args.dtypes for c in args.contexts
            for b in args.batches]
    if args.out:
        args.out.write_text(json.dumps({"card": card, "copy_gbps": bw, "rows": rows}, indent=1))
    print(f"# {card}: paged decode attention, unsplit; copy bandwidth {bw:.0f} GB/s")
    for d in args.dtypes:
        done = [r for r in rows if r["dtype"] == d and "configs" in r]
        names = [k for k in done[0]["configs"] if k != "launcher"] if done else []
        print(f"\n{d}: launcher's pick per shape (us, of copy bw)")
        for r in done:
            c = r["configs"]["launcher"]
            best = min((k for k in r["configs"] if "us" in r["configs"][k]),
                       key=lambda k: r["configs"][k]["us"])
            print(f"  b{r['batch']:>4} ctx{r['context']:>5}: {c['us']:8.1f} us "
                  f"{c['of_copy_bw']:6.1%}   best {best} "
                  f"{r['configs'][best]['us'] / c['us']:.3f}x ({r['configs'][best]['of_copy_bw']:.1%})")
        print(f"{d}: time / launcher's, summed over shapes; per SM; best and worst shape")
        for n in names:
            ok = [r for r in done if "us" in r["configs"].get(n, {})]
            if len(ok) < len(done):
                print(f"  {n:<22} failed at {len(done) - len(ok)} shapes")
                continue
            tot = sum(r["configs"][n]["us"] for r in ok) / sum(
                r["configs"]["launcher"]["us"] for r in ok)
            ratios = [r["configs"][n]["us"] / r["configs"]["launcher"]["us"] for r in ok]
            err = max(r["configs"][n]["rel_err"] for r in ok)
            print(f"  {n:<22} {tot:6.3f}  {ok[0]['configs'][n]['per_sm']:>2}/SM  "
                  f"{min(ratios):.3f} .. {max(ratios):.3f}  err {err:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
