"""What the parts of benchmarks/kernels/decode_ops.py share: the layer's shape (the 8B config, or tiny
for --smoke), input copies and timing (knobs from the script's arguments), the report with its
checks, and the decode state (a block-major KV pool with block tables, slots and positions).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.lib.timing import copy_bandwidth, graph_time
from tandem.engine.config import ModelConfig

TOL = 1e-2
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "llama-3.1-8b" / "config.json"


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


def copies_for(nbytes: int, device: torch.device, args: argparse.Namespace) -> int:
    """Input copies whose bytes add up to --flush-bytes (one on the CPU)."""
    if device.type != "cuda":
        return 1
    return max(1, min(args.max_copies, math.ceil(args.flush_bytes / max(nbytes, 1))))


def bench(calls: list[Callable[[], object]], device: torch.device,
          args: argparse.Namespace) -> float:
    """Seconds per call: one CUDA graph replaying the calls (cycled to --min-calls), median of
    --reps replays. On the CPU, eager."""
    for f in calls:
        f()  # compile, warm up
    seq = calls * max(1, math.ceil(args.min_calls / len(calls)))
    if device.type != "cuda":
        t0 = time.perf_counter()
        for f in seq[:len(calls)]:
            f()
        return (time.perf_counter() - t0) / len(calls)
    return graph_time(seq, args.reps)


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


def copy_bound(device: torch.device, args: argparse.Namespace) -> float:
    """GB/s of one large device-to-device copy (benchmarks/lib/timing.py)."""
    return copy_bandwidth(device, (16 << 20) if device.type != "cuda" else (1 << 30),
                          max(3, args.reps // 2))


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
    from tandem.engine.models.layers import RotaryEmbedding

    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                           cfg.rope_scaling).cos_sin_cache.to(device)


def rnd(shape: Shape, device: torch.device, *size: int) -> torch.Tensor:
    return torch.randn(*size, dtype=shape.dtype, device=device)
