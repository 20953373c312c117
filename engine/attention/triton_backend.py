"""Triton paged attention: the GPU backend.

Per layer: rotate q and k and store the step's K/V into the pool (one kernel), then attend.
Token order (see base.py):

    [ decode 0 | decode 1 | ... | prefill chunk A ...... | prefill chunk B ... ]
      paged_decode_attention      paged_prefill_attention (query_start_loc rebased to 0)

An all-decode step is two launches per layer (rotary + store, decode attention; a split
decode merges inside its own launch), with shapes fixed by the batch size and the split
workspace and counters allocated here once: it can be captured in a CUDA graph. forward never
syncs with the device; it reads the host copies in the metadata.

The decode rows run as the step's plan lists them (meta.decode_plan, built on the host by
`plan`: kernels/paged_decode_launch.py decode_plan): each context cut into splits of one
length, so that the few long contexts of a mixed batch do not keep the launch waiting on their
one program each. Without a plan (a caller that built none) the launcher's own split heuristic
runs.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.engine.attention.base import AttentionBackend, AttentionMetadata, Rope
from tandem.engine.quantization.kv_cache import KVScales
from tandem.kernels import (
    decode_num_splits,
    decode_workspace_numel,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_block_q,
    rotary_store_kv,
    store_kv,
)
from tandem.kernels._common import num_sms
from tandem.kernels.paged_decode_launch import (
    DEFAULT_SPLIT_POLICY,
    decode_config,
    decode_plan,
    decode_plan_capacity,
)


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, pool: torch.Tensor, num_heads: int, scale: float,
                 kv_scales: KVScales | None = None, max_rows: int = 0) -> None:
        """max_rows: the most decode rows a captured step has (larger eager steps allocate
        their plan's scratch as they run)."""
        super().__init__(pool, num_heads, scale, kv_scales)
        _, _, _, self.block_size, self.num_kv_heads, self.head_dim = pool.shape
        self.num_sms = num_sms(pool.device)
        # Query tokens per prefill work item: the runner lists a step's items (meta.prefill_tiles).
        self.prefill_block_q = prefill_block_q(self.head_dim, num_heads // self.num_kv_heads)
        self.decode_block_n = decode_config(self.head_dim, fp8=kv_scales is not None).block_n
        # The split heuristic only splits while num_seqs * num_kv_heads is below
        # programs_per_sm * SMs, so the split workspace has a small upper bound: size it once
        # for every batch size.
        rows = seqs = 0
        for b in range(1, DEFAULT_SPLIT_POLICY.programs_per_sm * self.num_sms + 1):
            splits = decode_num_splits(b, self.num_kv_heads, 1 << 30, self.num_sms,
                                       self.decode_block_n)
            if splits > 1:
                rows, seqs = max(rows, b * splits), b
        self._workspace_rows = rows  # (sequence, split) pairs
        self._split_seqs = seqs  # sequences the counters cover
        self.plan_block_n = decode_config(self.head_dim).block_n  # plans cut whole tiles
        self.max_rows = max(max_rows, seqs)
        items = max(rows, self.plan_capacity(max_rows))  # split rows, or a plan's items
        self.workspace = torch.empty(decode_workspace_numel(items, num_heads, self.head_dim, 1),
                                     dtype=torch.float32, device=pool.device)
        # One per (sequence, KV head); zero between launches (each split launch resets them).
        self.split_counters = torch.zeros(max(1, self.max_rows) * self.num_kv_heads,
                                          dtype=torch.int32, device=pool.device)

    def plan_capacity(self, rows: int) -> int:
        """Work items a plan for `rows` decode rows can list; 0, no plan, for a single row (no
        contexts to balance: the split heuristic cuts it as evenly, with less to load) and for
        FP8 caches: their unplanned launches keep the register-capped tiles picked by the grid's
        last wave, and a plan bought them 0.5% on 1,000 ShareGPT-like requests (1x H200, FP8
        weights + KV; benchmarks/kernels/decode_plan.py --kv-cache-dtype fp8: 0.59-0.94x the
        attention time at 100-200 mixed contexts, 1.02-1.25x at 4-16)."""
        if rows <= 1 or self.kv_scales is not None:
            return 0
        return decode_plan_capacity(rows, self.num_kv_heads, self.num_sms)

    def plan(self, seq_lens: list[int], capacity: int = 0) -> np.ndarray:
        """The decode rows' plan (int32 [capacity + 1, 2]; capacity 0: exactly its items)."""
        return decode_plan(seq_lens, self.num_kv_heads, self.num_sms, self.plan_block_n,
                           capacity)

    def _plan_scratch(self, rows: int, plan: torch.Tensor
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The preallocated workspace and counters when they fit the launch (always, for the
        captured steps), else None: the launcher allocates for a larger eager step."""
        fits = (rows <= self.max_rows and self.workspace.numel() >= decode_workspace_numel(
            plan.shape[0] - 1, self.num_heads, self.head_dim, 1))
        return (self.workspace, self.split_counters) if fits else (None, None)

    def _num_splits(self, num_seqs: int, max_seq_len: int, block_tables: torch.Tensor,
                    capturing: bool) -> int:
        # A captured graph replays with whatever contexts come later: size the grid for the
        # longest context the block tables can describe (the kernel still cuts a short
        # context into few splits; the others exit at once).
        if num_seqs > self._split_seqs:
            return 1  # beyond the heuristic's bound: it does not split there anyway
        bound = block_tables.shape[1] * self.block_size if capturing else max_seq_len
        splits = decode_num_splits(num_seqs, self.num_kv_heads, bound, self.num_sms,
                                   self.decode_block_n)
        # Never exceed the preallocated workspace.
        while splits > 1 and num_seqs * splits > self._workspace_rows:
            splits -= 1
        return splits

    def warm_up_decode(self, dtype: torch.dtype, splits_upto: int) -> None:
        """Compile the decode kernels' variants (engine/warm_up.py): unsplit, and split into
        each power of two up to `splits_upto` (the split kernel's variant is the split count
        rounded up to one), one sequence of queries in `dtype` on the pool's first block."""
        dev = self.pool.device
        q = torch.zeros(1, self.num_heads, self.head_dim, dtype=dtype, device=dev)
        table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        seq_lens = torch.full((1,), self.block_size, dtype=torch.int32, device=dev)
        k_scale, v_scale = self.kv_scale(0)
        splits = 1
        while splits <= min(splits_upto, self._workspace_rows or 1):
            paged_decode_attention(q, self.k_caches[0], self.v_caches[0], table, seq_lens,
                                   self.scale, num_splits=splits, workspace=self.workspace,
                                   counters=self.split_counters, k_scale=k_scale,
                                   v_scale=v_scale)
            splits *= 2

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, rope: Rope | None = None) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        k_scale, v_scale = self.kv_scale(layer)  # FP8 pool: quantize on store, dequantize on load
        if rope is None:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        else:
            rotary_store_kv(rope.positions, q, k, v, rope.cos_sin_cache, k_cache, v_cache,
                            meta.slot_mapping, k_scale, v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd, ns = meta.num_decodes, meta.num_seqs
        graph_rows = meta.decode_lens is not None  # a mixed-step graph's layout (base.py)
        # The decode kernel's rows: every sequence row of a mixed-step graph (decode_lens, 0
        # for all but the decodes: zeros written, and the prefill kernel then writes the
        # chunks' rows), else the step's decodes.
        rows = meta.decode_lens.shape[0] if graph_rows else nd
        lens = meta.decode_lens if graph_rows else meta.seq_lens[:nd]
        if rows and meta.decode_plan is not None:
            workspace, counters = self._plan_scratch(rows, meta.decode_plan)
            paged_decode_attention(
                q[:rows], k_cache, v_cache, meta.block_tables[:rows], lens, self.scale,
                out=out[:rows], plan=meta.decode_plan, workspace=workspace, counters=counters,
                k_scale=k_scale, v_scale=v_scale)
        elif rows:
            capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
            splits = self._num_splits(rows, meta.max_seq_len, meta.block_tables, capturing)
            # A mixed-step graph's grid covers every row the graph can hold, most of them with
            # no context (their programs exit at once): tiles picked by how full that grid's
            # last wave is would fit programs that do nothing, so it keeps the default tiles.
            config = decode_config(self.head_dim, fp8=k_scale is not None) if graph_rows else None
            paged_decode_attention(
                q[:rows], k_cache, v_cache, meta.block_tables[:rows], lens, self.scale,
                out=out[:rows], num_splits=splits, config=config, workspace=self.workspace,
                counters=self.split_counters, k_scale=k_scale, v_scale=v_scale)
        if graph_rows:  # the prefill kernel over the chunks' work items, rows from 0
            paged_prefill_attention(
                q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                self.scale, meta.max_query_len, out=out, tiles=meta.prefill_tiles,
                k_scale=k_scale, v_scale=v_scale)
        elif nd < ns:
            # Decodes own exactly one token each, so the prefill part starts at token nd.
            paged_prefill_attention(
                q[nd:], k_cache, v_cache, meta.query_start_loc[nd:] - nd, meta.seq_lens[nd:],
                meta.block_tables[nd:], self.scale, max(meta.query_lens_cpu[nd:]), out=out[nd:],
                tiles=meta.prefill_tiles, k_scale=k_scale, v_scale=v_scale)
        return out
