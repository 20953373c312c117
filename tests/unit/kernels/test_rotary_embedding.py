from __future__ import annotations

import pytest
import torch

from tandem.kernels import rotary_embedding, rotary_embedding_ref


def _cos_sin_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_matches_reference(seed, device, group, head_dim):
    num_tokens, num_kv_heads = 9, 2
    num_q_heads = group * num_kv_heads
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, device=device)
    positions = torch.randint(0, 500, (num_tokens,), device=device)
    cache = _cos_sin_cache(512, head_dim).to(device)
    expected = qkv.clone()

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads = t.view(num_tokens, -1, head_dim)
        return heads[:, :num_q_heads], heads[:, num_q_heads:num_q_heads + num_kv_heads]

    assert rotary_embedding(positions, *views(qkv), cache) is None
    rotary_embedding_ref(positions, *views(expected), cache)
    torch.testing.assert_close(qkv, expected, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed={seed}\n{m}")
    # V (the last heads) is untouched.
    assert torch.equal(qkv[:, -num_kv_heads * head_dim:], expected[:, -num_kv_heads * head_dim:])


def test_reference_is_hf_neox_rotation(seed):
    """Against transformers' apply_rotary_pos_emb (rotate_half), in float32."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(6, 4, 64), torch.randn(6, 2, 64)
    positions = torch.randint(0, 100, (6,))
    cache = _cos_sin_cache(128, 64)
    half = cache[positions]
    cos = torch.cat([half[:, :32], half[:, :32]], -1)
    sin = torch.cat([half[:, 32:], half[:, 32:]], -1)
    # transformers' layout: [batch, heads, seq, D] with cos/sin [batch, seq, D].
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None],
                                  sin[None])
    rotary_embedding_ref(positions, q, k, cache)
    torch.testing.assert_close(q, hq[0].transpose(0, 1), msg=lambda m: f"seed={seed}\n{m}")
    torch.testing.assert_close(k, hk[0].transpose(0, 1), msg=lambda m: f"seed={seed}\n{m}")


def test_partial_rotary_dim(seed, device):
    q, k = torch.randn(3, 4, 64, device=device), torch.randn(3, 2, 64, device=device)
    q0, k0 = q.clone(), k.clone()
    positions = torch.tensor([0, 7, 300], dtype=torch.int32, device=device)
    cache = _cos_sin_cache(512, 32).to(device)
    rotary_embedding(positions, q, k, cache)
    rotary_embedding_ref(positions, q0, k0, cache)
    torch.testing.assert_close(q, q0, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed={seed}\n{m}")
    torch.testing.assert_close(k, k0, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed={seed}\n{m}")
