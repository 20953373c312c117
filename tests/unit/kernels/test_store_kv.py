from __future__ import annotations

import pytest
import torch

from tandem.kernels import store_kv, store_kv_ref


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 3])
def test_matches_reference(seed, device, num_kv_heads, head_dim):
    block_size, num_blocks, num_tokens, num_q_heads = [8, 16][seed % 2], 12, 30, 4
    # k, v are strided views of a fused qkv projection, as the model produces them.
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, device=device)
    heads = qkv.view(num_tokens, -1, head_dim)
    k = heads[:, num_q_heads:num_q_heads + num_kv_heads]
    v = heads[:, num_q_heads + num_kv_heads:]
    # Distinct slots scattered over the pool; some tokens are padding (-1).
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[torch.rand(num_tokens, device=device) < 0.2] = -1
    pool = torch.full((num_blocks, 3, 2, block_size, num_kv_heads, head_dim), float("nan"),
                      device=device)
    expected = pool.clone()
    store_kv(k, v, pool[:, 1, 0], pool[:, 1, 1], slots)
    store_kv_ref(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    # Untouched slots (other layers, unused or padding slots) stay NaN on both sides.
    assert torch.equal(pool.isnan(), expected.isnan()), f"seed={seed}"
    assert torch.equal(pool.nan_to_num(), expected.nan_to_num()), f"seed={seed}"
    assert (~pool[:, 1].isnan()).sum() == 2 * (slots >= 0).sum() * num_kv_heads * head_dim


def test_all_padding_writes_nothing(device):
    pool = torch.zeros(2, 1, 2, 8, 2, 64, device=device)
    k = torch.randn(3, 2, 64, device=device)
    store_kv(k, k, pool[:, 0, 0], pool[:, 0, 1], torch.full((3,), -1, device=device))
    assert torch.all(pool == 0)


def test_rejects_int32_slots(device):
    pool = torch.zeros(2, 1, 2, 8, 2, 64, device=device)
    k = torch.randn(3, 2, 64, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, pool[:, 0, 0], pool[:, 0, 1], torch.zeros(3, dtype=torch.int32))
