"""Time each op of one Llama-3.1-8B decoder layer at decode (one new token per sequence) on one
GPU, old and new kernels side by side, and the whole layer as one CUDA graph.

    python benchmarks/kernels/decode_ops.py                               # batch 1 and 64, 1k context
    python benchmarks/kernels/decode_ops.py --batches 1 --sweep-contexts 1024 4096 --out ops.json
    python benchmarks/kernels/decode_ops.py --smoke                       # tiny shapes, CPU interpreter

Ops, in layer order (bf16; hidden 4096, 32 q heads, 8 KV heads, head dim 128, MLP 14336; KV in
a block-major pool [N, L, 2, 16, 8, 128] read through per-layer strided views and scattered
block ids):
  rms_norm; qkv linear (torch F.linear, M = batch); rotary + store: rotary_embedding then
  store_kv (old, 2 launches) vs rotary_store_kv (new, 1); decode attention over --context
  tokens: split-KV then a merge launch (old: the replaced kernels, kept in this file as the
  baseline) vs the split kernel that merges in its last program (new, 1 launch), with the grid
  the engine's CUDA graphs use (sized for --graph-capacity tokens) and with one sized for the
  context; o_proj; rms_norm + residual; gate_up linear; silu_and_mul; down linear. Then the
  layer (a middle layer: both norms add the residual) captured as one graph: old ops, new ops,
  and the engine's own DecoderLayer with the Triton backend (the new path through the model
  code). Last, a sweep of the split policy's min_split_tokens (in whole tiles) for batch-1
  decode attention.

Timing: every op runs from a CUDA graph of many calls that cycle through enough copies of its
inputs (weights, KV, activations) that the bytes one call touches come from DRAM, not L2 (the
copies together exceed --flush-bytes); median over --reps replays, per call. bytes is what an
op must move at least; the floor is bytes / copy bandwidth, with the copy bandwidth measured in
the same run (one large device-to-device copy, (read + write) / time), so "of floor" is the
share of the bandwidth bound reached. Every variant's output is checked against the old one and
the torch references; the script exits 1 if any differs (bf16: relative error >= 1e-2).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=1024, help="tokens of KV per sequence")
    p.add_argument("--graph-capacity", type=int, default=131072,
                   help="tokens a captured graph is sized for (the engine's max_model_len; "
                        "sets the split grid the engine's CUDA graphs use)")
    p.add_argument("--sweep-contexts", type=int, nargs="*", default=None,
                   help="contexts of the batch-1 split sweep (default: --context; none: skip)")
    p.add_argument("--reps", type=int, default=20, help="timed graph replays (median)")
    p.add_argument("--min-calls", type=int, default=64, help="calls per captured graph, at least")
    p.add_argument("--flush-bytes", type=int, default=192 << 20,
                   help="bytes the input copies of one graph add up to, at least (> L2)")
    p.add_argument("--max-copies", type=int, default=8192)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, eager timing: checks the script; CPU works (interpreter)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else parse_args([])

from benchmarks.lib.timing import gpu_or_smoke, rel_err  # noqa: E402

gpu_or_smoke(ARGS.smoke)

import triton  # noqa: E402

# These import Triton and our kernels: TRITON_INTERPRET must be set first.
from benchmarks.kernels.decode_ops_attention import bench_attention, sweep_splits  # noqa: E402
from benchmarks.kernels.decode_ops_common import (  # noqa: E402
    Report,
    Shape,
    bench,
    copies_for,
    copy_bound,
    count_kernels,
    fmt_bytes,
    make_kv,
    model_config,
    rnd,
    rope_cache,
    shape_of,
)
from benchmarks.kernels.decode_ops_kernels import Attn, cdiv  # noqa: E402
from tandem.engine.attention.base import AttentionMetadata, forward_context  # noqa: E402
from tandem.engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tandem.engine.config import ModelConfig  # noqa: E402
from tandem.engine.models.layers import DecoderLayer  # noqa: E402
from tandem.kernels import (  # noqa: E402  (TRITON_INTERPRET must be set first)
    rms_norm,
    rotary_embedding,
    rotary_store_kv,
    silu_and_mul,
    store_kv,
)
from tandem.kernels._common import num_sms  # noqa: E402
from tandem.kernels.paged_decode_launch import decode_config, decode_num_splits  # noqa: E402

# ----------------------------------------------------------------------------- per-op benchmarks

def bench_ops(batch: int, cfg: ModelConfig, shape: Shape, rep: Report,
              device: torch.device) -> None:
    """Every op of the layer, in layer order (norms first: they share a weight)."""
    bench_norms(batch, shape, rep, device)
    bench_linear(batch, "qkv linear", shape.qkv_out, shape.hidden, shape, rep, device)
    bench_rotary_store(batch, cfg, shape, rep, device)
    bench_attention(batch, shape, rep, device, ARGS)
    bench_linear(batch, "o_proj", shape.hidden, shape.num_q_heads * shape.head_dim, shape, rep,
                 device)
    bench_linear(batch, "gate_up linear", 2 * shape.inter, shape.hidden, shape, rep, device)
    bench_silu(batch, shape, rep, device)
    bench_linear(batch, "down linear", shape.hidden, shape.inter, shape, rep, device)


def bench_norms(b: int, shape: Shape, rep: Report, device: torch.device) -> None:
    h, el = shape.hidden, shape.el
    w = rnd(shape, device, h)
    nbytes = 2 * b * h * el + h * el
    xs = [rnd(shape, device, b, h) for _ in range(copies_for(nbytes, device, ARGS))]
    rep.add(b, "rms_norm", "", bench([lambda x=x: rms_norm(x, w, shape.eps) for x in xs],
                                     device, ARGS), nbytes)
    nbytes = 4 * b * h * el + h * el
    pairs = [(rnd(shape, device, b, h), rnd(shape, device, b, h))
             for _ in range(copies_for(nbytes, device, ARGS))]
    rep.add(b, "rms_norm + residual", "",
            bench([lambda p=p: rms_norm(p[0], w, shape.eps, p[1]) for p in pairs], device, ARGS),
            nbytes)


def bench_linear(b: int, name: str, n_out: int, n_in: int, shape: Shape, rep: Report,
                 device: torch.device) -> None:
    """y = x W^T with W [n_out, n_in], as the engine's layers call it (F.linear, M = batch)."""
    nbytes = (n_out * n_in + b * (n_in + n_out)) * shape.el
    pairs = [(rnd(shape, device, n_out, n_in) * 0.02, rnd(shape, device, b, n_in))
             for _ in range(copies_for(nbytes, device, ARGS))]
    rep.add(b, name, "F.linear", bench([lambda p=p: F.linear(p[1], p[0]) for p in pairs],
                                       device, ARGS), nbytes)


