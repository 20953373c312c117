"""paged_prefill_attention (TFLOP/s; torch SDPA flash causal beside it where there is no cached
context) and copy_blocks (random blocks vs one large copy and torch indexing) in
benchmarks/kernels/paged_kernels.py.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.kernels.paged_kernels_common import Shape, bench, fits
from benchmarks.lib.timing import rel_err
from tandem.kernels import copy_blocks, paged_prefill_attention
from tandem.kernels.paged_prefill_attention import PrefillConfig

# ----------------------------------------------------------------------------- prefill

@dataclass
class PrefillInputs:
    """`batch` chunks of `chunk` query tokens, each over `cached` tokens already in its blocks
    (16-token blocks of randomly permuted ids in a one-layer pool: [blocks, 1, K/V, ...])."""

    chunk: int
    pool: torch.Tensor
    tables: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor
    qsl: torch.Tensor
    lens: torch.Tensor
    scale: float

    def call(self, config: PrefillConfig | None = None) -> Callable[[], torch.Tensor]:
        return lambda: paged_prefill_attention(
            self.q, self.pool[:, 0, 0], self.pool[:, 0, 1], self.qsl, self.lens, self.tables,
            self.scale, self.chunk, out=self.out, config=config)


def prefill_pool_bytes(batch: int, chunk: int, cached: int, shape: Shape, block_size: int) -> int:
    el = torch.tensor([], dtype=shape.dtype).element_size()
    nblk = -(-(cached + chunk) // block_size)
    return batch * nblk * block_size * 2 * shape.num_kv_heads * shape.head_dim * el


def make_prefill_inputs(batch: int, chunk: int, cached: int, shape: Shape, block_size: int,
                        device: torch.device) -> PrefillInputs:
    seq_len = cached + chunk
    nblk = -(-seq_len // block_size)
    pool = torch.randn(batch * nblk, 1, 2, block_size, shape.num_kv_heads, shape.head_dim,
                       dtype=shape.dtype, device=device)
    tables = torch.randperm(batch * nblk, device=device).to(torch.int32).view(batch, nblk)
    q = torch.randn(batch * chunk, shape.num_q_heads, shape.head_dim, dtype=shape.dtype,
                    device=device)
    return PrefillInputs(
        chunk, pool, tables.contiguous(), q, torch.empty_like(q),
        torch.arange(0, batch + 1, dtype=torch.int32, device=device) * chunk,
        torch.full((batch,), seq_len, dtype=torch.int32, device=device), shape.head_dim ** -0.5)


def bench_prefill(batch: int, chunk: int, cached: int, shape: Shape, args: argparse.Namespace,
                  device: torch.device) -> dict[str, Any]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    row: dict[str, Any] = {"batch": batch, "chunk": chunk, "cached": cached}
    if not fits(2 * prefill_pool_bytes(batch, chunk, cached, shape, args.block_size), device):
        row["skipped"] = "memory"
        return row
    inp = make_prefill_inputs(batch, chunk, cached, shape, args.block_size, device)
    pool, tables, q, out = inp.pool, inp.tables, inp.q, inp.out
    t = bench([inp.call()], device, args.reps, min_calls=5)
    visible = batch * (chunk * cached + chunk * (chunk + 1) // 2)
    flops = 4 * shape.num_q_heads * shape.head_dim * visible
    row.update(us=t * 1e6, tflops=flops / t / 1e12)
    if cached == 0:
        # Same keys, contiguous, SDPA flash causal (aligned top-left = bottom-right here).
        k = pool[:, 0, 0][tables.long()].reshape(batch, -1, shape.num_kv_heads,
                                                 shape.head_dim)[:, :chunk].transpose(1, 2)
        v = pool[:, 0, 1][tables.long()].reshape(batch, -1, shape.num_kv_heads,
                                                 shape.head_dim)[:, :chunk].transpose(1, 2)
        k, v = k.contiguous(), v.contiguous()
        qb = q.view(batch, chunk, shape.num_q_heads, shape.head_dim).transpose(1, 2)
        backends = [SDPBackend.FLASH_ATTENTION] if device.type == "cuda" else [SDPBackend.MATH]

        def sdpa() -> torch.Tensor:
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(qb, k, v, is_causal=True, enable_gqa=True)

        try:
            ts = bench([sdpa], device, args.reps, min_calls=5)
            row.update(sdpa_us=ts * 1e6, ratio_vs_sdpa=t / ts,
                       rel_err_vs_sdpa=rel_err(out.view(batch, chunk, shape.num_q_heads, -1),
                                               sdpa().transpose(1, 2)))
        except RuntimeError as e:
            row["sdpa_error"] = str(e).splitlines()[0][:160]
    return row


# ----------------------------------------------------------------------------- copy_blocks

def bench_copy_blocks(args: argparse.Namespace, device: torch.device,
                      copy_gbps: float) -> dict[str, Any]:
    if args.smoke:
        block_shape, num_blocks, moved = (2, 2, 16, 2, 64), 64, 16
        dtype = torch.float32
    else:
        block_shape, num_blocks, moved = (32, 2, 16, 8, 128), 512, 128
        dtype = torch.bfloat16
    src = torch.randn(num_blocks, *block_shape, dtype=dtype, device=device)
    dst = torch.zeros_like(src)
    src_ids = torch.randperm(num_blocks, device=device)[:moved]
    dst_ids = torch.randperm(num_blocks, device=device)[:moved]
    block_bytes = src[0].numel() * src.element_size()
    payload = moved * block_bytes
    flat_src, flat_dst = src.view(-1), dst.view(-1)
    n = payload // src.element_size()

    t_kernel = bench([lambda: copy_blocks(src, dst, src_ids, dst_ids)], device, args.reps, 5)
    ok = torch.equal(dst[dst_ids], src[src_ids])
    t_cow = bench([lambda: copy_blocks(dst, dst, dst_ids[: moved // 2], dst_ids[moved // 2:])],
                  device, args.reps, 5)
    t_big = bench([lambda: flat_dst[:n].copy_(flat_src[:n])], device, args.reps, 5)

    def index_copy() -> None:
        dst[dst_ids] = src[src_ids]

    t_index = bench([index_copy], device, args.reps, 5)

    def gbps(t: float, nbytes: int = payload) -> float:
        return 2 * nbytes / t / 1e9  # read + write, as the copy bandwidth

    return {
        "blocks": moved, "block_bytes": block_bytes, "correct": ok,
        "copy_blocks_us": t_kernel * 1e6, "copy_blocks_gbps": gbps(t_kernel),
        "same_pool_cow_gbps": gbps(t_cow, payload // 2),
        "one_large_copy_us": t_big * 1e6, "one_large_copy_gbps": gbps(t_big),
        "torch_index_gbps": gbps(t_index),
        "vs_one_large_copy": t_big / t_kernel,
        "copy_share": gbps(t_kernel) / copy_gbps,
    }
