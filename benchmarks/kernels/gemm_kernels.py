"""Would another GEMM kernel beat torch's cuBLAS call on the projections at a decode batch's or a
paced step's rows (64-256)? Triton's own tiles, and the other algorithms cuBLASLt offers for the
shape. Measured, not kept: the engine runs torch's F.linear.

    y[M, N] = x[M, K] @ w[N, K]^T, bf16, fp32 accumulation

For each of Llama-3.1-8B's four projections (benchmarks/kernels/gemm_rows.py) and row count M,
the 32 layers' GEMMs (each layer its own weights) in one CUDA graph, replayed: cuBLAS, then
every configuration (BLOCK_M / BLOCK_N / BLOCK_K, pipeline stages, warps) of each family:

  ptr       one program per output tile, pointer loads (cp.async pipelining)
  tma       one program per output tile, tensor-descriptor loads and store (the copy engine)
  persist   as tma, one program an SM looping over the tiles
  persist-ws   that loop warp-specialized (Triton's Hopper producer/consumer split)
  cublaslt  each algorithm cuBLASLt's heuristic lists for the shape (up to 16), run through
            nvmath-python's Matmul (`pip install nvmath-python`; not a dependency of Tandem)

A configuration the compiler refuses (shared memory, a pass failing) is left out. Each kept
time's product is checked against cuBLAS's.

    python benchmarks/kernels/gemm_kernels.py [--rows 64 96 128 192 256] [--families ...]
        [--out gemm_kernels.json]
    TRITON_INTERPRET=1 python benchmarks/kernels/gemm_kernels.py --smoke   # CPU, ptr, tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.gemm_rows import PROJECTIONS_8B
from benchmarks.kernels.paged_kernels_common import bench, sweep_device
from tandem.kernels import _common  # noqa: F401 - the interpreter's fixes under TRITON_INTERPRET=1

NAMES = ("q/k/v", "o", "gate/up", "down")
FAMILIES = ("ptr", "tma", "persist", "persist-ws", "cublaslt")
# BLOCK_M, BLOCK_N, BLOCK_K, stages, warps
CONFIGS = [
    (64, 32, 128, 5, 4), (64, 32, 256, 3, 4), (64, 64, 128, 4, 4), (64, 64, 128, 6, 4),
    (64, 64, 256, 3, 4), (64, 128, 64, 4, 4), (64, 128, 64, 6, 4), (64, 128, 128, 3, 4),
    (64, 128, 128, 4, 4), (64, 256, 64, 3, 4), (64, 256, 64, 4, 8), (128, 64, 128, 4, 4),
    (128, 64, 128, 4, 8), (128, 128, 64, 4, 8), (128, 128, 64, 5, 8), (128, 128, 128, 3, 8),
    (128, 256, 64, 3, 8),
]


@triton.jit
def _ptr(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym,
         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)  # the M tiles of one N tile run next to each other: w from the L2
    rm = (pid % num_m) * BM + tl.arange(0, BM)
    rn = (pid // num_m) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xp = x_ptr + rm[:, None] * sxm + rk[None, :]
    wp = w_ptr + rn[None, :] * swn + rk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        acc = tl.dot(tl.load(xp, mask=rm[:, None] < M, other=0.0), tl.load(wp), acc)
        xp += BK
        wp += BK
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rm[:, None] < M)


@triton.jit
def _tma(x_desc, w_desc, y_desc, M, N, K,
         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    off_m = (pid % num_m) * BM
    off_n = (pid // num_m) * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc)
    y_desc.store([off_m, off_n], acc.to(tl.bfloat16))


@triton.jit
def _persist(x_desc, w_desc, y_desc, M, N, K,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
             PROGRAMS: tl.constexpr, WS: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    for tile in tl.range(tl.program_id(0), num_m * tl.cdiv(N, BN), PROGRAMS, flatten=True,
                         num_stages=STAGES, warp_specialize=WS):
        off_m = (tile % num_m) * BM
        off_n = (tile // num_m) * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            acc = tl.dot(x_desc.load([off_m, ki * BK]), w_desc.load([off_n, ki * BK]).T, acc)
        y_desc.store([off_m, off_n], acc.to(tl.bfloat16))


def cublaslt_algorithms(x: torch.Tensor, ws: list[torch.Tensor], y: torch.Tensor):
    """(name, run) for each algorithm cuBLASLt's heuristic lists for x @ w^T: run executes it
    over every layer's weights and copies the last product into y."""
    try:
        from nvmath.linalg.advanced import Matmul, MatmulPlanPreferences
    except ImportError as e:
        raise SystemExit("the cublaslt family needs nvmath-python (pip install nvmath-python)"
                         ) from e
    mms = [Matmul(x, w.t()) for w in ws]
    plans = [mm.plan(preferences=MatmulPlanPreferences(limit=16)) for mm in mms]
    for i in range(min(len(p) for p in plans)):
        def run(i: int = i) -> None:
            for mm, algorithms in zip(mms, plans):
                out = mm.execute(algorithm=algorithms[i])
            y.copy_(out)
        yield f"algorithm {i}", run


