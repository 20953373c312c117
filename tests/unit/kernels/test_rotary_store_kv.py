from __future__ import annotations

import pytest
import torch

from tandem.kernels import (
    rotary_embedding,
    rotary_store_kv,
    rotary_store_kv_ref,
    store_kv,
)


def _cos_sin_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class Step:
    """One step's inputs: a fused qkv projection (q, k, v are strided views of it), positions,
    scattered slots (some -1) and a NaN-filled block-major pool with 3 layers."""

    def __init__(self, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 rotary_dim: int, block_size: int, num_blocks: int, device: torch.device,
                 cache_dtype: torch.dtype = torch.float32,
                 pos_dtype: torch.dtype = torch.int64) -> None:
        self.shape = (num_tokens, num_q_heads, num_kv_heads, head_dim)
        self.qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim,
                               device=device)
        self.positions = torch.randint(0, 500, (num_tokens,), device=device).to(pos_dtype)
        self.cache = _cos_sin_cache(512, rotary_dim).to(device)
        self.slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
        self.slots[torch.rand(num_tokens, device=device) < 0.25] = -1
        self.pool = torch.full((num_blocks, 3, 2, block_size, num_kv_heads, head_dim),
                               float("nan"), dtype=cache_dtype, device=device)

    def clone(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.qkv.clone(), self.pool.clone()

    def args(self, qkv: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping) over layer 1."""
        t, hq, hkv, d = self.shape
        heads = qkv.view(t, -1, d)
        q, k, v = heads[:, :hq], heads[:, hq:hq + hkv], heads[:, hq + hkv:]
        return self.positions, q, k, v, self.cache, pool[:, 1, 0], pool[:, 1, 1], self.slots


def _assert_pools_equal(got: torch.Tensor, expected: torch.Tensor, msg: str) -> None:
    assert torch.equal(got.isnan(), expected.isnan()), f"{msg}: written slots differ"
    assert torch.equal(got.nan_to_num(), expected.nan_to_num()), f"{msg}: values differ"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_matches_reference_and_the_two_kernels(seed, device, group, head_dim):
    num_kv_heads = [1, 2, 3][seed % 3]
    step = Step(11, group * num_kv_heads, num_kv_heads, head_dim, head_dim, [8, 16][seed % 2],
                12, device, pos_dtype=[torch.int32, torch.int64][seed % 2])
    msg = f"seed={seed} num_kv_heads={num_kv_heads}"
    fused_qkv, fused_pool = step.clone()
    ref_qkv, ref_pool = step.clone()
    two_qkv, two_pool = step.clone()

    assert rotary_store_kv(*step.args(fused_qkv, fused_pool)) is None
    rotary_store_kv_ref(*step.args(ref_qkv, ref_pool))
    pos, q, k, v, cache, kc, vc, slots = step.args(two_qkv, two_pool)
    rotary_embedding(pos, q, k, cache)
    store_kv(k, v, kc, vc, slots)

    torch.testing.assert_close(fused_qkv, ref_qkv, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{msg}\n{m}")
    torch.testing.assert_close(fused_pool.nan_to_num(), ref_pool.nan_to_num(), atol=1e-5,
                               rtol=1e-5, msg=lambda m: f"{msg}\n{m}")
    # Same arithmetic as rotary_embedding then store_kv: bit for bit.
    assert torch.equal(fused_qkv, two_qkv), msg
    _assert_pools_equal(fused_pool, two_pool, msg)
    # Only layer 1's slots of non-padding tokens were written (K and V), and V is untouched.
    live = int((step.slots >= 0).sum())
    assert (~fused_pool.isnan()).sum() == 2 * live * num_kv_heads * head_dim, msg
    v_cols = slice(-num_kv_heads * head_dim, None)
    assert torch.equal(fused_qkv[:, v_cols], step.qkv[:, v_cols]), msg


def test_partial_rotary_dim_stores_the_unrotated_tail(seed, device):
    step = Step(9, 4, 2, 64, 32, 8, 8, device)
    fused_qkv, fused_pool = step.clone()
    ref_qkv, ref_pool = step.clone()
    rotary_store_kv(*step.args(fused_qkv, fused_pool))
    rotary_store_kv_ref(*step.args(ref_qkv, ref_pool))
    torch.testing.assert_close(fused_qkv, ref_qkv, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed={seed}\n{m}")
    _assert_pools_equal(fused_pool, ref_pool, f"seed={seed}")


def test_converts_to_the_cache_dtype(seed, device):
    step = Step(7, 8, 2, 64, 64, 16, 4, device, cache_dtype=torch.float16)
    fused_qkv, fused_pool = step.clone()
    ref_qkv, ref_pool = step.clone()
    rotary_store_kv(*step.args(fused_qkv, fused_pool))
    rotary_store_kv_ref(*step.args(ref_qkv, ref_pool))
    _assert_pools_equal(fused_pool, ref_pool, f"seed={seed}")


def test_padding_tokens_rotate_but_store_nothing(seed, device):
    step = Step(5, 4, 2, 64, 64, 8, 4, device)
    step.slots.fill_(-1)
    fused_qkv, fused_pool = step.clone()
    ref_qkv, _ = step.clone()
    rotary_store_kv(*step.args(fused_qkv, fused_pool))
    rotary_embedding(*step.args(ref_qkv, fused_pool.clone())[:3], step.cache)
    assert torch.isnan(fused_pool).all(), f"seed={seed}"
    assert torch.equal(fused_qkv, ref_qkv), f"seed={seed}"


def test_rejects_bad_arguments(device):
    step = Step(3, 4, 2, 64, 64, 8, 4, device)
    pos, q, k, v, cache, kc, vc, slots = step.args(*step.clone())
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_store_kv(pos, q, k, v, cache, kc, vc, slots.int())
    with pytest.raises(ValueError, match="positions"):
        rotary_store_kv(pos[:2], q, k, v, cache, kc, vc, slots)
    with pytest.raises(ValueError, match="caches"):
        rotary_store_kv(pos, q, k, v, cache, kc[..., :32], vc[..., :32], slots)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_store_kv(pos, q, k, v, cache.double(), kc, vc, slots)
