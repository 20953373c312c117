"""Decode attention with a plan (kernels/paged_decode_launch.py decode_plan: every context cut
into splits of one length, sequences longest first) against the launch without one (the split
heuristic and, from ~33 sequences, one program per (sequence, KV head)), as the engine's
decode graphs launch it: replayed from a CUDA graph, block tables 4,096 tokens wide.

    python benchmarks/kernels/decode_plan.py [--out decode_plan.json]   # one GPU, ~30 s
    python benchmarks/kernels/decode_plan.py --smoke                    # CPU, the interpreter

Batches: uniform contexts, and mixed ones as a served ShareGPT-like run's steps hold them
(--mixed N: N requests of the workload, each at a random point of its output: its prompt plus
that many tokens). Llama-3.1-8B attention shapes, bf16, 16-token blocks of randomly permuted
ids (--kv-cache-dtype fp8: the caches in e4m3 with a scale per KV head, each launch with its
FP8 tiles). Per batch: µs without and with the plan, each one's share of the copy bandwidth, the
plan's split length and items. Outputs are checked against the torch reference first. On a GPU,
last: every compiled variant's registers, spills, shared memory and programs an SM.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.decode_kv_dtype import to_fp8
from benchmarks.kernels.paged_kernels_common import LLAMA_8B, SMOKE, bench, copy_bound, sweep_device
from benchmarks.lib.workloads import sharegpt_like
from tandem.kernels import (
    decode_workspace_numel,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from tandem.kernels._common import num_sms
from tandem.kernels.paged_decode_launch import (
    PLAN_KEEP_WHOLE,
    DecodeConfig,
    decode_plan,
    decode_plan_capacity,
    plan_config,
)

UNIFORM = [(1, 2048), (4, 1024), (16, 2048), (96, 448), (192, 448), (446, 320)]
# Other plans than the default: (tiles (None: the launcher's pick), keep_whole)
VARIANTS = {
    "keep 1": (None, 1.0),
    "64/4/3 m4k": (DecodeConfig(64, 4, 3), PLAN_KEEP_WHOLE),
    "32/2/4 m1k": (DecodeConfig(32, 2, 4, merge_tile=1024), PLAN_KEEP_WHOLE),
    "32/2/4 r128 m1k": (DecodeConfig(32, 2, 4, max_registers=128, merge_tile=1024),
                        PLAN_KEEP_WHOLE),
}
# FP8 caches: other tiles than plan_config's (128-token fp16 tiles, registers capped at 160)
VARIANTS_FP8 = {
    "128 r160 m1k": (DecodeConfig(128, 4, 3, True, max_registers=160, merge_tile=1024),
                     PLAN_KEEP_WHOLE),
    "128 r128": (DecodeConfig(128, 4, 3, True, max_registers=128), PLAN_KEEP_WHOLE),
    "64/4/2 f16": (DecodeConfig(64, 4, 2, True), PLAN_KEEP_WHOLE),
}
MIXED = [16, 100, 200]  # requests drawn from the ShareGPT-like workload


def mixed_lens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [len(r.prompt) + rng.randrange(1, r.max_tokens + 1)
            for r in sharegpt_like(n, 1000, seed=seed)]


def time_batch(lens: list[int], table_tokens: int, shape, args, device) -> dict:
    bs, b = args.block_size, len(lens)
    width = table_tokens // bs
    pool = torch.randn(b * width + 1, 2, 2, bs, shape.num_kv_heads, shape.head_dim,
                       dtype=shape.dtype, device=device)
    k, v = pool[:, 1, 0], pool[:, 1, 1]
    fp8 = args.kv_cache_dtype == "fp8"
    scales = {}
    if fp8:
        (k, k_scale), (v, v_scale) = to_fp8(k), to_fp8(v)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    table = torch.randperm(b * width, device=device).to(torch.int32).view(b, width)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(b, shape.num_q_heads, shape.head_dim, dtype=shape.dtype, device=device)
    scale = shape.head_dim ** -0.5
    sms = num_sms(device)
    capacity = decode_plan_capacity(b, shape.num_kv_heads, sms)
    ws = torch.empty(decode_workspace_numel(max(capacity, 64 * b), shape.num_q_heads,
                                            shape.head_dim, 1), dtype=torch.float32, device=device)
    counters = torch.zeros(b * shape.num_kv_heads, dtype=torch.int32, device=device)
    out = torch.empty_like(q)

    def planned(config: DecodeConfig | None, keep_whole: float):
        block_n = (config or plan_config(shape.head_dim, fp8=fp8)).block_n  # whole tiles
        plan = decode_plan(lens, shape.num_kv_heads, sms, block_n, capacity, keep_whole)
        plan_t = torch.from_numpy(plan).to(device)
        return plan, lambda: paged_decode_attention(q, k, v, table, seq_lens, scale, out=out,
                                                    plan=plan_t, workspace=ws,
                                                    counters=counters, config=config, **scales)

    plan, call = planned(None, PLAN_KEEP_WHOLE)
    calls = {
        "unplanned": lambda: paged_decode_attention(q, k, v, table, seq_lens, scale, out=out,
                                                    max_seq_len=table_tokens, workspace=ws,
                                                    counters=counters, **scales),
        "planned": call,
    }
    variants = VARIANTS_FP8 if fp8 else VARIANTS
    if args.variants:
        calls.update({name: planned(*v)[1] for name, v in variants.items()})
    ref = (paged_decode_attention_ref(q, k, v, table, seq_lens, scale, **scales) if b <= 16
           else None)
    row = {"batch": b, "mean_context": sum(lens) // b, "max_context": max(lens),
           "split_len": int(plan[0, 0]), "items": int(plan[0, 1])}
    for name, call in calls.items():
        call()
        if ref is not None:
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        row[name] = bench([call], device, args.reps)
    return row


def print_compiled(device: torch.device) -> None:
    """Each compiled decode kernel variant's registers, spills, shared memory and the programs
    an SM holds (what bounds how many tiles are in flight)."""
    import importlib

    from tandem.kernels._common import resident_programs
    mod = importlib.import_module("tandem.kernels.paged_decode_attention")
    for kernel in (mod._paged_decode_kernel, mod._paged_decode_split_kernel,
                   mod._paged_decode_plan_kernel):
        for cache in kernel.device_caches.values():  # Triton's per-device compiled variants
            for compiled in cache[0].values():
                per_sm = resident_programs(compiled, device)
                m = compiled.metadata
                print(f"{kernel.fn.__name__:28} warps {m.num_warps} stages {m.num_stages} "
                      f"registers {compiled.n_regs} spills {compiled.n_spills} shared "
                      f"{m.shared} B: {per_sm} programs an SM")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixed", type=int, nargs="+", default=MIXED)
    p.add_argument("--seeds", type=int, default=2, help="mixed batches drawn per size")
    p.add_argument("--table-tokens", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--variants", action="store_true",
                   help="also other tiles and keep_whole thresholds (VARIANTS, VARIANTS_FP8)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: the interpreter)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device, card = sweep_device()
    shape, uniform = LLAMA_8B, UNIFORM
    if args.smoke:
        shape, uniform, args.mixed, args.seeds = SMOKE, [(3, 100)], [3], 1
        args.table_tokens, args.reps = 512, 1
    bw = copy_bound(device, 10, args.smoke)["gbps"]
    print(f"# {card}: decode attention without and with a plan, KV {args.kv_cache_dtype}; "
          f"copy bandwidth {bw:.0f} GB/s")
    batches = [(f"{b} x {c}", [c] * b) for b, c in uniform]
    batches += [(f"{n} mixed, seed {s}", mixed_lens(n, s) if not args.smoke else [5, 300, 40])
                for n in args.mixed for s in range(args.seeds)]
    rows = []
    for name, lens in batches:
        r = time_batch(lens, args.table_tokens, shape, args, device)
        itemsize = 1 if args.kv_cache_dtype == "fp8" else shape.dtype.itemsize
        nbytes = 2 * sum(lens) * shape.num_kv_heads * shape.head_dim * itemsize
        share = {k: nbytes / r[k] / 1e9 / bw for k in ("unplanned", "planned")}
        print(f"{name:>20}: mean {r['mean_context']:5d} max {r['max_context']:5d}  "
              f"unplanned {r['unplanned'] * 1e6:7.1f} us ({share['unplanned']:.0%})  "
              f"planned {r['planned'] * 1e6:7.1f} us ({share['planned']:.0%})  "
              f"x{r['planned'] / r['unplanned']:.3f}  split {r['split_len']} items {r['items']}"
              + "".join(f"\n{'':>22}{v}: x{r[v] / r['unplanned']:.3f}"
                        for v in {**VARIANTS, **VARIANTS_FP8} if v in r), flush=True)
        rows.append({"name": name, **r})
    if device.type == "cuda":
        print_compiled(device)
    if args.out:
        args.out.write_text(json.dumps({"card": card, "copy_gbps": bw, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
