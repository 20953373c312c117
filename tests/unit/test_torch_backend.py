"""The CPU backend's batched decode path equals its one-sequence-at-a-time path, and a lagging
stream's outputs merge per sample without losing or reordering tokens."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.attention.torch_backend import paged_attention_torch, paged_decode_torch


@pytest.mark.parametrize("gqa", [1, 4])
def test_batched_decode_equals_per_sequence(gqa):
    rng = random.Random()
    seed = rng.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    num_blocks, bs, hkv, d = 64, 8, 2, 32
    pool = torch.randn(num_blocks, 3, 2, bs, hkv, d, generator=g)  # layer 1 is a strided view
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    lens = [rng.randint(1, 60) for _ in range(5)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), 8, dtype=torch.int32)
    for i, n in enumerate(lens):
        nb = -(n // -bs)
        tables[i, :nb] = torch.tensor(perm[i * 8:i * 8 + nb])
    q = torch.randn(len(lens), hkv * gqa, d, generator=g)
    ref = paged_attention_torch(q, k_cache, v_cache, tables, [1] * len(lens), lens, 0.2)
    got = paged_decode_torch(q, k_cache, v_cache, tables, torch.tensor(lens), max(lens), 0.2)
    torch.testing.assert_close(got, ref, msg=f"seed {seed}")
