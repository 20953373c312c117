"""The projections' GEMMs by row count: is a step of M tokens cheaper as one GEMM, or with its
rows in two GEMMs, with cuBLAS or cuBLASLt?

A step's rows (its decodes and prompt tokens, padded to a CUDA graph's size) go through the
four projections of every layer: Llama-3.1-8B's merged q/k/v (6,144 × 4,096), o_proj (4,096 ×
4,096), merged gate/up (28,672 × 4,096) and down (4,096 × 14,336). For each row count M this
times the 32 layers' four GEMMs (each layer its own weights, so nothing comes from the L2),
captured in one CUDA graph and replayed:

  one        F.linear over all M rows (what the engine runs), with each BLAS library;
  split S    rows [0, S) and [S, M) as two GEMMs into one output, S on a grid of 64 rows.

    python benchmarks/kernels/gemm_rows.py [--rows 64 128 ... ] [--out gemm_rows.json]
    python benchmarks/kernels/gemm_rows.py --rows 440 448 456 --by-projection --no-splits
    python benchmarks/kernels/gemm_rows.py --lm-head --rows 1 16 64 136 256 488 512
    python benchmarks/kernels/gemm_rows.py --smoke          # CPU, tiny

Each row of the table: ms for the 32 layers, the rate in TFLOP/s, the best split and its time
over one GEMM's. --lm-head times the LM head instead (128,256 × 4,096, into a float32 buffer as
a CUDA graph's logits): the bf16 product then converted, against float32 written by the GEMM
(engine/models/layers.py float_logits).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.paged_kernels_common import bench, sweep_device

PROJECTIONS_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
PROJECTIONS_SMOKE = ((96, 64), (64, 64), (256, 64), (64, 128))
# The engine's graph sizes: decode batches on a ladder of 8 up to 512, mixed steps' tokens.
DEFAULT_ROWS = [16, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448, 480, 512,
                768, 1024, 1536, 2048]


class Gemms:
    """The four projections of every layer over M rows of activations."""

    def __init__(self, rows: int, projections, layers: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.rows = rows
        self.weights = [[torch.randn(n, k, dtype=dtype, device=device) * k ** -0.5
                         for n, k in projections] for _ in range(layers)]
        self.x = {k: torch.randn(rows, k, dtype=dtype, device=device)
                  for k in {k for _, k in projections}}
        self.y = {n: torch.empty(rows, n, dtype=dtype, device=device)
                  for n in {n for n, _ in projections}}
        self.flops = 2 * rows * layers * sum(n * k for n, k in projections)

    def call(self, split: int | None, projection: int | None = None):
        def run() -> None:
            for layer in self.weights:
                for w in (layer if projection is None else layer[projection:projection + 1]):
                    x, y = self.x[w.shape[1]], self.y[w.shape[0]]
                    if split is None:
                        torch.mm(x, w.t(), out=y)
                    else:
                        torch.mm(x[:split], w.t(), out=y[:split])
                        torch.mm(x[split:], w.t(), out=y[split:])
        return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", type=int, default=DEFAULT_ROWS)
    p.add_argument("--split-grid", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--by-projection", action="store_true",
                   help="also time each projection alone (cuBLAS, one GEMM)")
    p.add_argument("--no-splits", action="store_true")
    p.add_argument("--lm-head", action="store_true",
                   help="the LM head's float32 logits two ways, instead of the projections")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device, card = sweep_device()
    if args.lm_head:
        return lm_head(args, device, card)
    if args.smoke:
        projections, layers, dtype = PROJECTIONS_SMOKE, 2, torch.float32
        args.rows, args.reps, args.split_grid = [24, 40], 1, 16
    else:
        projections, layers, dtype = PROJECTIONS_8B, 32, torch.bfloat16
    libraries = ["cublas", "cublaslt"] if device.type == "cuda" else ["default"]
    results = []
    for m in args.rows:
        g = Gemms(m, projections, layers, dtype, device)
        row: dict = {"rows": m, "one": {}, "split": {}}
        for lib in libraries:
            if device.type == "cuda":
                torch.backends.cuda.preferred_blas_library(lib)
            row["one"][lib] = bench([g.call(None)], device, args.reps, min_calls=1) * 1e3
        if device.type == "cuda":
            torch.backends.cuda.preferred_blas_library("cublas")
        if args.by_projection:
            row["projections"] = [bench([g.call(None, i)], device, args.reps, min_calls=1) * 1e3
                                  for i in range(len(projections))]
        for s in range(args.split_grid, m, args.split_grid) if not args.no_splits else ():
            row["split"][s] = bench([g.call(s)], device, args.reps, min_calls=1) * 1e3
        row["tflops"] = g.flops / (min(row["one"].values()) * 1e-3) / 1e12
        results.append(row)
        del g
    if args.out:
        args.out.write_text(json.dumps({"card": card, "layers": layers, "rows": results},
                                       indent=1))
    lib0 = libraries[0]
    print(f"# {card}: {layers} layers' projections by row count, ms (TFLOP/s at the faster "
          "library); splits: rows [0, S) and [S, M) as two GEMMs, cuBLAS")
    print(f"{'rows':>6}" + "".join(f"{lib:>10}" for lib in libraries)
          + f"{'TFLOP/s':>9}{'best split':>12}{'ms':>9}{'× one':>7}")
    for r in results:
        line = f"{r['rows']:>6}" + "".join(f"{r['one'][lib]:>10.3f}" for lib in libraries)
        line += f"{r['tflops']:>9.0f}"
        if r["split"]:
            s, t = min(r["split"].items(), key=lambda kv: kv[1])
            line += f"{s:>12}{t:>9.3f}{t / r['one'][lib0]:>7.2f}"
        if "projections" in r:
            line += "   q/k/v, o, gate/up, down: " + " ".join(f"{t:.3f}" for t in r["projections"])
        print(line)
    return 0


def lm_head(args: argparse.Namespace, device: torch.device, card: str) -> int:
    """The LM head into a float32 logits buffer by row count: the bf16 product then converted
    (a copy kernel over [M, vocab]), against float32 straight from the GEMM (float_logits; on
    the CPU both take the first path)."""
    from tandem.engine.models.layers import float_logits

    vocab, hidden, dtype = (512, 64, torch.float32) if args.smoke else (128256, 4096,
                                                                        torch.bfloat16)
    rows = [8, 24] if args.smoke else args.rows
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype, device=device)
    logits = torch.empty(max(rows), vocab, dtype=torch.float32, device=device)
    results = []
    print(f"# {card}: LM head {vocab} x {hidden} into float32 logits, µs")
    print(f"{'rows':>6}{'converted':>11}{'from GEMM':>11}{'×':>7}")
    for m in rows:
        x = torch.randn(m, hidden, dtype=dtype, device=device)
        out = logits[:m]
        old = bench([lambda x=x, out=out: out.copy_(head(x))], device, args.reps) * 1e6
        new = bench([lambda x=x, out=out: float_logits(head, x, out=out)], device,
                    args.reps) * 1e6
        results.append({"rows": m, "converted_us": old, "from_gemm_us": new})
        print(f"{m:>6}{old:>11.1f}{new:>11.1f}{new / old:>7.3f}")
    if args.out:
        args.out.write_text(json.dumps({"card": card, "lm_head": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