def launchers(family: str, cfg: tuple, x: torch.Tensor, ws: list[torch.Tensor],
              y: torch.Tensor, sms: int):
    """A function running the family's kernel with cfg over every layer's weights."""
    bm, bn, bk, stages, warps = cfg
    m, k = x.shape
    n = y.shape[1]
    tiles = triton.cdiv(m, bm) * (n // bn)
    if family == "ptr":
        def run() -> None:
            for w in ws:
                _ptr[(tiles,)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                               BM=bm, BN=bn, BK=bk, num_stages=stages, num_warps=warps)
        return run
    from triton.tools.tensor_descriptor import TensorDescriptor

    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    yd = TensorDescriptor.from_tensor(y, [bm, bn])
    wds = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws]
    if family == "tma":
        def run() -> None:
            for wd in wds:
                _tma[(tiles,)](xd, wd, yd, m, n, k, BM=bm, BN=bn, BK=bk, STAGES=stages,
                               num_warps=warps)
        return run
    programs = min(sms, tiles)

    def run() -> None:
        for wd in wds:
            _persist[(programs,)](xd, wd, yd, m, n, k, BM=bm, BN=bn, BK=bk, STAGES=stages,
                                  PROGRAMS=programs, WS=family == "persist-ws",
                                  num_warps=warps)
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", type=int, default=[64, 96, 128, 192, 256])
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, the ptr family (CPU)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device, card = sweep_device()
    if args.smoke:
        projections, layers, dtype, families = ((64, 32), (32, 64)), 2, torch.float32, ["ptr"]
        configs, args.rows, args.reps = [(16, 16, 16, 1, 1)], [8, 24], 1
    else:
        projections, layers, dtype = PROJECTIONS_8B, 32, torch.bfloat16
        families, configs = args.families, CONFIGS
    sms = torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 1
    results = []
    print(f"# {card}: {layers} layers' GEMMs, ms; each family's fastest configuration "
          "(BLOCK_M/BLOCK_N/BLOCK_K stages warps) and its time over cuBLAS's")
    for (n, k), name in zip(projections, NAMES):
        ws = [torch.randn(n, k, dtype=dtype, device=device) * k ** -0.5 for _ in range(layers)]
        for m in args.rows:
            x = torch.randn(m, k, dtype=dtype, device=device)
            y = torch.empty(m, n, dtype=dtype, device=device)
            ref = x @ ws[-1].t()
            tol = 2e-2 * ref.abs().max().item() + 1e-6

            def cublas(x=x, ws=ws, y=y) -> None:
                for w in ws:
                    torch.mm(x, w.t(), out=y)
            row = {"projection": name, "rows": m,
                   "cublas": bench([cublas], device, args.reps, min_calls=1) * 1e3, "best": {}}
            for family in families:
                if family == "cublaslt":
                    variants = list(cublaslt_algorithms(x, ws, y))
                else:
                    variants = [("/".join(map(str, cfg[:3])) + f" s{cfg[3]} w{cfg[4]}",
                                 launchers(family, cfg, x, ws, y, sms))
                                for cfg in configs if not (k % cfg[2] or n % cfg[1])]
                for label, run in variants:
                    y.zero_()  # a kernel that writes nothing fails the check below
                    try:
                        ms = bench([run], device, args.reps, min_calls=1) * 1e3
                    except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses
                        print(f"  {name} M={m} {family} {label}: {str(e).splitlines()[0][:80]}")
                        continue
                    err = (y.float() - ref.float()).abs().max().item()  # the last layer's
                    if err > tol:
                        raise SystemExit(f"{name} M={m} {family} {label}: max error {err:.3g}")
                    if family not in row["best"] or ms < row["best"][family][0]:
                        row["best"][family] = (ms, label)
            results.append(row)
            print(f"{name:>8} M={m:<4} cuBLAS {row['cublas']:.3f}  " + "  ".join(
                f"{f} {t:.3f} ({t / row['cublas']:.2f}, {c})"
                for f, (t, c) in row["best"].items()), flush=True)
    print("\nthe four projections summed, ms (×: over cuBLAS); per family its fastest variant a "
          "projection, then the fastest of any")
    print(f"{'rows':>4} {'cuBLAS':>8}" + "".join(f"{f:>16}" for f in families) + f"{'any':>16}")
    for m in args.rows:
        rs = [r for r in results if r["rows"] == m]
        c = sum(r["cublas"] for r in rs)
        totals = [sum(r["best"][f][0] for r in rs) if all(f in r["best"] for r in rs) else None
                  for f in families]
        totals.append(sum(min(t for t, _ in r["best"].values()) for r in rs)
                      if all(r["best"] for r in rs) else None)
        print(f"{m:>4} {c:8.3f}" + "".join(f"{'-':>16}" if t is None else f"{t:>9.3f} ×{t / c:.2f}"
                                           for t in totals))
    if args.out:
        args.out.write_text(json.dumps({"card": card, "layers": layers, "rows": results},
                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
