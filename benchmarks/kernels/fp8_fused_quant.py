"""Activation quantization for FP8 matmuls, unfused against fused: RMSNorm with the residual add
then per-token FP8 quantization (kernels/rms_norm.py + kernels/fp8_quant.py) against
kernels/rms_norm_quant_fp8.py, and SiLU-and-mul then quantization (kernels/silu_and_mul.py +
kernels/fp8_quant.py) against kernels/silu_and_mul_quant_fp8.py, at M token rows x K columns
(K: the norm's hidden size, or the activation's output width, its input being [M, 2K]).

Each variant is replayed from a CUDA graph (median over replays, no launch gaps: the kernels'
own time; the fused path also saves one launch per call in eager steps). Several copies of the
inputs rotate so that the working set exceeds the L2. GB/s: the fused kernel's minimal bytes
(inputs read once, outputs written) per second, beside the card's copy bandwidth. `same`: the
fused output equals the unfused pair's (scales equal, e4m3 bytes equal).

    python3 benchmarks/kernels/fp8_fused_quant.py                  # M {16,256,2048,8192} x K {4096,14336}
    python3 benchmarks/kernels/fp8_fused_quant.py --static         # with a static input scale
    python3 benchmarks/kernels/fp8_fused_quant.py --m 2048 --k 4096 --reps 200
    python3 benchmarks/kernels/fp8_fused_quant.py --sweep          # the SiLU kernel's launch shapes
    python3 benchmarks/kernels/fp8_fused_quant.py --smoke          # CPU, interpreter, tiny shapes

--sweep times the fused SiLU-and-mul kernel at other launch shapes than its default (the row
in one tile at 4-32 warps; loops over 1,024-4,096 columns, the row read twice) and marks any
whose output differs from the default's.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.timing import copy_bandwidth, eager_time, gpu_or_smoke, graph_time

L2_WORKING_SET = 256 << 20
EPS = 1e-5


def time_calls(calls: list[Callable[[], object]], reps: int, device: torch.device) -> float:
    for f in calls:
        f()
    if device.type == "cuda":
        return graph_time(calls, reps)
    return eager_time(calls, reps, device)


def same(fused, unfused) -> bool:  # type: ignore[no-untyped-def]
    return bool(torch.equal(fused[1], unfused[1])
                and torch.equal(fused[0].view(torch.uint8), unfused[0].view(torch.uint8)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="16,256,2048,8192", help="token rows, comma-separated")
    p.add_argument("--k", default="4096,14336", help="columns, comma-separated")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--static", action="store_true", help="a static input scale (no amax pass)")
    p.add_argument("--sweep", action="store_true", help="the SiLU kernel's launch shapes")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, M <= 32, K / 64")
    a = p.parse_args()
    gpu_or_smoke(a.smoke)
    # After gpu_or_smoke: TRITON_INTERPRET must be set before Triton is imported.
    from tandem.kernels import (
        quant_fp8,
        rms_norm,
        rms_norm_quant_fp8,
        silu_and_mul,
        silu_and_mul_quant_fp8,
    )

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ms = [min(int(m), 32) if a.smoke else int(m) for m in a.m.split(",")]
    ks = [int(k) // 64 if a.smoke else int(k) for k in a.k.split(",")]
    reps = 2 if a.smoke else a.reps
    dt = torch.bfloat16
    scale = torch.tensor([0.05], device=device) if a.static else None
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name(device)}; copy bandwidth (read + write) "
              f"{copy_bandwidth(device):.0f} GB/s; {'static' if a.static else 'per-token'} "
              f"scales; CUDA-graph replays, median of {reps}")
    if a.sweep:
        for k in ks:
            sweep_silu(silu_and_mul_quant_fp8, ms, k, scale, reps, device, a.smoke)
        return
    print(f"{'op':>13} {'M':>5} {'K':>6} | {'unfused us':>10} {'fused us':>9} {'speedup':>7} | "
          f"{'fused GB/s':>10} | same")
    for k in ks:
        for m in ms:
            # Bytes per copy of the inputs: norm x + residual, act [gate | up]; both 4*M*K.
            copies = 1 if a.smoke else max(1, min(8, math.ceil(L2_WORKING_SET / (4 * m * k))))
            w = torch.rand(k, device=device, dtype=dt) + 0.5
            norm_in = [(torch.randn(m, k, device=device, dtype=dt),
                        torch.randn(m, k, device=device, dtype=dt)) for _ in range(copies)]
            act_in = [torch.randn(m, 2 * k, device=device, dtype=dt) * 3 for _ in range(copies)]

            def norm_unfused(x, r, w=w):  # type: ignore[no-untyped-def]
                return quant_fp8(rms_norm(x, w, EPS, r).out, scale)

            def norm_fused(x, r, w=w):  # type: ignore[no-untyped-def]
                return rms_norm_quant_fp8(x, w, EPS, r, scale=scale)

            def act_unfused(x):  # type: ignore[no-untyped-def]
                return quant_fp8(silu_and_mul(x), scale)

            def act_fused(x):  # type: ignore[no-untyped-def]
                return silu_and_mul_quant_fp8(x, scale)

            # Fused bytes: norm reads x, residual, writes residual, q (1 B) and s;
            # act reads [gate | up], writes q and s.
            cases = [
                ("norm+res+q", [lambda x=x, r=r: norm_unfused(x, r) for x, r in norm_in],
                 [lambda x=x, r=r: norm_fused(x, r) for x, r in norm_in],
                 same(norm_fused(*norm_in[0])[:2], norm_unfused(*norm_in[0])),
                 m * k * (2 + 2 + 2 + 1) + 4 * m),
                ("silu*mul+q", [lambda x=x: act_unfused(x) for x in act_in],
                 [lambda x=x: act_fused(x) for x in act_in],
                 same(act_fused(act_in[0]), act_unfused(act_in[0])),
                 m * k * (4 + 1) + 4 * m),
            ]
            for name, unfused, fused, equal, nbytes in cases:
                t_un = time_calls(unfused, reps, device)
                t_fu = time_calls(fused, reps, device)
                print(f"{name:>13} {m:>5} {k:>6} | {t_un * 1e6:10.1f} {t_fu * 1e6:9.1f} "
                      f"{t_un / t_fu:6.2f}x | {nbytes / t_fu / 1e9:10.0f} | "
                      f"{'yes' if equal else 'NO'}")
            del norm_in, act_in
            if device.type == "cuda":
                torch.cuda.empty_cache()


def sweep_silu(fused: Callable, ms: list[int], k: int, scale, reps: int,  # type: ignore[no-untyped-def]
               device: torch.device, smoke: bool) -> None:
    """µs of silu_and_mul_quant_fp8 at each launch shape, the default first."""
    import triton  # after gpu_or_smoke, as the kernels are

    one = triton.next_power_of_2(k)
    shapes = [(one, w) for w in (4, 8, 16, 32)] + [(b, w) for b in (1024, 2048, 4096)
                                                   for w in (4, 8) if b < k]
    if smoke:
        shapes = [(one, 4), (max(1, one // 2), 4)]
    names = ["default"] + [f"{'row' if b >= k else b}/{w}w" for b, w in shapes]
    print(f"SiLU-and-mul + FP8, K {k}, µs (block or row / warps):")
    print(f"{'M':>5} | " + " ".join(f"{n:>9}" for n in names))
    for m in ms:
        copies = 1 if smoke else max(1, min(8, math.ceil(L2_WORKING_SET / (4 * m * k))))
        xs = [torch.randn(m, 2 * k, device=device, dtype=torch.bfloat16) * 3
              for _ in range(copies)]
        ref = fused(xs[0], scale)
        cells = [f"{time_calls([lambda x=x: fused(x, scale) for x in xs], reps, device) * 1e6:9.1f}"]
        for b, w in shapes:
            def call(x, b=b, w=w):  # type: ignore[no-untyped-def]
                return fused(x, scale, block=b, num_warps=w)
            t = time_calls([lambda x=x: call(x) for x in xs], reps, device)
            cells.append(f"{t * 1e6:8.1f}{' ' if same(call(xs[0]), ref) else '!'}")
        print(f"{m:>5} | " + " ".join(cells))
        del xs


if __name__ == "__main__":
    main()
