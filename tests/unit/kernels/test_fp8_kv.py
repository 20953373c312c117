"""FP8 (e4m3) KV caches: the store kernels quantize with per-KV-head scales and the attention
kernels dequantize on load, matching their torch references (CPU interpreter at small shapes,
CUDA on a GPU box)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_launch,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    rotary_store_kv,
    rotary_store_kv_ref,
    store_kv,
    store_kv_ref,
)
from tandem.kernels._common import FP8_DTYPE, FP8_MAX, quantize_fp8_ref
from tandem.kernels.paged_decode_launch import DecodeConfig, SplitPolicy

FP8 = FP8_DTYPE


def _scales(num_kv_heads: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uneven per-head scales (not powers of two), so a kernel that drops or misplaces one
    reads values off by a factor."""
    k = torch.rand(num_kv_heads, device=device) * 0.05 + 0.03
    v = torch.rand(num_kv_heads, device=device) * 0.05 + 0.03
    return k, v


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_store_kv_quantizes_like_the_reference(seed, device, num_kv_heads):
    block_size, num_blocks, num_tokens, head_dim = 16, 10, 25, 64
    qkv = torch.randn(num_tokens, (2 + 2 * num_kv_heads) * head_dim, device=device) * 2
    qkv[3, :] *= 100  # beyond FP8_MAX * scale: saturates, on every path alike
    heads = qkv.view(num_tokens, -1, head_dim)
    k, v = heads[:, 2:2 + num_kv_heads], heads[:, 2 + num_kv_heads:]
    perm = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots = torch.where(torch.rand(num_tokens, device=device) < 0.2, -1, perm)
    slots[3] = perm[3]
    k_scale, v_scale = _scales(num_kv_heads, device)
    pool = torch.zeros(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, dtype=FP8,
                       device=device)
    expected = pool.clone()
    store_kv(k, v, pool[:, 1, 0], pool[:, 1, 1], slots, k_scale, v_scale)
    store_kv_ref(k, v, expected[:, 1, 0], expected[:, 1, 1], slots, k_scale, v_scale)
    assert _bytes_equal(pool, expected), f"seed={seed}"
    stored = pool[:, 1, 0].reshape(-1, num_kv_heads, head_dim)[perm[3]].float()
    assert stored.abs().max() == FP8_MAX  # the outlier token saturated
    # Dequantized, the cache holds k within e4m3's rounding (2^-4 relative) of the original.
    keep = (slots >= 0) & (torch.arange(num_tokens, device=device) != 3)
    got = pool[:, 1, 0].reshape(-1, num_kv_heads, head_dim)[slots[keep]].float() * k_scale[:, None]
    torch.testing.assert_close(got, k[keep], rtol=2**-4, atol=k_scale.max().item() * 2**-9)


def test_rotary_store_kv_quantizes_like_the_reference(seed, device):
    num_tokens, hq, hkv, head_dim, block_size = 9, 4, 2, 64, 8
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, device=device)
    qkv_ref = qkv.clone()
    positions = torch.randint(0, 100, (num_tokens,), device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(128, device=device).float(), inv)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    slots = torch.randperm(6 * block_size, device=device)[:num_tokens]
    slots[0] = -1
    k_scale, v_scale = _scales(hkv, device)
    pool = torch.zeros(6, 1, 2, block_size, hkv, head_dim, dtype=FP8, device=device)
    expected = pool.clone()
    for x, cache, fn in ((qkv, pool, rotary_store_kv), (qkv_ref, expected, rotary_store_kv_ref)):
        h = x.view(num_tokens, -1, head_dim)
        fn(positions, h[:, :hq], h[:, hq:hq + hkv], h[:, hq + hkv:], cos_sin, cache[:, 0, 0],
           cache[:, 0, 1], slots, k_scale, v_scale)
    assert _bytes_equal(pool, expected), f"seed={seed}"
    torch.testing.assert_close(qkv, qkv_ref)


def _fp8_context(make_paged_context, lens, num_blocks, block_size, num_kv_heads, head_dim,
                 device):
    """make_paged_context's pool (NaN where no sequence writes) quantized to e4m3 with
    per-head K and V scales."""
    pool, tables, seq_lens = make_paged_context(lens, num_blocks, block_size, 2, 1,
                                                num_kv_heads, head_dim, torch.float32, device)
    k_scale, v_scale = _scales(num_kv_heads, device)
    fp8 = torch.empty(pool.shape, dtype=FP8, device=device)
    fp8[:, :, 0] = quantize_fp8_ref(pool[:, :, 0], k_scale)
    fp8[:, :, 1] = quantize_fp8_ref(pool[:, :, 1], v_scale)
    return fp8, tables, seq_lens, k_scale, v_scale


