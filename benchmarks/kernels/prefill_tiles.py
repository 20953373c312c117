"""Paged prefill attention over its tile configurations (kernels/paged_prefill_attention.py
PrefillConfig: query rows a program, keys an iteration, warps, pipeline stages) at the chunk
sizes steps carry: a mixed step's chunk of a few hundred tokens over a short context, up to a
2,048-token chunk. Each configuration's time per shape against the default's (prefill_config).

    python benchmarks/kernels/prefill_tiles.py [--out prefill_tiles.json]   # one GPU, ~30 s
    python benchmarks/kernels/prefill_tiles.py --smoke                      # CPU, the interpreter

Llama-3.1-8B attention shapes (32 query heads over 8 KV heads, head_dim 128), bf16, 16-token
blocks of randomly permuted ids, each call replayed from a CUDA graph (paged_kernels_common).
The last lines: each configuration's time summed over the shapes, over the default's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.paged_kernels_cases import make_prefill_inputs
from benchmarks.kernels.paged_kernels_common import LLAMA_8B, SMOKE, bench, sweep_device
from benchmarks.lib.timing import rel_err
from tandem.kernels.paged_prefill_attention import PrefillConfig, prefill_config

P = PrefillConfig
OTHERS = [P(128, 64, 8, 2), P(64, 64, 4, 2), P(64, 32, 4, 2), P(128, 32, 8, 2), P(128, 64, 4, 2),
          P(32, 64, 4, 2), P(64, 128, 4, 2), P(128, 128, 8, 2)]
# (sequences, chunk tokens, cached tokens before the chunk)
SHAPES = [(1, 144, 0), (1, 144, 300), (1, 256, 0), (2, 128, 200), (1, 64, 500), (4, 64, 100),
          (1, 512, 0), (1, 2048, 0)]


def run_shape(batch: int, chunk: int, cached: int, configs: list[PrefillConfig], shape,
              device: torch.device, reps: int, block_size: int) -> dict:
    inp = make_prefill_inputs(batch, chunk, cached, shape, block_size, device)
    ref = inp.call(configs[0])().clone()
    row: dict = {"batch": batch, "chunk": chunk, "cached": cached, "configs": {}}
    for cfg in configs:
        try:
            err = rel_err(inp.call(cfg)(), ref)
            t = bench([inp.call(cfg)], device, reps, min_calls=20)
        except Exception as e:  # noqa: BLE001 - out of shared memory, a compile failure: skip
            row["configs"][key(cfg)] = {"error": (str(e).splitlines() or [repr(e)])[0][:160]}
            continue
        row["configs"][key(cfg)] = {"us": t * 1e6, "rel_err": err}
    return row


def key(cfg: PrefillConfig) -> str:
    return f"m{cfg.block_m}/n{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: the interpreter)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device, card = sweep_device()
    shape = SMOKE if args.smoke else LLAMA_8B
    default = prefill_config(shape.head_dim, shape.group)
    configs = [default, *(c for c in OTHERS if c != default)]
    shapes = [(1, 24, 0), (2, 16, 40)] if args.smoke else SHAPES
    if args.smoke:
        configs, args.reps = [default, P(32, 16, 4, 1)], 1
    rows = [run_shape(b, c, k, configs, shape, device, args.reps, args.block_size)
            for b, c, k in shapes]
    if args.out:
        args.out.write_text(json.dumps({"card": card, "rows": rows}, indent=1))
    names = [key(c) for c in configs]
    print(f"# {card}: paged prefill attention, us a call; first column the default")
    print(f"{'sequences x chunk over cached':<30}" + "".join(f"{n:>15}" for n in names))
    for r in rows:
        cells = [r["configs"][n] for n in names]
        print(f"{r['batch']} x {r['chunk']} over {r['cached']:<17}"
              + "".join(f"{c['us']:>15.1f}" if "us" in c else f"{'failed':>15}" for c in cells))
    base = sum(r["configs"][names[0]]["us"] for r in rows)
    print("summed over the shapes, over the default's:")
    for n in names:
        done = [r for r in rows if "us" in r["configs"][n]]
        if len(done) < len(rows):
            print(f"  {n:<16} failed at {len(rows) - len(done)} shapes")
            continue
        err = max(r["configs"][n]["rel_err"] for r in rows)
        print(f"  {n:<16} {sum(r['configs'][n]['us'] for r in rows) / base:6.3f}  err {err:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
