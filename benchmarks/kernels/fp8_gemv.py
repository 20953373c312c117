"""Small-M FP8 matmuls at Llama-3.1-8B's projection shapes: bf16 `x @ W.T`, today's W8A8 path
(kernels/fp8_quant.py + torch._scaled_mm) and the weight-only kernel kernels/fp8_gemv.py, each
replayed from a CUDA graph (median over replays), with the weights' GB/s (bytes of W read per
second; several copies of W rotate so the working set exceeds the L2). `*` marks the path
fp8_linear takes (engine/quantization/fp8.py, GEMV_MAX_M).

    python3 benchmarks/kernels/fp8_gemv.py                      # the table
    python3 benchmarks/kernels/fp8_gemv.py --sweep              # + the kernel's tiles at M = 1 and 16
    python3 benchmarks/kernels/fp8_gemv.py --config gemv_block_n=32,num_warps=8
    python3 benchmarks/kernels/fp8_gemv.py --smoke              # CPU, interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.timing import copy_bandwidth, eager_time, gpu_or_smoke, graph_time

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # (N, K)
L2_WORKING_SET = 256 << 20


def parse_config(text: str):  # type: ignore[no-untyped-def]
    from tandem.kernels import Fp8GemvConfig

    cfg = Fp8GemvConfig()
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        cfg = cfg._replace(**{key.strip(): int(value)})
    return cfg


def time_calls(calls: list, reps: int, device: torch.device) -> float:  # type: ignore[type-arg]
    for f in calls:
        f()
    if device.type == "cuda":
        return graph_time(calls, reps)
    return eager_time(calls, reps, device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="1,8,16,32", help="token rows, comma-separated")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--config", default="", help="Fp8GemvConfig overrides: key=value,...")
    p.add_argument("--sweep", action="store_true", help="also time tile choices of the kernel")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, shapes / 64")
    a = p.parse_args()
    gpu_or_smoke(a.smoke)
    # After gpu_or_smoke: TRITON_INTERPRET must be set before Triton is imported.
    from tandem.engine.quantization.fp8 import linear_path, quantize_activation, quantize_weight
    from tandem.kernels import fp8_gemv

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = parse_config(a.config)
    ms = [int(m) for m in a.m.split(",")]
    reps = 2 if a.smoke else a.reps
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name(device)}; copy bandwidth (read + write) "
              f"{copy_bandwidth(device) :.0f} GB/s; {cfg}")

    def scaled_mm(x, w, s):  # type: ignore[no-untyped-def]
        x_q, x_s = quantize_activation(x, None)
        if x.is_cuda:
            return torch._scaled_mm(x_q, w.t(), scale_a=x_s, scale_b=s.view(1, -1),
                                    out_dtype=x.dtype)
        return (x_q.float() * x_s) @ (w.float() * s[:, None]).t()

    print(f"{'shape':>8} {'N':>6} {'K':>6} {'M':>3} | {'bf16 us':>8} {'GB/s':>5} | "
          f"{'w8a8 us':>8} {'GB/s':>5} | {'gemv us':>8} {'GB/s':>5} | gemv/bf16 gemv/w8a8")
    for name, (n, k) in SHAPES.items():
        if a.smoke:
            n, k = n // 64, k // 64
        copies = 1 if a.smoke else max(1, min(8, math.ceil(L2_WORKING_SET / (n * k))))
        w16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]
        wq = [quantize_weight(w) for w in w16]
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            t_bf16 = time_calls([lambda x=x, w=w: x @ w.t() for w in w16], reps, device)
            t_mm = time_calls([lambda x=x, w=w, s=s: scaled_mm(x, w, s) for w, s in wq],
                              reps, device)
            t_gemv = time_calls([lambda x=x, w=w, s=s: fp8_gemv(x, w, s, config=cfg)
                                 for w, s in wq], reps, device)
            w0, s0 = wq[0]  # correctness: against the dequantized weight in fp32
            ref = x.float() @ (w0.float() * s0[:, None]).t()
            err = float((fp8_gemv(x, w0, s0, config=cfg).float() - ref).abs().max()
                        / ref.abs().max().clamp(min=1e-12))
            path = linear_path(m, True)
            mark = {"scaled_mm": ("*", " "), "gemv": (" ", "*")}[path]
            print(f"{name:>8} {n:>6} {k:>6} {m:>3} | {t_bf16 * 1e6:8.1f} "
                  f"{2 * n * k / t_bf16 / 1e9:5.0f} | {t_mm * 1e6:7.1f}{mark[0]} "
                  f"{n * k / t_mm / 1e9:5.0f} | {t_gemv * 1e6:7.1f}{mark[1]} "
                  f"{n * k / t_gemv / 1e9:5.0f} | {t_bf16 / t_gemv:8.2f}x {t_mm / t_gemv:8.2f}x"
                  f"  max err {err:.1e}")
            if a.sweep and m in (1, 16):
                sweep(x, wq, cfg, reps, device, fp8_gemv)
        del w16, wq
        if device.type == "cuda":
            torch.cuda.empty_cache()


def sweep(x, wq, cfg, reps, device, fp8_gemv) -> None:  # type: ignore[no-untyped-def]
    """The kernel's time per tile choice (programs_per_sm=0: block_n as given)."""
    m, (n, k) = x.shape[0], wq[0][0].shape
    prefix = "gemv" if m == 1 else "dot"
    results = []
    for bn, bk, warps in itertools.product((8, 16, 32, 64), (256, 512, 1024), (4, 8)):
        if prefix == "dot" and bn < 16:
            continue
        c = cfg._replace(**{f"{prefix}_block_n": bn, f"{prefix}_block_k": bk},
                         num_warps=warps, programs_per_sm=0)
        try:
            t = time_calls([lambda w=w, s=s, c=c: fp8_gemv(x, w, s, config=c) for w, s in wq],
                           reps, device)
        except Exception as e:  # noqa: BLE001 - a tile that does not compile (resources)
            print(f"      {prefix} block_n={bn} block_k={bk} warps={warps}: {type(e).__name__}")
            continue
        results.append((t, bn, bk, warps))
    for t, bn, bk, warps in sorted(results)[:5]:
        print(f"      {prefix} block_n={bn:>3} block_k={bk:>4} warps={warps}: {t * 1e6:7.1f} us "
              f"{n * k / t / 1e9:5.0f} GB/s")


if __name__ == "__main__":
    main()
