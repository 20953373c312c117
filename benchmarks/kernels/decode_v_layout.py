"""An experiment, not the engine's: FP8 decode attention with V pages stored token-major
([Hkv, D, block_size] a block, so that p @ V reads its e4m3 operand through ldmatrix as K's is)
against the engine's [block_size, Hkv, D] (V read from shared memory a byte at a time:
decode_sass.py). Unsplit launches of `_paged_decode_kernel` with V_TRANS 0 (the engine's pages),
1 (token-major, the tail past a sequence's end zeroed) and 2 (not zeroed: unsafe, the read's
cost alone), each tile configuration named; bf16 and FP8 through the launcher beside them.
Llama-3.1-8B shapes, CUDA-graph replays over input copies past the L2.

    python benchmarks/kernels/decode_v_layout.py            # one GPU, a minute
    TRITON_INTERPRET=1 python benchmarks/kernels/decode_v_layout.py --smoke
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.decode_kv_dtype import to_fp8
from benchmarks.kernels.paged_kernels_common import (
    LLAMA_8B,
    SMOKE,
    bench,
    copies_for,
    parse_config,
)
from benchmarks.kernels.paged_kernels_decode import make_decode_inputs
from benchmarks.lib.timing import rel_err
from tandem.kernels import paged_decode_attention
from tandem.kernels.paged_decode_attention import (
    LOG2E,
    _paged_decode_kernel,
    kernel_consts,
    paged_decode_attention_ref,
    tile_args,
)

BLOCK_SIZE = 16
SHAPES = [(40, 448), (112, 448), (256, 448), (512, 448), (112, 1024), (256, 1024), (64, 2048)]
CONFIGS = ["n128/w4/s3/f16/r160", "n128/w4/s3/f16", "n128/w4/s2/f16/r160", "n64/w4/s3/f16",
           "n64/w4/s4/f16/r128"]


def token_major(v8: torch.Tensor) -> torch.Tensor:
    """[nb, bs, Hkv, D] -> the same values stored [nb, Hkv, D, bs], viewed as [nb, bs, Hkv, D]."""
    return v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


def launch(inp, k8, v8, ks, vs, cfg, v_trans: int, cuda: bool):
    q = inp.q
    consts = kernel_consts(q.shape[1] // k8.shape[2], BLOCK_SIZE, q.shape[2], q.dtype)
    args = (q, k8, v8, inp.block_tables, inp.seq_lens, inp.out, ks, vs,
            q.shape[2] ** -0.5 * LOG2E, q.stride(0), q.stride(1),
            k8.stride(0), k8.stride(1), k8.stride(2), v8.stride(0), v8.stride(1), v8.stride(2),
            inp.block_tables.stride(0), inp.out.stride(0), inp.out.stride(1))

    def fn() -> torch.Tensor:
        _paged_decode_kernel[(q.shape[0], k8.shape[2])](
            *args, **consts, **tile_args(cfg, q.dtype, True, cuda), V_TRANS=v_trans)
        return inp.out
    return fn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    shape = SMOKE if args.smoke else LLAMA_8B
    shapes, configs = ([(3, 70)], ["n32/w4/s2/f16"]) if args.smoke else (SHAPES, CONFIGS)
    scale = shape.head_dim ** -0.5
    rows = []
    for batch, ctx in shapes:
        kv_bytes = batch * ctx * shape.num_kv_heads * shape.head_dim
        copies = 1 if args.smoke else max(2, copies_for(kv_bytes))
        inputs = [make_decode_inputs(batch, ctx, shape, BLOCK_SIZE, 1, device, False)
                  for _ in range(copies)]
        fp8 = [(*to_fp8(i.k_cache), *to_fp8(i.v_cache)) for i in inputs]
        v_tm = [token_major(f[2]) for f in fp8]
        row = {"batch": batch, "context": ctx}
        if not args.smoke:
            row["bf16_us"] = bench([lambda x=x: paged_decode_attention(
                x.q, x.k_cache, x.v_cache, x.block_tables, x.seq_lens, scale, out=x.out)
                for x in inputs], device, 20) * 1e6
            row["fp8_launcher_us"] = bench([lambda x=x, f=f: paged_decode_attention(
                x.q, f[0], f[2], x.block_tables, x.seq_lens, scale, out=x.out, k_scale=f[1],
                v_scale=f[3]) for x, f in zip(inputs, fp8, strict=True)], device, 20) * 1e6
        i0, (k8, ks, v8, vs) = inputs[0], fp8[0]
        ref = paged_decode_attention_ref(i0.q.float(), k8, v8, i0.block_tables, i0.seq_lens,
                                         scale, ks, vs)
        for name in configs:
            cfg, _ = parse_config(name)
            for v_trans in (0, 1, 2):
                fns = [launch(inputs[i], fp8[i][0], v_tm[i] if v_trans else fp8[i][2],
                              fp8[i][1], fp8[i][3], cfg, v_trans, device.type == "cuda")
                       for i in range(copies)]
                cell = {"rel_err": rel_err(fns[0]().clone(), ref.to(i0.out.dtype))}
                if not args.smoke:
                    cell["us"] = bench(fns, device, 20) * 1e6
                row[f"{name}/v{v_trans}"] = cell
        rows.append(row)
        print(json.dumps(row), flush=True)
        inputs.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\nbatch x context | bf16 us | FP8 (launcher) us | "
          + " | ".join(f"{c}: V_TRANS 0 / 1 / 2" for c in configs))
    for row in rows:
        cells = [" / ".join(f"{row[f'{c}/v{v}'].get('us', float('nan')):.1f}" for v in range(3))
                 for c in configs]
        print(f"{row['batch']} x {row['context']} | {row.get('bf16_us', float('nan')):.1f} | "
              f"{row.get('fp8_launcher_us', float('nan')):.1f} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
