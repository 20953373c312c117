"""Attention metadata for hand-built steps in the attention backend tests (CPU interpreter and
GPU): token slots, query offsets and the decode count, from per-sequence lengths and tables."""

from __future__ import annotations

import torch

from tandem.engine.attention.base import AttentionMetadata


def step_metadata(query_lens: list[int], seq_lens: list[int], tables: torch.Tensor,
                  block_size: int, device: torch.device | str) -> AttentionMetadata:
    """The last query_lens[b] of seq_lens[b] tokens of sequence b are new this step; a sequence
    with seq_len 0 is CUDA-graph padding (its token's slot is -1). The leading one-token
    sequences count as decodes."""
    tables_cpu = tables.cpu()
    slots: list[int] = []
    for b, (qlen, slen) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if slen == 0:
            slots += [-1] * qlen
            continue
        for pos in range(slen - qlen, slen):
            slots.append(int(tables_cpu[b, pos // block_size]) * block_size + pos % block_size)
    qsl = [0]
    for qlen in query_lens:
        qsl.append(qsl[-1] + qlen)
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), num_decodes=num_decodes,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