def bench_silu(b: int, shape: Shape, rep: Report, device: torch.device) -> None:
    nbytes = 3 * b * shape.inter * shape.el
    xs = [rnd(shape, device, b, 2 * shape.inter) for _ in range(copies_for(nbytes, device, ARGS))]
    rep.add(b, "silu_and_mul", "", bench([lambda x=x: silu_and_mul(x) for x in xs], device, ARGS),
            nbytes)


def bench_rotary_store(b: int, cfg: ModelConfig, shape: Shape, rep: Report,
                       device: torch.device) -> None:
    """rotary_embedding + store_kv (old) vs rotary_store_kv (new) on views of a qkv output."""
    hq, hkv, d, el = shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.el
    # q, k read and written; v read; k, v written to the cache; cos/sin; position and slot.
    nbytes = b * ((2 * (hq + hkv) + hkv + 2 * hkv) * d * el + d * 4 + 16)
    n = copies_for(nbytes, device, ARGS)
    bs = shape.block_size
    # Only the new tokens' slots matter: one scattered slot per (copy, sequence).
    pool = torch.empty(cdiv(n * b, bs) + 1, 2, 2, bs, hkv, d, dtype=shape.dtype, device=device)
    all_slots = torch.randperm(cdiv(n * b, bs) * bs, device=device)[:n * b].view(n, b)
    cache = rope_cache(cfg, device)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    qkvs = [rnd(shape, device, b, hq + 2 * hkv, d) for _ in range(n)]
    # Positions spread over the cache so its rows come from DRAM too.
    pos = [torch.randint(0, cache.shape[0], (b,), device=device) for _ in range(n)]

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return t[:, :hq], t[:, hq:hq + hkv], t[:, hq + hkv:]

    def old(c: int) -> None:
        q, k, v = views(qkvs[c])
        rotary_embedding(pos[c], q, k, cache)
        store_kv(k, v, k_cache, v_cache, all_slots[c])

    def new(c: int) -> None:
        q, k, v = views(qkvs[c])
        rotary_store_kv(pos[c], q, k, v, cache, k_cache, v_cache, all_slots[c])

    # From the same inputs, the same q, k and cached K.
    slots = all_slots[0]
    base = qkvs[0].clone()
    old(0)
    q_old, kc_old = qkvs[0].clone(), k_cache[slots // bs, slots % bs].clone()
    qkvs[0].copy_(base)
    new(0)
    rep.check(f"B={b} rotary+store new vs old: q, k", rel_err(qkvs[0], q_old))
    rep.check(f"B={b} rotary+store new vs old: k cache",
              rel_err(k_cache[slots // bs, slots % bs], kc_old))
    for label, fn in (("old: rotary_embedding + store_kv", old),
                      ("new: rotary_store_kv", new)):
        rep.add(b, "rotary + store", label,
                bench([lambda c=c, fn=fn: fn(c) for c in range(n)], device, ARGS), nbytes,
                count_kernels(lambda fn=fn: fn(0), device))


# ----------------------------------------------------------------------------- whole layer

def bench_layer(batch: int, cfg: ModelConfig, shape: Shape, rep: Report,
                device: torch.device) -> None:
    """A middle decoder layer (both norms add the residual), one graph of many layers cycling
    through copies of the weights; old ops, new ops, and the engine's DecoderLayer."""
    b, ctx, cap = batch, ARGS.context, ARGS.graph_capacity
    hq, hkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    op_bytes = {r.op: r.bytes for r in rep.rows if r.batch == b}
    layer_bytes = (2 * op_bytes["rms_norm + residual"] + op_bytes["qkv linear"]
                   + op_bytes["rotary + store"] + op_bytes[f"attention {ctx}"]
                   + op_bytes["o_proj"] + op_bytes["gate_up linear"] + op_bytes["silu_and_mul"]
                   + op_bytes["down linear"])
    n = max(2, copies_for(layer_bytes, device, ARGS)) if device.type == "cuda" else 1
    torch.manual_seed(b)
    layers = []
    for i in range(n):
        with torch.device(device):
            layer = DecoderLayer(cfg, i)  # layer i uses pool layer i; rotary cache stays fp32
        for name, p in layer.named_parameters():
            p.data = p.data.to(shape.dtype)
            if "norm" in name:
                p.data.uniform_(0.5, 1.5)
            else:
                p.data.normal_(0, 0.02)
        layers.append(layer)
    kv = make_kv(shape, b, ctx, cap, 1, n, device)
    backend = TritonAttentionBackend(kv.pool, hq, d ** -0.5)
    meta = AttentionMetadata(
        slot_mapping=kv.slots[0], query_start_loc=torch.arange(b + 1, dtype=torch.int32,
                                                               device=device),
        seq_lens=kv.seq_lens, block_tables=kv.tables[0], num_decodes=b, max_query_len=1,
        max_seq_len=kv.tables[0].shape[1] * shape.block_size, query_lens_cpu=[1] * b,
        seq_lens_cpu=[ctx] * b)
    x = torch.randn(b, shape.hidden, dtype=shape.dtype, device=device)
    residual = torch.randn_like(x)
    positions = kv.positions[0]
    splits = decode_num_splits(b, hkv, cap, num_sms(device), decode_config(d).block_n)
    attn = Attn(shape, b, splits, device)

    def explicit(i: int, new: bool) -> tuple[torch.Tensor, torch.Tensor]:
        lyr = layers[i]
        a, m = lyr.self_attn, lyr.mlp
        h = rms_norm(x, lyr.input_layernorm.weight, shape.eps, residual)
        qkv = F.linear(h.out, a.qkv_proj.weight).view(b, hq + 2 * hkv, d)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        kc, vc = backend.k_caches[i], backend.v_caches[i]
        cache = a.rotary.cos_sin_cache
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
        if new:
            rotary_store_kv(positions, q, k, v, cache, kc, vc, kv.slots[0])
            attn.new(q, kc, vc, kv.tables[0], kv.seq_lens, out)
        else:
            rotary_embedding(positions, q, k, cache)
            store_kv(k, v, kc, vc, kv.slots[0])
            attn.old(q, kc, vc, kv.tables[0], kv.seq_lens, out)
        o = F.linear(out.view(b, hq * d), a.o_proj.weight)
        h2 = rms_norm(o, lyr.post_attention_layernorm.weight, shape.eps, h.residual)
        return F.linear(silu_and_mul(F.linear(h2.out, m.gate_up_proj.weight)),
                        m.down_proj.weight), h2.residual

    def engine(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        with forward_context(backend, meta):
            return layers[i](positions, x, residual)

    with torch.inference_mode():
        got = {"old": explicit(0, False)[0], "new": explicit(0, True)[0], "engine": engine(0)[0]}
        rep.check(f"B={b} layer new vs old", rel_err(got["new"], got["old"]))
        rep.check(f"B={b} layer engine DecoderLayer vs new", rel_err(got["engine"], got["new"]))
        for label, fn in (("old ops (one graph)", lambda i: explicit(i, False)),
                          ("new ops (one graph)", lambda i: explicit(i, True)),
                          ("engine DecoderLayer (one graph)", engine)):
            rep.add(b, "layer", label, bench([lambda i=i, fn=fn: fn(i) for i in range(n)], device, ARGS),
                    layer_bytes, count_kernels(lambda fn=fn: fn(0), device))
    if int(backend.split_counters.abs().sum()) or int(attn.counters.abs().sum()):
        rep.failures.append(f"B={b}: split counters not reset after the layer graphs")


# ----------------------------------------------------------------------------- main

def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = model_config(ARGS.smoke)
    shape = shape_of(cfg, torch.float32 if ARGS.smoke else torch.bfloat16)
    if ARGS.smoke:
        ARGS.batches = [1, 2]
        ARGS.context, ARGS.graph_capacity = 200, 2048
        ARGS.sweep_contexts = [200] if ARGS.sweep_contexts is None else ARGS.sweep_contexts[:1]
    elif ARGS.sweep_contexts is None:
        ARGS.sweep_contexts = [ARGS.context]
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"card: {card}   torch {torch.__version__}   triton {triton.__version__}   "
          f"SMs {num_sms(device)}")
    print(f"layer: hidden {shape.hidden}, {shape.num_q_heads} q / {shape.num_kv_heads} kv heads,"
          f" D {shape.head_dim}, MLP {shape.inter}, {str(shape.dtype).removeprefix('torch.')}; "
          f"context {ARGS.context}, graphs sized for {ARGS.graph_capacity} tokens")
    copy_gbps = copy_bound(device, ARGS)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")
    rep = Report(copy_gbps)
    for batch in ARGS.batches:
        print(f"\n== batch {batch} ==")
        torch.manual_seed(batch)
        bench_ops(batch, cfg, shape, rep, device)
        bench_layer(batch, cfg, shape, rep, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    sweep = sweep_splits(shape, rep, device, ARGS) if ARGS.sweep_contexts else []

    print(f"\n== decode ops of one layer, {card}, copy bandwidth {copy_gbps:.0f} GB/s ==")
    print(f"{'batch':>5} {'op':<22} {'variant':<44} {'us':>9} {'bytes':>10} {'GB/s':>7} "
          f"{'of floor':>8} {'kernels':>7}")
    for r in rep.rows:
        print(f"{r.batch:>5} {r.op:<22} {r.variant:<44} {r.us:>9.2f} {fmt_bytes(r.bytes):>10} "
              f"{r.gbps:>7.0f} {100 * r.of_floor:>7.1f}% "
              f"{'-' if r.kernels is None else r.kernels:>7}")
    for b in ARGS.batches:
        layer = {r.variant.split(" (")[0]: r for r in rep.rows if r.batch == b and r.op == "layer"}
        if "old ops" in layer and "new ops" in layer:
            print(f"batch {b}: layer new / old = {layer['new ops'].us / layer['old ops'].us:.3f}"
                  f" ({layer['old ops'].us - layer['new ops'].us:+.2f} us saved per layer)")
    if ARGS.out:
        ARGS.out.write_text(json.dumps({
            "card": card, "torch": torch.__version__, "triton": triton.__version__,
            "copy_gbps": copy_gbps, "context": ARGS.context,
            "graph_capacity": ARGS.graph_capacity, "rows": [asdict(r) for r in rep.rows],
            "split_sweep": sweep, "failures": rep.failures}, indent=2))
        print(f"wrote {ARGS.out}")
    if rep.failures:
        print("FAILED checks:\n  " + "\n  ".join(rep.failures))
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
