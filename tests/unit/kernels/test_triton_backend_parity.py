"""TritonAttentionBackend against TorchAttentionBackend on the same steps."""

from __future__ import annotations

import pytest
import torch

from paged_meta import step_metadata
from tandem.engine.attention.base import AttentionMetadata, Rope, forward_context
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.attention.triton_backend import TritonAttentionBackend
from tandem.engine.config import ModelConfig, RopeScaling
from tandem.engine.models.layers import Attention, AttentionOptions, RotaryEmbedding


def _step(query_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int,
          device: torch.device) -> AttentionMetadata:
    """Metadata for one step; each sequence's blocks are drawn from a random permutation.
    A sequence with seq_len 0 is CUDA-graph padding: its token's slot is -1."""
    max_blocks = max(1, max(-(s // -block_size) for s in seq_lens))
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for b, slen in enumerate(seq_lens):
        n = -(slen // -block_size)
        tables[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return step_metadata(query_lens, seq_lens, tables, block_size, device)


@pytest.mark.parametrize(
    ("query_lens", "cached"),
    [
        # 3 decodes, then chunks: a fresh prompt, one over cached context, a 1-token chunk.
        ([1, 1, 1, 23, 17, 1], [40, 7, 90, 0, 35, 12]),
        # all decodes, one padding row (seq_len 0)
        ([1, 1, 1, 1], [300, 3, 530, -1]),
        # prefill only
        ([30, 9], [0, 50]),
    ],
    ids=["mixed", "decode", "prefill"])
# The engine always hands the rope over; without it the backend stores q/k/v as given.
@pytest.mark.parametrize(("group", "rope"), [(1, True), (4, True), (4, False)],
                         ids=["1-rope", "4-rope", "4-no-rope"])
@pytest.mark.parametrize("sms", [1, 128], ids=["no-split", "split"])
def test_matches_torch_backend(seed, device, monkeypatch, query_lens, cached, group, sms, rope):
    # With many SMs for few (sequence, KV head) pairs the decode part takes the split-KV path.
    monkeypatch.setattr("tandem.engine.attention.triton_backend.num_sms", lambda _: sms)
    num_layers, block_size, num_kv_heads, head_dim = 2, 16, 2, 64
    num_heads = group * num_kv_heads
    seq_lens = [0 if c < 0 else c + q for q, c in zip(query_lens, cached, strict=True)]
    meta = _step(query_lens, seq_lens, block_size, 64, device)
    pool = torch.randn(64, num_layers, 2, block_size, num_kv_heads, head_dim, device=device)
    torch_pool = pool.clone()
    scale = head_dim ** -0.5
    triton_be = TritonAttentionBackend(pool, num_heads, scale)
    torch_be = TorchAttentionBackend(torch_pool, num_heads, scale)
    num_decodes = meta.num_decodes
    splits = triton_be._num_splits(num_decodes, meta.max_seq_len, meta.block_tables, False)
    assert (splits > 1) == (sms > 1 and num_decodes > 0 and meta.max_seq_len > 256), splits

    num_tokens = sum(query_lens)
    # (A padding row, seq_len 0, sits at position 0 as in the CUDA-graph runner.)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens,
                                                                   strict=True)]).clamp(min=0)
    positions = positions.to(device)
    rotary = RotaryEmbedding(head_dim, 1024, 10000.0, RopeScaling()).to(device)
    for layer in range(num_layers):
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device)
        qkv_ref = qkv.clone()
        got = triton_be.forward(layer, *_split_heads(qkv, num_heads, num_kv_heads), meta,
                                rotary(positions) if rope else None)
        ref = torch_be.forward(layer, *_split_heads(qkv_ref, num_heads, num_kv_heads), meta,
                               rotary(positions) if rope else None)
        msg = f"seed={seed} layer={layer} query_lens={query_lens} seq_lens={seq_lens}"
        live = torch.tensor(seq_lens, device=device).repeat_interleave(
            torch.tensor(query_lens, device=device)) > 0  # the torch backend's padding rows
        torch.testing.assert_close(got[live], ref[live], atol=2e-5, rtol=1e-4,
                                   msg=lambda m, msg=msg: f"{msg}\n{m}")
        assert not got.isnan().any(), msg
        # q and k rotated in place alike (or left alone without rope).
        torch.testing.assert_close(qkv, qkv_ref, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, msg=msg: f"{msg}\n{m}")
    torch.testing.assert_close(pool, torch_pool, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed={seed}: the pools differ after the store\n{m}")


def _split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads = qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, -1)
    return heads[:, :num_heads], heads[:, num_heads:-num_kv_heads], heads[:, -num_kv_heads:]


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-qk-norm"])
def test_attention_layer_same_on_both_backends(seed, device, monkeypatch, qk_norm):
    """The model's Attention layer hands its rotary embedding to the backend: the Triton
    backend's fused rotary + store gives the torch backend's output and pool."""
    monkeypatch.setattr("tandem.engine.attention.triton_backend.num_sms", lambda _: 128)
    cfg = ModelConfig(
        architecture="Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM", vocab_size=64,
        hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=RopeScaling(),
        max_position_embeddings=1024, tie_word_embeddings=False, attention_bias=False,
        eos_token_ids=(0,), bos_token_id=None)
    layer = Attention(cfg, 0, AttentionOptions(qk_norm=qk_norm)).to(device)
    for p in layer.parameters():
        p.data.normal_(0, 0.1)
    query_lens, cached = [1, 1, 9], [300, 20, 30]
    seq_lens = [c + q for q, c in zip(query_lens, cached, strict=True)]
    meta = _step(query_lens, seq_lens, 16, 48, device)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens,
                                                                   strict=True)]).to(device)
    x = torch.randn(sum(query_lens), cfg.hidden_size, device=device)
    pool = torch.randn(48, 1, 2, 16, 2, 64, device=device)
    outs, pools = [], []
    for backend_cls in (TritonAttentionBackend, TorchAttentionBackend):
        p = pool.clone()
        with forward_context(backend_cls(p, cfg.num_heads, cfg.head_dim ** -0.5), meta):
            outs.append(layer(positions, x))
        pools.append(p)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4,
                               msg=lambda m: f"seed={seed}\n{m}")
    torch.testing.assert_close(pools[0], pools[1], atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed={seed}\n{m}")
    assert not torch.equal(pools[0], pool), "nothing was stored"


def test_rope_is_a_named_tuple():
    rope = RotaryEmbedding(64, 16, 10000.0, RopeScaling())(torch.arange(3))
    assert isinstance(rope, Rope) and rope.cos_sin_cache.shape == (16, 64)
