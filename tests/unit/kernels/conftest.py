"""Fixtures for the kernel tests: the device the kernels run on (CPU under TRITON_INTERPRET=1,
else CUDA) and a paged context to attend over. The per-test `seed` is tests/conftest.py's."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels._common import INTERPRET


@pytest.fixture
def device() -> torch.device:
    if INTERPRET or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


@pytest.fixture
def make_paged_context():  # type: ignore[no-untyped-def]
    return paged_context


def paged_context(seq_lens: list[int], num_blocks: int, block_size: int, num_layers: int,
                  layer: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A NaN-filled block-major pool [N, L, 2, bs, Hkv, D] whose layer `layer` holds random K/V
    for each sequence's first seq_len tokens, in blocks taken from a random permutation.
    Unused block-table entries point at a block nobody owns (all NaN), so a kernel that reads
    past a context, or forgets a mask, produces NaN. Returns (pool, block_tables, seq_lens)."""
    max_blocks = max(1, max(-(s // -block_size) for s in seq_lens))
    needed = sum(-(s // -block_size) for s in seq_lens)
    assert needed + 1 <= num_blocks, "pool too small"
    pool = torch.full((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim),
                      float("nan"), dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    poison_block = perm[-1]
    tables = poison_block.repeat(len(seq_lens), max_blocks)
    used = 0
    for b, seq_len in enumerate(seq_lens):
        n = -(seq_len // -block_size)
        tables[b, :n] = perm[used:used + n]
        used += n
        for i in range(n):
            fill = min(block_size, seq_len - i * block_size)
            pool[tables[b, i].item(), layer, :, :fill] = torch.randn(
                2, fill, num_kv_heads, head_dim, dtype=dtype, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return pool, tables.contiguous(), lens
