"""The small Triton kernels against their torch references on a GPU, at real model shapes in
bfloat16: store_kv, rms_norm (with and without the residual), rotary_embedding, the fused
rotary_store_kv (also against the two kernels it fuses), silu_and_mul and copy_blocks.

Run on a CUDA box:  pytest -m gpu tests/gpu/test_small_kernels_gpu.py -v
Tolerance and seeds: tests/gpu_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
from gpu_kernels import BF16, DEV, ON_GPU, TOL, capture, rel_err, rope_cache

pytestmark = ON_GPU

if torch.cuda.is_available():
    from tandem.kernels import (
        copy_blocks,
        copy_blocks_ref,
        rms_norm,
        rms_norm_ref,
        rotary_embedding,
        rotary_embedding_ref,
        rotary_store_kv,
        rotary_store_kv_ref,
        silu_and_mul,
        silu_and_mul_ref,
        store_kv,
        store_kv_ref,
    )


def test_store_kv(seed):
    num_tokens, hq, hkv, d = 1000, 32, 8, 128
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, dtype=BF16, device=DEV)
    heads = qkv.view(num_tokens, -1, d)
    k, v = heads[:, hq:hq + hkv], heads[:, hq + hkv:]
    pool = torch.zeros(200, 3, 2, 16, hkv, d, dtype=BF16, device=DEV)
    slots = torch.randperm(200 * 16, device=DEV)[:num_tokens]
    slots[::7] = -1
    expected = pool.clone()
    store_kv(k, v, pool[:, 1, 0], pool[:, 1, 1], slots)
    store_kv_ref(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    assert torch.equal(pool, expected), f"seed={seed}"


@pytest.mark.parametrize("hidden", [4096, 5120, 8192])
def test_rms_norm(seed, hidden):
    x = torch.randn(512, hidden, dtype=BF16, device=DEV)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=BF16, device=DEV)
    err = rel_err(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    assert err < TOL, f"seed={seed} rel err {err:.2e}"
    got, ref = rms_norm(x, weight, 1e-5, residual), rms_norm_ref(x, weight, 1e-5, residual)
    assert rel_err(got.out, ref.out) < TOL, f"seed={seed}"
    assert rel_err(got.residual, ref.residual) < 1e-3, f"seed={seed}"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotary_embedding(seed, head_dim):
    num_tokens, hq, hkv = 777, 32, 8
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, dtype=BF16, device=DEV)
    expected = qkv.clone()
    cache = rope_cache(head_dim, 131072)
    positions = torch.randint(0, 131072, (num_tokens,), device=DEV)

    def views(t):  # type: ignore[no-untyped-def]
        h = t.view(num_tokens, -1, head_dim)
        return h[:, :hq], h[:, hq:hq + hkv]

    rotary_embedding(positions, *views(qkv), cache)
    rotary_embedding_ref(positions, *views(expected), cache)
    err = rel_err(qkv, expected)
    assert err < TOL, f"seed={seed} rel err {err:.2e}"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotary_store_kv(seed, head_dim):
    """The fused kernel against its reference and against rotary_embedding + store_kv."""
    num_tokens, hq, hkv = 777, 32, 8
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, dtype=BF16, device=DEV)
    pool = torch.full((64, 3, 2, 16, hkv, head_dim), float("nan"), dtype=BF16, device=DEV)
    cache = rope_cache(head_dim, 131072)
    positions = torch.randint(0, 131072, (num_tokens,), device=DEV)
    slots = torch.randperm(64 * 16, device=DEV)[:num_tokens]
    slots[::5] = -1

    def run(fn):  # type: ignore[no-untyped-def]
        x, p = qkv.clone(), pool.clone()
        h = x.view(num_tokens, -1, head_dim)
        fn(positions, h[:, :hq], h[:, hq:hq + hkv], h[:, hq + hkv:], cache, p[:, 1, 0],
           p[:, 1, 1], slots)
        return x, p

    def two_kernels(pos, q, k, v, cos_sin, kc, vc, slot_mapping):  # type: ignore[no-untyped-def]
        rotary_embedding(pos, q, k, cos_sin)
        store_kv(k, v, kc, vc, slot_mapping)

    fused, ref, two = run(rotary_store_kv), run(rotary_store_kv_ref), run(two_kernels)
    for name, (x, p) in (("reference", ref), ("two kernels", two)):
        assert rel_err(fused[0], x) < TOL, f"seed={seed} qkv vs {name}"
        assert torch.equal(fused[1].isnan(), p.isnan()), f"seed={seed} slots vs {name}"
        err = rel_err(fused[1].nan_to_num(), p.nan_to_num())
        assert err < TOL, f"seed={seed} pool vs {name}: rel err {err:.2e}"


def test_silu_and_mul(seed):
    x = torch.randn(1000, 2 * 14336, dtype=BF16, device=DEV)
    err = rel_err(silu_and_mul(x), silu_and_mul_ref(x))
    assert err < TOL, f"seed={seed} rel err {err:.2e}"


def test_copy_blocks_8b_pool(seed):
    """128 blocks of an 8B-shaped pool (32 layers, 8 KV heads, D 128, bs 16: 2 MiB a block)."""
    shape = (32, 2, 16, 8, 128)
    src = torch.randn(300, *shape, dtype=BF16, device=DEV)
    dst = torch.zeros(300, *shape, dtype=BF16, device=DEV)
    src_ids = torch.randperm(300, device=DEV)[:128].to(torch.int32)
    dst_ids = torch.randperm(300, device=DEV)[:128]
    expected = dst.clone()
    copy_blocks(src, dst, src_ids, dst_ids)
    copy_blocks_ref(src, expected, src_ids, dst_ids)
    assert torch.equal(dst, expected), f"seed={seed}"
    # copy-on-write within one pool
    copy_blocks(dst, dst, dst_ids[:64], dst_ids[64:])
    assert torch.equal(dst[dst_ids[64:]], expected[dst_ids[:64]]), f"seed={seed}"


@pytest.mark.parametrize("rows", [1, 136, 488])
def test_float_logits_from_the_gemm(seed, rows):
    """A bf16 LM head writes float32 logits from its GEMM (engine/models/layers.py float_logits),
    eagerly and into a CUDA graph's buffer: the half-precision product converted afterwards,
    less its rounding; greedy picks differ only where that rounding tied or swapped two logits."""
    from tandem.engine.models.layers import float_logits

    head = torch.nn.Linear(4096, 128256, bias=False, dtype=BF16, device=DEV)
    hidden = torch.randn(rows, 4096, dtype=BF16, device=DEV)
    ref = torch.nn.functional.linear(hidden.float(), head.weight.float())
    eager = float_logits(head, hidden)
    assert eager.dtype == torch.float32 and eager.shape == (rows, 128256)
    assert rel_err(eager, ref) < 1e-3, f"seed={seed}"
    # the old path's error, for scale: the product rounded to bf16
    assert rel_err(eager, ref) <= rel_err(head(hidden).float(), ref), f"seed={seed}"
    buf = torch.full((512, 128256), float("nan"), device=DEV)
    graph, _ = capture(lambda: float_logits(head, hidden, out=buf[:rows]))
    buf[:rows].fill_(float("nan"))
    graph.replay()
    assert rel_err(buf[:rows], eager) < 1e-5, f"seed={seed}"  # (the GEMM may differ captured)
    assert buf[rows:].isnan().all()
