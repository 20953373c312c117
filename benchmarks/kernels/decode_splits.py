"""Split-KV decode attention under other split policies (kernels/paged_decode_launch.py
SplitPolicy: programs_per_sm, min_split_tokens), as a decode graph launches it: the grid's split
count from the block table's capacity (TritonAttentionBackend._num_splits while capturing), each
sequence cut by its own length in the kernel.

    python benchmarks/kernels/decode_splits.py [--out decode_splits.json]   # one GPU, ~15 s
    python benchmarks/kernels/decode_splits.py --smoke                      # CPU, the interpreter

Llama-3.1-8B attention shapes, bf16, 16-token blocks of randomly permuted ids, block tables
--table-tokens wide (the engine's: max_model_len), every call replayed from a CUDA graph
(paged_kernels_common.bench). Per batch x context: each policy's split count and µs, the
default's share of the copy bandwidth; last, each policy's time over the default's, summed over
the shapes and by band of batches. Outputs are checked against the torch reference first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.paged_kernels_common import (
    LLAMA_8B,
    SMOKE,
    add_sweep_args,
    bench,
    copy_bound,
    sweep_device,
)
from tandem.kernels import SplitPolicy, paged_decode_attention, paged_decode_attention_ref
from tandem.kernels._common import num_sms
from tandem.kernels.paged_decode_launch import (
    DEFAULT_SPLIT_POLICY,
    decode_config,
    decode_num_splits,
    decode_workspace_numel,
)

POLICIES = [DEFAULT_SPLIT_POLICY, SplitPolicy(3, 256), SplitPolicy(4, 256), SplitPolicy(6, 256),
            SplitPolicy(8, 256), SplitPolicy(4, 128), SplitPolicy(8, 128)]
BATCHES = [1, 4, 8, 11, 16, 24, 32, 40, 48, 64]
CONTEXTS = [512, 1024, 2048, 4096]
BANDS = ((1, 16), (17, 32), (33, 64))


def time_shape(batch: int, ctx: int, table_tokens: int, shape, args, device) -> list[tuple]:
    """[(splits, seconds)] per policy for `batch` sequences of `ctx` tokens."""
    bs, width = args.block_size, table_tokens // args.block_size
    pool = torch.randn(batch * width + 1, 2, 2, bs, shape.num_kv_heads, shape.head_dim,
                       dtype=shape.dtype, device=device)
    k, v = pool[:, 1, 0], pool[:, 1, 1]
    table = torch.randperm(batch * width, device=device).to(torch.int32).view(batch, width)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, dtype=shape.dtype, device=device)
    scale = shape.head_dim ** -0.5
    ref = paged_decode_attention_ref(q, k, v, table, seq_lens, scale) if batch <= 4 else None
    block_n = decode_config(shape.head_dim).block_n
    sms = num_sms(device) if device.type == "cuda" else 4
    res = []
    for policy in POLICIES:
        splits = decode_num_splits(batch, shape.num_kv_heads, table_tokens, sms, block_n, policy)
        ws = torch.empty(decode_workspace_numel(batch, shape.num_q_heads, shape.head_dim, splits),
                         dtype=torch.float32, device=device)
        counters = torch.zeros(batch * shape.num_kv_heads, dtype=torch.int32, device=device)
        out = torch.empty_like(q)

        def call(policy=policy, splits=splits, ws=ws, counters=counters, out=out):
            return paged_decode_attention(q, k, v, table, seq_lens, scale, out=out,
                                          num_splits=splits, workspace=ws, counters=counters,
                                          policy=policy)
        call()
        if ref is not None:
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        res.append((splits, bench([call], device, args.reps)))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_args(p, BATCHES, CONTEXTS)
    p.add_argument("--table-tokens", type=int, default=4096,
                   help="block table capacity in tokens (what sizes a graph's grid)")
    args = p.parse_args(argv)
    device, card = sweep_device()
    shape = LLAMA_8B
    if args.smoke:
        shape, args.batches, args.contexts, args.reps = SMOKE, [1, 3], [64], 1
        args.table_tokens = 128
    bw = copy_bound(device, args.reps, args.smoke)["gbps"]
    print(f"# {card}: split policies (programs_per_sm, min_split_tokens) {[tuple(x) for x in POLICIES]}; "
          f"copy bandwidth {bw:.0f} GB/s")
    rows = []
    for b in args.batches:
        for ctx in args.contexts:
            res = time_shape(b, ctx, args.table_tokens, shape, args, device)
            nbytes = 2 * b * ctx * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
            base = res[0][1]
            print(f"{b:4d} x {ctx:5d}  " + "  ".join(f"{s:2d}: {t * 1e6:7.1f}" for s, t in res)
                  + f"   default {nbytes / base / 1e9 / bw:.0%} of copy bw", flush=True)
            rows.append({"batch": b, "context": ctx, "splits": [s for s, _ in res],
                         "us": [t * 1e6 for _, t in res]})

    def summed(sel: list[dict]) -> list[float]:
        tot = [sum(r["us"][i] for r in sel) for i in range(len(POLICIES))]
        return [round(t / tot[0], 3) for t in tot]
    print("each policy's time over the default's, summed over the shapes:", summed(rows))
    for lo, hi in BANDS:
        sel = [r for r in rows if lo <= r["batch"] <= hi]
        if sel:
            print(f"  batches {lo}-{hi}:", summed(sel))
    if args.out:
        args.out.write_text(json.dumps({"card": card, "copy_gbps": bw, "rows": rows,
                                        "policies": [tuple(x) for x in POLICIES]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
