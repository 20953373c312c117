"""FP8 matmuls at Llama-3.1-8B's projection shapes (or --shapes): bf16 `x @ W.T` against
torch._scaled_mm on e4m3 inputs already quantized (the GEMM alone), with the scales W8A8 uses
(row-wise: one per token, one per output channel) and with one scale per tensor, each with and
without `use_fast_accum` (Hopper's FP8 tensor cores accumulate in reduced precision between
promotions to fp32); and the row-wise product computed as W8A8 computes a small one (after:
scales of 1, fast accumulation, sums in fp8.ACC_DTYPE, then kernels/fp8_scale_product.py applies
the row and channel scales; after-fp32 with fp32 sums). Each replayed from a CUDA graph (median),
several copies of W rotating past the L2; TFLOP/s, speed-up over bf16, and each FP8 output's
error against the fp32 product of the same e4m3 operands (max |err| / max |ref|). The last
column names the faster of rowwise+fast and after at each shape; a table after it gives the
rate each of the two reads the weight at, as a share of the copy bandwidth.

    python3 benchmarks/kernels/fp8_scaled_mm.py
    python3 benchmarks/kernels/fp8_scaled_mm.py --m 2,16,64,96,128,192,256,512 --shapes 4096:4096,16384:4096
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.timing import copy_bandwidth, graph_time

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # (N, K)
L2_WORKING_SET = 256 << 20
VARIANTS = ("rowwise", "rowwise+fast", "tensor", "tensor+fast", "after", "after-fp32")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="128,256,512,1024,2048,4096", help="token rows")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--shapes", default=None,
                   help="N:K,... in place of the 8B projections (named by their N x K)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
    from tandem.engine.quantization.fp8 import ACC_DTYPE, quantize_activation, quantize_weight
    from tandem.kernels import fp8_scale_product

    shapes = SHAPES
    if a.shapes:
        shapes = {}
        for nk in a.shapes.split(","):
            n, k = (int(v) for v in nk.split(":"))
            shapes[f"{n}x{k}"] = (n, k)
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    one = torch.ones((), device=dev)
    print(torch.cuda.get_device_name(dev), "torch", torch.__version__,
          f"copy bandwidth {bw:.0f} GB/s")
    of_bw = []
    print(f"{'shape':>8} {'M':>5} | {'bf16 us':>8} {'TF/s':>5} | "
          + " | ".join(f"{v:>12} us   x  err" for v in VARIANTS))
    totals = {v: 0.0 for v in ("bf16", *VARIANTS)}
    for name, (n, k) in shapes.items():
        copies = max(1, min(8, math.ceil(L2_WORKING_SET / (n * k))))
        w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        wq = [quantize_weight(w) for w in w16]
        # One scale for the whole weight (its largest channel's), the weight requantized to it.
        wt = []
        for w in w16:
            s = (w.float().abs().amax() / 448.0).clamp(min=1e-12)
            wt.append(((w.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s.reshape(())))
        for m in (int(x) for x in a.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = quantize_activation(x, None)
            xs_t = (x.float().abs().amax() / 448.0).clamp(min=1e-12).reshape(())
            xq_t = (x.float() / xs_t).clamp(-448, 448).to(torch.float8_e4m3fn)

            def rowwise(w, s, fast, xq=xq, xs=xs):  # type: ignore[no-untyped-def]
                return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.view(1, -1),
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)

            def tensor(w, s, fast, xq_t=xq_t, xs_t=xs_t):  # type: ignore[no-untyped-def]
                return torch._scaled_mm(xq_t, w.t(), scale_a=xs_t, scale_b=s,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)

            def after(w, s, acc_dtype, xq=xq, xs=xs):  # type: ignore[no-untyped-def]
                acc = torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=acc_dtype,
                                       use_fast_accum=True)
                return fp8_scale_product(acc, xs, s, None, torch.bfloat16)

            calls = {"bf16": [lambda w=w, x=x: x @ w.t() for w in w16]}
            for fast in (False, True):
                tag = "+fast" if fast else ""
                calls["rowwise" + tag] = [lambda w=w, s=s, f=fast: rowwise(w, s, f) for w, s in wq]
                calls["tensor" + tag] = [lambda w=w, s=s, f=fast: tensor(w, s, f) for w, s in wt]
            calls["after"] = [lambda w=w, s=s: after(w, s, ACC_DTYPE) for w, s in wq]
            calls["after-fp32"] = [lambda w=w, s=s: after(w, s, torch.float32) for w, s in wq]
            times = {}
            for v, fs in calls.items():
                for f in fs:
                    f()
                times[v] = graph_time(fs, a.reps)
                totals[v] += times[v]
            w0, s0 = wq[0]
            ref_r = (xq.float() * xs) @ (w0.float() * s0[:, None]).t()
            wt0, st0 = wt[0]
            ref_t = (xq_t.float() * xs_t) @ (wt0.float() * st0).t()
            errs = {}
            for fast in (False, True):
                tag = "+fast" if fast else ""
                errs["rowwise" + tag] = _err(rowwise(w0, s0, fast), ref_r)
                errs["tensor" + tag] = _err(tensor(wt0, st0, fast), ref_t)
            errs["after"] = _err(after(w0, s0, ACC_DTYPE), ref_r)
            errs["after-fp32"] = _err(after(w0, s0, torch.float32), ref_r)
            flops = 2 * m * n * k
            cells = " | ".join(f"{times[v] * 1e6:12.1f} {times['bf16'] / times[v]:4.2f} "
                               f"{errs[v]:.0e}" for v in VARIANTS)
            faster = "after" if times["after"] < times["rowwise+fast"] else "rowwise"
            print(f"{name:>8} {m:>5} | {times['bf16'] * 1e6:8.1f} "
                  f"{flops / times['bf16'] / 1e12:5.0f} | {cells} | {faster}", flush=True)
            of_bw.append((name, m, *(n * k / t / 1e9 / bw for t in
                                     (times["rowwise+fast"], times["after"]))))
        del w16, wq, wt
        torch.cuda.empty_cache()
    print("all shapes and M, summed: " + ", ".join(
        f"{v} {totals['bf16'] / totals[v]:.2f}x bf16" for v in VARIANTS))
    print("the e4m3 weight's bytes over the time, share of the copy bandwidth: "
          "rowwise+fast / after")
    for name, m, row, aft in of_bw:
        print(f"{name:>12} {m:>5}  {row:6.1%}  {aft:6.1%}")


def _err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-12))


if __name__ == "__main__":
    main()