@pytest.mark.parametrize("dot_f16", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_attention_dequantizes(seed, device, make_paged_context, group, num_splits,
                                      dot_f16):
    """Both ways of reading FP8 tiles: converted to q's dtype, or to fp16 (exact) for 16-bit
    queries (DecodeConfig.fp8_dot_f16, which fp32 queries do not take; the tolerance is then
    fp16's output rounding)."""
    block_size = [8, 16][seed % 2]
    lens, num_kv_heads, head_dim = [150, 37, 1, 0], 2, 64
    pool, tables, seq_lens, k_scale, v_scale = _fp8_context(
        make_paged_context, lens, 48, block_size, num_kv_heads, head_dim, device)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, device=device)
    if dot_f16:
        q = q.half()  # the interpreter runs no bf16 dot; fp16 queries take the same path
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, out=out,
                           num_splits=num_splits, config=DecodeConfig(16, 4, 2, dot_f16),
                           policy=SplitPolicy(min_split_tokens=1), k_scale=k_scale,
                           v_scale=v_scale)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.125, k_scale,
                                     v_scale)
    msg = f"seed={seed} block_size={block_size}"
    tol = dict(atol=1e-2, rtol=1e-2) if dot_f16 else dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.float(), ref.float(), **tol, msg=lambda m: f"{msg}\n{m}")
    assert torch.all(out[-1] == 0), msg
    # The scales matter: the undequantized reference is far off (outputs ~ v / v_scale).
    raw = paged_decode_attention_ref(q, k_cache.float(), v_cache.float(), tables, seq_lens,
                                     0.125)
    assert (raw[:-1] - ref[:-1]).abs().max() > 1.0, msg


@pytest.mark.parametrize("dot_f16", [False, True])
def test_planned_decode_attention_dequantizes(seed, device, make_paged_context, dot_f16,
                                              monkeypatch):
    """A plan's launch over FP8 caches (what the engine's decode steps take): the 150-token
    context cut into 4 items of 48 tokens (3 tiles), merged; the scales applied in every item."""
    monkeypatch.setattr(paged_decode_launch, "PLAN_MIN_SPLIT_TOKENS", 16)
    lens, num_kv_heads, head_dim, block_n = [150, 37, 1, 0], 2, 64, 16
    pool, tables, seq_lens, k_scale, v_scale = _fp8_context(
        make_paged_context, lens, 48, 16, num_kv_heads, head_dim, device)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    q = torch.randn(len(lens), num_kv_heads * 4, head_dim, device=device)
    if dot_f16:
        q = q.half()
    capacity = paged_decode_launch.decode_plan_capacity(len(lens), num_kv_heads, 1)
    plan = paged_decode_launch.decode_plan(lens, num_kv_heads, 1, block_n, capacity)
    assert plan[0].tolist() == [48, 7], plan[0].tolist()  # 4 + 1 + 1 + 1 items
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, out=out,
                           plan=torch.from_numpy(plan).to(device),
                           config=DecodeConfig(block_n, 4, 2, dot_f16), k_scale=k_scale,
                           v_scale=v_scale)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.125, k_scale,
                                     v_scale)
    tol = dict(atol=1e-2, rtol=1e-2) if dot_f16 else dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.float(), ref.float(), **tol,
                               msg=lambda m: f"seed={seed}\n{m}")
    assert torch.all(out[-1] == 0), f"seed={seed}"


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_attention_dequantizes(seed, device, make_paged_context, group):
    qlens, cached = [1, 20, 7], [30, 0, 41]
    lens = [q + c for q, c in zip(qlens, cached, strict=True)]
    num_kv_heads, head_dim = 2, 64
    pool, tables, seq_lens, k_scale, v_scale = _fp8_context(
        make_paged_context, lens, 24, 16, num_kv_heads, head_dim, device)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    qsl = torch.tensor([0, 1, 21, 28], dtype=torch.int32, device=device)
    q = torch.randn(sum(qlens), num_kv_heads * group, head_dim, device=device)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, qsl, seq_lens, tables, 0.125, max(qlens),
                            out=out, k_scale=k_scale, v_scale=v_scale)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, qsl, seq_lens, tables, 0.125,
                                      k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4,
                               msg=lambda m: f"seed={seed}\n{m}")


