"""The attention backend interface: metadata is built once per step outside the layers; each
attention layer then calls `forward(layer, q, k, v, meta, rope)`, which applies the rotary
embedding to q and k, stores the new K/V into the paged pool and attends over the whole
context. (Rotary lives here, not in the model, so that a backend can fuse it with the store.)

Token order within a step (the model runner guarantees it):

    [ decode seq 0 | decode seq 1 | ... | prefill chunk A ....... | prefill chunk B ... ]
      1 token each  (num_decodes of them)  query_start_loc marks every sequence's start

A sequence's context after the step is seq_lens[b] tokens; its new tokens are the last
query_len of them, at positions seq_lens[b] - query_len ... seq_lens[b] - 1.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tandem.engine.quantization.kv_cache import FP8_DTYPE, KVScales


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: pool slot (block_id * block_size + offset); -1 skips
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq]
    num_decodes: int  # the first num_decodes sequences have exactly one new token each
    max_query_len: int
    max_seq_len: int
    # Host copies for backends that loop on the CPU.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # The GPU backend's prefill work items: int32 [N, 2] (sequence, query tile) for the
    # sequences after the decodes, counted from the first of them
    # (kernels/paged_prefill_attention.py); None: every pair the chunks' lengths allow.
    prefill_tiles: torch.Tensor | None = None
    # A step replayed from a mixed-step graph (engine/cuda_graphs.py): per sequence of its
    # capacity, the context of a decode and 0 for the others. The decode kernel then runs
    # over those rows (a 0 writes zeros) and the prefill kernel over the prefill_tiles items,
    # which list the chunks of the whole batch (sequence indices from 0).
    decode_lens: torch.Tensor | None = None
    # The GPU backend's decode work items (kernels/paged_decode_launch.py decode_plan): int32
    # [capacity + 1, 2] over the decode rows (decode_lens' rows in a mixed-step graph); None:
    # the launcher's own split heuristic.
    decode_plan: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class Rope(NamedTuple):
    """A layer's rotary embedding for this step (Neox style, kernels/rotary_embedding.py)."""

    positions: torch.Tensor  # int [T]: each token's position
    cos_sin_cache: torch.Tensor  # fp32 [max_position, R]: row p = [cos(p f) | sin(p f)]


class AttentionBackend(ABC):
    """Owns the per-layer views of the block-major KV pool

        pool: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

    Layer l's K cache is pool[:, l, 0]: shape [num_blocks, block_size, num_kv_heads, head_dim]
    with a block stride of num_layers * 2 * block_size * num_kv_heads * head_dim elements.

    An FP8 pool comes with kv_scales (engine/quantization/kv_cache.py): layer l's K and V
    scales per KV head are kv_scale(l); other pools have none (kv_scale(l) is (None, None)).
    """

    def __init__(self, pool: torch.Tensor, num_heads: int, scale: float,
                 kv_scales: KVScales | None = None) -> None:
        assert pool.dim() == 6 and pool.shape[2] == 2, "pool must be block-major [N, L, 2, bs, H, D]"
        if (pool.dtype == FP8_DTYPE) != (kv_scales is not None):
            raise ValueError(f"a {pool.dtype} pool takes kv_scales exactly when it is FP8")
        self.pool = pool
        self.num_heads = num_heads
        self.scale = scale
        self.kv_scales = kv_scales
        self.k_caches = [pool[:, layer, 0] for layer in range(pool.shape[1])]
        self.v_caches = [pool[:, layer, 1] for layer in range(pool.shape[1])]
        # Views made once (no per-step indexing); KVScales.set writes through them.
        self._kv_scale_rows = [
            (None, None) if kv_scales is None else (kv_scales.k[layer], kv_scales.v[layer])
            for layer in range(pool.shape[1])]

    def plan_capacity(self, rows: int) -> int:
        """Work items of a decode plan (metadata.decode_plan) for `rows` decode rows; 0: this
        backend takes no plan."""
        return 0

    def kv_scale(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer's (k_scale, v_scale), fp32 [num_kv_heads] each, or (None, None)."""
        return self._kv_scale_rows[layer]

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, rope: Rope | None = None) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]. Returns like q.

        With rope, q and k are rotated in place first (k as stored in the pool); without it
        they are used as given."""


def prefill_tiles(query_lens: list[int], block_q: int, capacity: int = 0,
                  first: int = 0) -> list[int]:
    """The work items of the chunks of these lengths from sequence `first` on, flat [seq, tile,
    seq, tile, ...]: each sequence's tiles last first (they see the most keys), padded with
    (-1, 0) to `capacity` items."""
    out: list[int] = []
    for seq in range(first, len(query_lens)):
        for t in range(-(-query_lens[seq] // block_q) - 1, -1, -1):
            out += (seq, t)
    if capacity:
        assert len(out) <= 2 * capacity, "more work items than the capacity"
        out += (-1, 0) * (capacity - len(out) // 2)
    return out


def max_prefill_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """The most work items chunks of num_tokens tokens over num_seqs sequences can need."""
    return -(-num_tokens // block_q) + num_seqs


@dataclass
class ForwardContext:
    backend: AttentionBackend | None
    metadata: AttentionMetadata | None


_context: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(backend: AttentionBackend | None,
                    metadata: AttentionMetadata | None) -> Iterator[ForwardContext]:
    """Scope of one forward pass. Refuses nesting; always resets."""
    global _context
    if _context is not None:
        raise RuntimeError("forward_context does not nest")
    _context = ForwardContext(backend, metadata)
    try:
        yield _context
    finally:
        _context = None


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention called outside forward_context")
    return _context
