"""What the kernel tests on a GPU share: their marks (gpu; skipped without a CUDA device), bf16
inputs at real model shapes (a scattered paged pool, a rope cache), the norm-based error they are
judged by, and CUDA-graph capture. Importable without a GPU (nothing here touches the device until
called).

Errors are norm-based: ||out - ref|| / ||ref|| < TOL (references compute in fp32). Seeds are
fresh per test and printed on failure; TANDEM_TEST_SEED replays one (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

ON_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
BF16 = torch.bfloat16
TOL = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def make_pool(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
              num_layers: int = 2, layer: int = 1, spare: int = 8,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random bf16 block-major pool [N, L, 2, bs, Hkv, D], per-sequence block tables drawn
    from a random permutation (unused entries point at the last, unowned block), and int32
    seq_lens. Layer `layer` is the one attended."""
    blocks = [-(s // -block_size) for s in seq_lens]
    num_blocks = sum(blocks) + spare
    pool = torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim,
                       dtype=BF16, device=DEV)
    perm = torch.randperm(num_blocks - 1, device=DEV).to(torch.int32)
    tables = torch.full((len(seq_lens), max(1, max(blocks))), num_blocks - 1,
                        dtype=torch.int32, device=DEV)
    used = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[used:used + n]
        used += n
    return pool, tables, torch.tensor(seq_lens, dtype=torch.int32, device=DEV)


def rope_cache(head_dim: int, max_pos: int, theta: float = 500000.0) -> torch.Tensor:
    """fp32 [max_pos, head_dim]: cos | sin halves, as RotaryEmbedding builds it."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim)
    freqs = torch.outer(torch.arange(max_pos, device=DEV).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], -1)


def capture(fn):  # type: ignore[no-untyped-def]
    """Warm fn up on a side stream (Triton compiles there), then capture it in a CUDA graph.
    Returns (graph, what fn returned during capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result