def test_scales_come_with_fp8_caches_only(device):
    q = torch.randn(1, 2, 64, device=device)
    fp8 = torch.zeros(2, 8, 2, 64, dtype=FP8, device=device)
    f32 = torch.zeros(2, 8, 2, 64, device=device)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    ones = torch.ones(2, device=device)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(q, fp8, fp8, tables, lens, 1.0)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(q, f32, f32, tables, lens, 1.0, k_scale=ones, v_scale=ones)
    with pytest.raises(ValueError, match=r"v_scale must be contiguous fp32 \[2\]"):
        paged_decode_attention(q, fp8, fp8, tables, lens, 1.0, k_scale=ones,
                               v_scale=torch.ones(3, device=device))
    k = torch.randn(1, 2, 64, device=device)
    with pytest.raises(ValueError, match="v_scale"):
        store_kv(k, k, fp8, fp8, torch.zeros(1, dtype=torch.int64, device=device), ones)


@pytest.mark.parametrize("rope", [False, True], ids=["no-rope", "rope"])
def test_triton_backend_matches_torch_backend_on_an_fp8_pool(seed, device, monkeypatch, rope):
    """One mixed step (2 decodes, 2 prefill chunks, one over cached context) on both backends
    with an FP8 pool and uneven per-(layer, KV head) scales: the same bytes stored, the same
    attention out. With rope the two rotate k with different fp32 arithmetic, so a stored
    element may land one e4m3 step apart."""
    from paged_meta import step_metadata
    from tandem.engine.attention.torch_backend import TorchAttentionBackend
    from tandem.engine.attention.triton_backend import TritonAttentionBackend
    from tandem.engine.config import RopeScaling
    from tandem.engine.models.layers import RotaryEmbedding
    from tandem.engine.quantization.kv_cache import KVScales

    monkeypatch.setattr("tandem.engine.attention.triton_backend.num_sms", lambda _: 128)  # split-KV
    num_layers, block_size, hkv, head_dim, num_heads = 2, 16, 2, 64, 8
    query_lens, cached = [1, 1, 13, 6], [290, 40, 0, 25]
    seq_lens = [q + c for q, c in zip(query_lens, cached, strict=True)]
    perm = torch.randperm(64).tolist()
    tables = torch.zeros(4, 19, dtype=torch.int32)
    for b, s in enumerate(seq_lens):
        n = -(s // -block_size)
        tables[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    meta = step_metadata(query_lens, seq_lens, tables, block_size, device)
    scales = KVScales(torch.rand(num_layers, hkv, device=device) * 0.05 + 0.03,
                      torch.rand(num_layers, hkv, device=device) * 0.05 + 0.03)
    pool = quantize_fp8_ref(torch.randn(64, num_layers, 2, block_size, hkv, head_dim,
                                        device=device), torch.full((hkv,), 0.04, device=device))
    pools = [pool.clone(), pool.clone()]
    backends = [TritonAttentionBackend(pools[0], num_heads, head_dim ** -0.5, scales),
                TorchAttentionBackend(pools[1], num_heads, head_dim ** -0.5, scales)]
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens,
                                                                   strict=True)]).to(device)
    rotary = RotaryEmbedding(head_dim, 1024, 10000.0, RopeScaling()).to(device)
    for layer in range(num_layers):
        qkv = torch.randn(sum(query_lens), (num_heads + 2 * hkv) * head_dim, device=device)
        outs = []
        for be in backends:
            h = qkv.clone().view(qkv.shape[0], -1, head_dim)
            outs.append(be.forward(layer, h[:, :num_heads], h[:, num_heads:num_heads + hkv],
                                   h[:, num_heads + hkv:], meta,
                                   rotary(positions) if rope else None))
        msg = f"seed={seed} layer={layer}"
        if rope:
            torch.testing.assert_close(outs[0], outs[1], atol=1e-3, rtol=1e-3,
                                       msg=lambda m, msg=msg: f"{msg}\n{m}")
        else:
            torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4,
                                       msg=lambda m, msg=msg: f"{msg}\n{m}")
    a, b = (p.view(torch.uint8) for p in pools)
    differ = (a != b).float().mean().item()
    assert differ == 0 if not rope else differ < 1e-3, f"seed={seed}: {differ:.2%} differ"
    assert not _bytes_equal(pools[0], pool), "nothing was stored"
