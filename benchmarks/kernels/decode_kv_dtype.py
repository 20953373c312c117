"""Paged decode attention over an FP8 (e4m3) KV cache against a bf16 one, with the FP8 tile
configurations swept: which config makes FP8 KV at least as fast as bf16 at every batch.

    python benchmarks/kernels/decode_kv_dtype.py [--out decode_kv_dtype.json]   # one GPU, minutes
    python benchmarks/kernels/decode_kv_dtype.py --smoke                        # CPU, interpreter

Llama-3.1-8B attention shapes (32 q heads, 8 KV heads, D 128, block size 16), every sequence at
the same context, block tables of randomly permuted ids, inputs replicated past the L2 and each
call replayed from a CUDA graph (benchmarks/kernels/paged_kernels_common.py). Per batch x
context: bf16 with its default config; FP8 with its default config and with each config of the
grid (block_n, num_warps, num_stages, fp8_dot_f16) at the split count the engine would give it. The
last lines are a table: FP8 default / bf16 and best FP8 / bf16 per shape, and the config that
is best over all shapes (the geometric mean of its ratios).

A decode graph's launch is split for the longest context its block tables can hold, not the
step's: --graph-len N sizes the split count (bf16's and each config's) for tables of N tokens,
as engine/attention/triton_backend.py does while capturing. --configs times only the configs
named as paged_kernels_common.config_key writes them (`n128/w4/s3/f16`, optionally `/r160`
registers capped and `/m512` splits of at least 512 tokens); --max-copies raises how many input
copies a timed graph cycles through (a batch-1 layer's KV is under a MiB: 32 copies stay in the
L2, which the engine's weights flush between layers).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.paged_kernels_common import (
    LLAMA_8B,
    SMOKE,
    add_sweep_args,
    bench,
    config_key,
    copies_for,
    fits,
    parse_config,
    sweep_device,
)
from benchmarks.kernels.paged_kernels_decode import make_decode_inputs
from benchmarks.lib.timing import rel_err
from tandem.kernels import paged_decode_attention
from tandem.kernels._common import FP8_DTYPE, FP8_MAX, num_sms
from tandem.kernels.paged_decode_launch import (
    DEFAULT_SPLIT_POLICY,
    DecodeConfig,
    SplitPolicy,
    decode_config,
    decode_num_splits,
    decode_workspace_numel,
)


def to_fp8(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache as e4m3 with one fp32 scale per KV head (amax / FP8_MAX), as the engine keeps it."""
    scale = cache.float().abs().amax(dim=(0, 1, 3)).clamp(min=1e-6) / FP8_MAX
    q = (cache.float() / scale[None, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.contiguous()


def grid(smoke: bool, head_dim: int, names: list[str] | None = None
         ) -> list[tuple[DecodeConfig, SplitPolicy]]:
    if names:
        return [parse_config(n) for n in names]
    return [(c, DEFAULT_SPLIT_POLICY) for c in _tile_grid(smoke, head_dim)]


def _tile_grid(smoke: bool, head_dim: int) -> list[DecodeConfig]:
    if smoke:
        return [decode_config(head_dim), DecodeConfig(32, 4, 2, True)]
    return [DecodeConfig(n, w, s, f16) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)
            for f16 in (False, True)]


def run_shape(batch: int, ctx: int, args: argparse.Namespace, device: torch.device
              ) -> dict[str, Any]:
    shape = SMOKE if args.smoke else LLAMA_8B
    el = torch.tensor([], dtype=shape.dtype).element_size()
    kv_layer = 2 * batch * ctx * shape.num_kv_heads * shape.head_dim * el
    copies = copies_for(kv_layer // 2)  # the FP8 copies' working set past the L2
    if copies > 1:
        copies = min(args.max_copies, -(-(256 << 20) // max(kv_layer // 2, 1)))
    if not fits(copies * 3 * kv_layer, device):
        return {"batch": batch, "context": ctx, "skipped": "memory"}
    inputs = [make_decode_inputs(batch, ctx, shape, args.block_size, 1, device, False)
              for _ in range(copies)]
    fp8 = [(to_fp8(i.k_cache), to_fp8(i.v_cache)) for i in inputs]
    scale = shape.head_dim ** -0.5
    default = decode_config(shape.head_dim)
    bound = args.graph_len or ctx  # the split heuristic's context bound
    splits = decode_num_splits(batch, shape.num_kv_heads, bound, num_sms(device), default.block_n)
    ws = torch.empty(decode_workspace_numel(batch, shape.num_q_heads, shape.head_dim,
                                            max(splits, 64)), dtype=torch.float32, device=device)
    counters = torch.zeros(batch * shape.num_kv_heads, dtype=torch.int32, device=device)

    def call(i: int, cfg: DecodeConfig | None, quant: bool,
             policy: SplitPolicy = DEFAULT_SPLIT_POLICY):
        """cfg None: the tiles and split count the launcher picks, as the engine runs it."""
        inp = inputs[i]
        (k8, ks), (v8, vs) = fp8[i]
        k, v = (k8, v8) if quant else (inp.k_cache, inp.v_cache)
        n = None if cfg is None else decode_num_splits(batch, shape.num_kv_heads, bound,
                                                       num_sms(device), cfg.block_n, policy)
        return lambda: paged_decode_attention(
            inp.q, k, v, inp.block_tables, inp.seq_lens, scale, out=inp.out, max_seq_len=bound,
            num_splits=n, workspace=ws, counters=counters, config=cfg, policy=policy,
            k_scale=ks if quant else None, v_scale=vs if quant else None)

    reps = max(3, args.reps)
    row: dict[str, Any] = {"batch": batch, "context": ctx, "num_splits": splits}
    row["bf16_us"] = bench([call(i, None, False) for i in range(copies)], device, reps) * 1e6
    ref = call(0, None, False)().clone()
    configs = {}
    for cfg, policy in [(None, DEFAULT_SPLIT_POLICY),
                        *grid(args.smoke, shape.head_dim, args.configs)]:
        key = _key(cfg, policy)
        try:
            t = bench([call(i, cfg, True, policy) for i in range(copies)], device, reps) * 1e6
            err = rel_err(call(0, cfg, True, policy)(), ref)
        except Exception as e:  # noqa: BLE001 - out of shared memory, compile failure: skip it
            configs[key] = {"error": str(e).splitlines()[0][:160] if str(e) else
                            type(e).__name__}
            continue
        configs[key] = {"us": t, "rel_err": err}
    row["fp8"] = configs
    row["fp8_default_us"] = configs.get(_key(None), {}).get("us", math.nan)
    timed = {k: v["us"] for k, v in configs.items() if "us" in v}
    best = min(timed, key=timed.get)
    row["fp8_best"], row["fp8_best_us"] = best, timed[best]
    inputs.clear()
    fp8.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _key(cfg: DecodeConfig | None, policy: SplitPolicy = DEFAULT_SPLIT_POLICY) -> str:
    return "default" if cfg is None else config_key(cfg, policy)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_args(p, [1, 16, 64, 256, 512], [1024, 4096])
    p.add_argument("--graph-len", type=int, default=0,
                   help="split counts for block tables of this many tokens (a captured graph)")
    p.add_argument("--configs", nargs="+", default=None,
                   help="only these configs (paged_kernels_common.config_key's names)")
    p.add_argument("--max-copies", type=int, default=32, help="input copies a timed graph cycles")
    args = p.parse_args(argv)
    for name in args.configs or ():
        try:
            parse_config(name)
        except ValueError as e:
            p.error(f"--configs: {e}")
    if args.smoke:
        args.batches, args.contexts, args.reps = [2], [64], 1
    device, card = sweep_device()
    rows = [run_shape(b, c, args, device) for c in args.contexts for b in args.batches]
    done = [r for r in rows if "fp8" in r]
    geo = {}
    for key in {k for r in done for k, v in r["fp8"].items() if "us" in v}:
        ratios = [r["fp8"][key]["us"] / r["bf16_us"] for r in done if "us" in r["fp8"].get(key, {})]
        if len(ratios) == len(done):
            geo[key] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    overall = min(geo, key=geo.get) if geo else ""
    if args.out:
        args.out.write_text(json.dumps({"card": card, "rows": rows, "geomean": geo}, indent=1))
    print(f"# {card}: paged decode attention, FP8 KV / bf16 KV (lower is better)")
    print(f"{'batch':>6} {'ctx':>6} {'bf16 us':>9} {'fp8 dflt':>9} {'best':>6} "
          f"{overall + ' (best overall)':>28} {'best here':>22}")
    for r in done:
        o = r["fp8"].get(overall, {}).get("us", math.nan)
        print(f"{r['batch']:>6} {r['context']:>6} {r['bf16_us']:>9.1f} "
              f"{r['fp8_default_us'] / r['bf16_us']:>9.3f} "
              f"{r['fp8_best_us'] / r['bf16_us']:>6.3f} {o / r['bf16_us']:>28.3f} "
              f"{r['fp8_best']:>22}")
    if overall:
        print(f"geomean over shapes: default {geo.get('default', math.nan):.3f}, "
              f"{overall} {geo[overall]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
