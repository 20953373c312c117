"""Time each op of one Llama-3.1-8B decoder layer at decode (one new token per sequence) on one
GPU, old and new kernels side by side, and the whole layer as one CUDA graph.

    python benchmarks/decode_ops.py                               # batch 1 and 64, 1k context
    python benchmarks/decode_ops.py --batches 1 --sweep-contexts 1024 4096 --out ops.json
    python benchmarks/decode_ops.py --smoke                       # tiny shapes, CPU interpreter

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
  code). Last, a sweep of the split policy's min_split_tiles for batch-1 decode attention.

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
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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

from benchmarks.timing import copy_bandwidth, gpu_or_smoke, graph_time, rel_err  # noqa: E402

gpu_or_smoke(ARGS.smoke)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine.attention.base import AttentionMetadata, forward_context  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.models.layers import DecoderLayer  # noqa: E402
from kernels import (  # noqa: E402  (TRITON_INTERPRET must be set first)
    SplitPolicy,
    paged_decode_attention,
    paged_decode_attention_ref,
    rms_norm,
    rotary_embedding,
    rotary_store_kv,
    silu_and_mul,
    store_kv,
)
from kernels._common import num_sms  # noqa: E402
from kernels.paged_decode_attention import LOG2E, _attend  # noqa: E402
from kernels.paged_decode_launch import (  # noqa: E402
    DEFAULT_SPLIT_POLICY,
    decode_config,
    decode_num_splits,
    decode_split_len,
    decode_workspace_numel,
)

TOL = 1e-2
CONFIG = Path(__file__).resolve().parent / "configs" / "llama-3.1-8b" / "config.json"


# ----------------------------------------------------------------------------- the old kernels

@triton.jit
def _old_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, part_ptr, lse_ptr, scale_log2,
    stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ps, stride_ph, stride_psp, stride_ls, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The replaced design's split pass: each split writes its partial; no minimum length, so
    a grid sized for long contexts cuts a short one into one-tile splits."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    if start < seq_len:
        end = tl.minimum(start + split_len, seq_len)
        acc, m_i, l_i = _attend(
            q_ptr, k_ptr, v_ptr, bt_ptr, seq, kv_head, start, end, scale_log2,
            stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
            stride_vh, stride_bt, GROUP, BLOCK_H, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PRECISION)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + offs_h
        head_mask = offs_h < GROUP
        tl.store(part_ptr + seq.to(tl.int64) * stride_ps + heads[:, None] * stride_ph
                 + split * stride_psp + offs_d[None, :], acc / l_safe[:, None],
                 mask=head_mask[:, None])
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, m_i + tl.log2(l_safe),
                 mask=head_mask)


@triton.jit
def _old_merge_kernel(
    part_ptr, lse_ptr, seq_lens_ptr, o_ptr,
    stride_ps, stride_ph, stride_psp, stride_ls, stride_lh, stride_os, stride_oh,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """The replaced design's second launch: one program per (sequence, query head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    num_active = tl.cdiv(seq_len, tl.maximum(split_len, 1))
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_active
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    part = tl.load(part_ptr + seq.to(tl.int64) * stride_ps + head * stride_ph
                   + offs_s[:, None] * stride_psp + offs_d[None, :],
                   mask=s_mask[:, None], other=0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(o_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
             out.to(o_ptr.dtype.element_ty))


def old_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         out: torch.Tensor, num_splits: int, workspace: torch.Tensor
                         ) -> torch.Tensor:
    """The replaced paged_decode_attention: split kernel + merge kernel (no split: the
    unchanged single kernel)."""
    if num_splits == 1:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                      out=out, num_splits=1)
    s, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    cfg = decode_config(d)
    n_part = s * hq * num_splits * d
    part = workspace[:n_part].view(s, hq, num_splits, d)
    lse = workspace[n_part:n_part + s * hq * num_splits].view(s, hq, num_splits)
    _old_split_kernel[(s, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part, lse, scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), *part.stride()[:3], *lse.stride()[:2],
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.block_n,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=d, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _old_merge_kernel[(s, hq)](
        part, lse, seq_lens, out, *part.stride()[:3], *lse.stride()[:2],
        out.stride(0), out.stride(1), BLOCK_N=cfg.block_n, HEAD_DIM=d, NUM_SPLITS=num_splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        num_warps=4 if d <= 128 else 8)
    return out


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def old_active_splits(ctx: int, num_splits: int, block_n: int) -> int:
    """Splits that see tokens in the old kernel (no minimum split length)."""
    return cdiv(ctx, cdiv(cdiv(ctx, num_splits), block_n) * block_n)


def new_active_splits(ctx: int, num_splits: int, block_n: int, min_split_tiles: int) -> int:
    if num_splits == 1:
        return 1
    return cdiv(ctx, decode_split_len(ctx, num_splits, block_n, min_split_tiles))


# ----------------------------------------------------------------------------- shapes, timing

@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    eps: float = 1e-5
    block_size: int = 16

    @property
    def qkv_out(self) -> int:
        return (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def el(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()


def model_config(smoke: bool) -> ModelConfig:
    cfg = json.loads(CONFIG.read_text())
    if smoke:
        cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    return ModelConfig.from_hf_dict(cfg)


def shape_of(cfg: ModelConfig, dtype: torch.dtype) -> Shape:
    return Shape(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                 cfg.head_dim, dtype, cfg.rms_norm_eps)


def copies_for(nbytes: int, device: torch.device) -> int:
    """Input copies whose bytes add up to --flush-bytes (one on the CPU)."""
    if device.type != "cuda":
        return 1
    return max(1, min(ARGS.max_copies, math.ceil(ARGS.flush_bytes / max(nbytes, 1))))


def bench(calls: list[Callable[[], object]], device: torch.device) -> float:
    """Seconds per call: one CUDA graph replaying the calls (cycled to --min-calls), median of
    --reps replays. On the CPU, eager."""
    for f in calls:
        f()  # compile, warm up
    seq = calls * max(1, math.ceil(ARGS.min_calls / len(calls)))
    if device.type != "cuda":
        t0 = time.perf_counter()
        for f in seq[:len(calls)]:
            f()
        return (time.perf_counter() - t0) / len(calls)
    return graph_time(seq, ARGS.reps)


def count_kernels(fn: Callable[[], object], device: torch.device) -> int | None:
    """Device kernels and copies one eager call launches (profiler), or None."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    except Exception:  # noqa: BLE001 - the count is informative only
        return None


def copy_bound(device: torch.device) -> float:
    """GB/s of one large device-to-device copy (benchmarks/timing.py)."""
    return copy_bandwidth(device, (16 << 20) if device.type != "cuda" else (1 << 30),
                          max(3, ARGS.reps // 2))


@dataclass
class Row:
    batch: int
    op: str
    variant: str
    us: float
    bytes: int
    gbps: float
    of_floor: float
    kernels: int | None


class Report:
    def __init__(self, copy_gbps: float) -> None:
        self.copy_gbps = copy_gbps
        self.rows: list[Row] = []
        self.failures: list[str] = []

    def add(self, batch: int, op: str, variant: str, seconds: float, nbytes: int,
            kernels: int | None = None) -> Row:
        floor = nbytes / (self.copy_gbps * 1e9)
        row = Row(batch, op, variant, seconds * 1e6, nbytes, nbytes / seconds / 1e9,
                  floor / seconds, kernels)
        self.rows.append(row)
        print(f"  {op:<22} {variant:<44} {row.us:9.2f} us {fmt_bytes(nbytes):>10} "
              f"{row.gbps:7.0f} GB/s {100 * row.of_floor:6.1f}% of floor"
              + (f"  {kernels} kernels" if kernels is not None else ""), flush=True)
        return row

    def check(self, what: str, err: float, tol: float = TOL) -> None:
        if not err < tol:
            self.failures.append(f"{what}: rel err {err:.2e}")
            print(f"  CHECK FAILED {what}: rel err {err:.2e} (>= {tol:.0e})", flush=True)


def fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# ----------------------------------------------------------------------------- decode state

@dataclass
class KV:
    """One pool [N, L, 2, bs, Hkv, D] and, per copy, block tables for batch sequences of ctx
    tokens (scattered block ids, distinct per copy; each table as wide as the graph capacity,
    as in the engine's CUDA graphs), and the slot and position of each sequence's new token
    (its last)."""

    pool: torch.Tensor
    tables: list[torch.Tensor]
    seq_lens: torch.Tensor
    slots: list[torch.Tensor]
    positions: list[torch.Tensor]


def make_kv(shape: Shape, batch: int, ctx: int, capacity: int, copies: int, layers: int,
            device: torch.device) -> KV:
    bs = shape.block_size
    per_seq = -(ctx // -bs)
    num_blocks = copies * batch * per_seq + 1
    pool = torch.empty(num_blocks, layers, 2, bs, shape.num_kv_heads, shape.head_dim,
                       dtype=shape.dtype, device=device).normal_()
    perm = torch.randperm(num_blocks - 1, device=device).to(torch.int32)
    width = max(per_seq, -(capacity // -bs))
    tables, slots, positions = [], [], []
    for c in range(copies):
        t = torch.full((batch, width), num_blocks - 1, dtype=torch.int32, device=device)
        t[:, :per_seq] = perm[c * batch * per_seq:(c + 1) * batch * per_seq].view(batch, per_seq)
        tables.append(t)
        last = t[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs
        slots.append(last.contiguous())
        positions.append(torch.full((batch,), ctx - 1, dtype=torch.long, device=device))
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return KV(pool, tables, seq_lens, slots, positions)


def rope_cache(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    from engine.models.layers import RotaryEmbedding

    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                           cfg.rope_scaling).cos_sin_cache.to(device)


class Attn:
    """Old and new decode attention with their workspaces, for one grid size."""

    def __init__(self, shape: Shape, batch: int, num_splits: int, device: torch.device,
                 policy: SplitPolicy = DEFAULT_SPLIT_POLICY) -> None:
        self.num_splits = num_splits
        self.policy = policy
        numel = decode_workspace_numel(batch, shape.num_q_heads, shape.head_dim, num_splits)
        self.ws_old = torch.empty(numel, dtype=torch.float32, device=device)
        self.ws_new = torch.empty(numel, dtype=torch.float32, device=device)
        self.counters = torch.zeros(batch * shape.num_kv_heads, dtype=torch.int32,
                                    device=device)
        self.scale = shape.head_dim ** -0.5

    def new(self, q, k_cache, v_cache, tables, seq_lens, out):  # type: ignore[no-untyped-def]
        return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, self.scale,
                                      out=out, num_splits=self.num_splits,
                                      workspace=self.ws_new, counters=self.counters,
                                      policy=self.policy)

    def old(self, q, k_cache, v_cache, tables, seq_lens, out):  # type: ignore[no-untyped-def]
        return old_decode_attention(q, k_cache, v_cache, tables, seq_lens, self.scale, out,
                                    self.num_splits, self.ws_old)


# ----------------------------------------------------------------------------- per-op benchmarks

def bench_ops(batch: int, cfg: ModelConfig, shape: Shape, rep: Report,
              device: torch.device) -> None:
    """Every op of the layer, in layer order (norms first: they share a weight)."""
    bench_norms(batch, shape, rep, device)
    bench_linear(batch, "qkv linear", shape.qkv_out, shape.hidden, shape, rep, device)
    bench_rotary_store(batch, cfg, shape, rep, device)
    bench_attention(batch, shape, rep, device)
    bench_linear(batch, "o_proj", shape.hidden, shape.num_q_heads * shape.head_dim, shape, rep,
                 device)
    bench_linear(batch, "gate_up linear", 2 * shape.inter, shape.hidden, shape, rep, device)
    bench_silu(batch, shape, rep, device)
    bench_linear(batch, "down linear", shape.hidden, shape.inter, shape, rep, device)


def rnd(shape: Shape, device: torch.device, *size: int) -> torch.Tensor:
    return torch.randn(*size, dtype=shape.dtype, device=device)


def bench_norms(b: int, shape: Shape, rep: Report, device: torch.device) -> None:
    h, el = shape.hidden, shape.el
    w = rnd(shape, device, h)
    nbytes = 2 * b * h * el + h * el
    xs = [rnd(shape, device, b, h) for _ in range(copies_for(nbytes, device))]
    rep.add(b, "rms_norm", "", bench([lambda x=x: rms_norm(x, w, shape.eps) for x in xs],
                                     device), nbytes)
    nbytes = 4 * b * h * el + h * el
    pairs = [(rnd(shape, device, b, h), rnd(shape, device, b, h))
             for _ in range(copies_for(nbytes, device))]
    rep.add(b, "rms_norm + residual", "",
            bench([lambda p=p: rms_norm(p[0], w, shape.eps, p[1]) for p in pairs], device),
            nbytes)


def bench_linear(b: int, name: str, n_out: int, n_in: int, shape: Shape, rep: Report,
                 device: torch.device) -> None:
    """y = x W^T with W [n_out, n_in], as the engine's layers call it (F.linear, M = batch)."""
    nbytes = (n_out * n_in + b * (n_in + n_out)) * shape.el
    pairs = [(rnd(shape, device, n_out, n_in) * 0.02, rnd(shape, device, b, n_in))
             for _ in range(copies_for(nbytes, device))]
    rep.add(b, name, "F.linear", bench([lambda p=p: F.linear(p[1], p[0]) for p in pairs],
                                       device), nbytes)


def bench_silu(b: int, shape: Shape, rep: Report, device: torch.device) -> None:
    nbytes = 3 * b * shape.inter * shape.el
    xs = [rnd(shape, device, b, 2 * shape.inter) for _ in range(copies_for(nbytes, device))]
    rep.add(b, "silu_and_mul", "", bench([lambda x=x: silu_and_mul(x) for x in xs], device),
            nbytes)


def bench_rotary_store(b: int, cfg: ModelConfig, shape: Shape, rep: Report,
                       device: torch.device) -> None:
    """rotary_embedding + store_kv (old) vs rotary_store_kv (new) on views of a qkv output."""
    hq, hkv, d, el = shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.el
    # q, k read and written; v read; k, v written to the cache; cos/sin; position and slot.
    nbytes = b * ((2 * (hq + hkv) + hkv + 2 * hkv) * d * el + d * 4 + 16)
    n = copies_for(nbytes, device)
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
                bench([lambda c=c, fn=fn: fn(c) for c in range(n)], device), nbytes,
                count_kernels(lambda fn=fn: fn(0), device))


def attention_bytes(b: int, ctx: int, shape: Shape) -> int:
    """K and V of the context, q and out, block-table entries."""
    hq, hkv, d, el = shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.el
    return b * (2 * ctx * hkv * d * el + 2 * hq * d * el + cdiv(ctx, shape.block_size) * 4)


class AttnInputs:
    """copies of (q, out) over one pool, each copy with its own blocks."""

    def __init__(self, shape: Shape, b: int, ctx: int, device: torch.device) -> None:
        self.n = copies_for(attention_bytes(b, ctx, shape), device)
        self.kv = make_kv(shape, b, ctx, ARGS.graph_capacity, self.n, 2, device)
        self.k_cache, self.v_cache = self.kv.pool[:, 1, 0], self.kv.pool[:, 1, 1]
        self.qs = [rnd(shape, device, b, shape.num_q_heads, shape.head_dim)
                   for _ in range(self.n)]
        self.outs = [torch.empty_like(q) for q in self.qs]
        self.ref = paged_decode_attention_ref(self.qs[0], self.k_cache, self.v_cache,
                                              self.kv.tables[0], self.kv.seq_lens,
                                              shape.head_dim ** -0.5)

    def calls(self, fn: Callable[..., torch.Tensor]) -> list[Callable[[], torch.Tensor]]:
        return [lambda c=c: fn(self.qs[c], self.k_cache, self.v_cache, self.kv.tables[c],
                               self.kv.seq_lens, self.outs[c]) for c in range(self.n)]

    def error(self, fn: Callable[..., torch.Tensor]) -> float:
        self.calls(fn)[0]()
        return rel_err(self.outs[0], self.ref)


def bench_attention(b: int, shape: Shape, rep: Report, device: torch.device) -> None:
    """Old (split + merge launches) vs new (one launch), with the grid the engine's graphs use
    and, where different, one sized for the context."""
    ctx, cap = ARGS.context, ARGS.graph_capacity
    inp = AttnInputs(shape, b, ctx, device)
    sms, block_n = num_sms(device), decode_config(shape.head_dim).block_n
    grids = {f"(for {cap})": decode_num_splits(b, shape.num_kv_heads, cap, sms, block_n),
             f"(for {ctx})": decode_num_splits(b, shape.num_kv_heads, ctx, sms, block_n)}
    if len(set(grids.values())) == 1:
        grids = {"": grids[f"(for {ctx})"]}
    nbytes = attention_bytes(b, ctx, shape)
    for sized, splits in grids.items():
        attn = Attn(shape, b, splits, device)
        for label, fn, active in (
                ("old", attn.old, old_active_splits(ctx, splits, block_n)),
                ("new", attn.new, new_active_splits(ctx, splits, block_n,
                                                    attn.policy.min_split_tiles))):
            rep.check(f"B={b} attention {label} {sized} vs reference", inp.error(fn))
            calls = inp.calls(fn)
            rep.add(b, f"attention {ctx}", f"{label}: grid {splits}{' ' * bool(sized)}{sized}, {active} active",
                    bench(calls, device), nbytes, count_kernels(calls[0], device))
        if int(attn.counters.abs().sum()) != 0:
            rep.failures.append(f"B={b}: split counters not reset")


def sweep_splits(shape: Shape, rep: Report, device: torch.device) -> list[dict[str, Any]]:
    """Batch-1 decode attention over min_split_tiles, with the grid sized for the graph
    capacity (what the engine's graphs launch); old with a grid of as many splits as the new
    kernel runs (its best case: no one-tile splits)."""
    block_n = decode_config(shape.head_dim).block_n
    grid = decode_num_splits(1, shape.num_kv_heads, ARGS.graph_capacity, num_sms(device),
                             block_n)
    default_mt = DEFAULT_SPLIT_POLICY.min_split_tiles
    print(f"\nsplit sweep, batch 1, new grid {grid} splits (sized for {ARGS.graph_capacity} "
          "tokens); old grid = the splits the new one runs:")
    print(f"  {'context':>7} {'min_split_tiles':>15} {'active':>6} {'old us':>8} {'new us':>8}"
          f" {'new/old':>7}")
    results: list[dict[str, Any]] = []
    for ctx in ARGS.sweep_contexts:
        inp = AttnInputs(shape, 1, ctx, device)
        tiles = cdiv(ctx, block_n)
        for mt in sorted({m for m in (1, 2, 4, 8, 16, 32, 64) if m <= tiles}
                         | {default_mt, tiles}):
            active = new_active_splits(ctx, grid, block_n, mt)
            new = Attn(shape, 1, grid, device, SplitPolicy(min_split_tiles=mt))
            old = Attn(shape, 1, active, device)
            times = {}
            for label, fn in (("old", old.old), ("new", new.new)):
                rep.check(f"sweep ctx={ctx} min_split_tiles={mt} {label}", inp.error(fn))
                times[label] = bench(inp.calls(fn), device) * 1e6
            r = {"context": ctx, "min_split_tiles": mt, "active_splits": active,
                 "old_us": times["old"], "new_us": times["new"], "default": mt == default_mt}
            results.append(r)
            print(f"  {ctx:>7} {mt:>15} {active:>6} {r['old_us']:>8.2f} {r['new_us']:>8.2f} "
                  f"{r['new_us'] / r['old_us']:>7.2f}" + ("   <- default" if r["default"] else ""),
                  flush=True)
        best = min((r for r in results if r["context"] == ctx), key=lambda r: r["new_us"])
        print(f"  best at {ctx}: min_split_tiles {best['min_split_tiles']} "
              f"({best['active_splits']} splits, {best['new_us']:.2f} us)")
    return results


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
    n = max(2, copies_for(layer_bytes, device)) if device.type == "cuda" else 1
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
            rep.add(b, "layer", label, bench([lambda i=i, fn=fn: fn(i) for i in range(n)], device),
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
    copy_gbps = copy_bound(device)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")
    rep = Report(copy_gbps)
    for batch in ARGS.batches:
        print(f"\n== batch {batch} ==")
        torch.manual_seed(batch)
        bench_ops(batch, cfg, shape, rep, device)
        bench_layer(batch, cfg, shape, rep, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    sweep = sweep_splits(shape, rep, device) if ARGS.sweep_contexts else []

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
