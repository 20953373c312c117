"""Every Triton kernel against its torch reference on a GPU, at real model shapes in bfloat16
(Llama-3.1-8B attention: 32 query heads, 8 KV heads, head dim 128; also head dims 64 and 256),
and the attention backend's decode step captured in a CUDA graph and replayed.

Run on a CUDA box:  pytest -m gpu tests/gpu/test_kernels_gpu.py -v
Errors are norm-based: ||out - ref|| / ||ref|| < 1e-2 (references compute in fp32).
Seeds are fresh per test and printed on failure; TANDEM_TEST_SEED replays one.
"""

from __future__ import annotations

import os
import secrets

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

if torch.cuda.is_available():
    from engine.attention.base import AttentionMetadata, Rope
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.attention.triton_backend import TritonAttentionBackend
    from kernels import (
        SplitPolicy,
        copy_blocks,
        copy_blocks_ref,
        decode_num_splits,
        decode_workspace_numel,
        paged_decode_attention,
        paged_decode_attention_ref,
        paged_prefill_attention,
        paged_prefill_attention_ref,
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
    from kernels._common import num_sms
    from paged_meta import step_metadata

DEV = torch.device("cuda")
BF16 = torch.bfloat16
TOL = 1e-2


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("TANDEM_TEST_SEED") or secrets.randbits(31))
    torch.manual_seed(value)
    return value


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


# ----------------------------------------------------------------------------- decode

@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"),
    [(32, 8, 128), (32, 8, 64), (16, 8, 256), (32, 32, 128)],
    ids=["llama8b", "d64", "d256", "mha"])
@pytest.mark.parametrize("num_splits", [None, 1, 8], ids=["auto", "nosplit", "split8"])
def test_decode(seed, num_q_heads, num_kv_heads, head_dim, num_splits):
    lens = torch.randint(1, 4096, (16,)).tolist()
    lens[0], lens[1] = 0, 4096  # a padding row and a full one
    pool, tables, seq_lens = make_pool(lens, 16, num_kv_heads, head_dim)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    q = torch.randn(len(lens), num_q_heads, head_dim, dtype=BF16, device=DEV)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, out=out,
                           num_splits=num_splits, max_seq_len=max(lens))
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, scale)
    err = rel_err(out, ref)
    assert err < TOL, f"seed={seed} rel err {err:.2e}"
    assert torch.all(out[0] == 0), f"seed={seed}: padding row"


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_decode_32k_context(seed, block_size):
    lens = [32768, 1000, 32000]
    pool, tables, seq_lens = make_pool(lens, block_size, 8, 128)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    q = torch.randn(len(lens), 32, 128, dtype=BF16, device=DEV)
    out = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5,
                                 max_seq_len=32768)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5)
    err = rel_err(out, ref)
    assert err < TOL, f"seed={seed} block_size={block_size} rel err {err:.2e}"


@pytest.mark.parametrize("min_split_tiles", [1, 4])
@pytest.mark.parametrize("lens", [[1000], [8192, 1000, 1, 0, 130]], ids=["b1-1k", "ragged"])
def test_decode_single_launch_split(seed, lens, min_split_tiles):
    """Split-KV merged by each (sequence, KV head)'s last split in the same launch: a grid of
    33 splits over ragged contexts (one-tile splits with min_split_tiles 1), NaN-filled
    workspace; the counters come back to zero."""
    pool, tables, seq_lens = make_pool(lens, 16, 8, 128)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    q = torch.randn(len(lens), 32, 128, dtype=BF16, device=DEV)
    ws = torch.full((decode_workspace_numel(len(lens), 32, 128, 33),), float("nan"), device=DEV)
    counters = torch.zeros(len(lens) * 8, dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5, out=out,
                           num_splits=33, workspace=ws, counters=counters,
                           policy=SplitPolicy(min_split_tiles=min_split_tiles))
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5)
    err = rel_err(out, ref)
    assert err < TOL, f"seed={seed} rel err {err:.2e}"
    assert torch.all(counters == 0), f"seed={seed}: counters {counters.tolist()}"
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.all(out[b] == 0), f"seed={seed}: padding row"


def test_decode_split_cuda_graph_replays(seed):
    """One split launch captured with a grid sized for 32k-token contexts, replayed with other
    contexts written into seq_lens: each replay matches the reference and leaves the counters
    at zero; replaying the same inputs gives bit-identical outputs (whichever split comes last
    merges, always in split order)."""
    batch, hq, hkv, d, max_len = 2, 32, 8, 128, 32768
    pool, tables, seq_lens = make_pool([max_len] * batch, 16, hkv, d)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    q = torch.randn(batch, hq, d, dtype=BF16, device=DEV)
    splits = decode_num_splits(batch, hkv, max_len, num_sms(DEV))
    assert splits > 1
    ws = torch.empty(decode_workspace_numel(batch, hq, d, splits), dtype=torch.float32,
                     device=DEV)
    counters = torch.zeros(batch * hkv, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    graph, _ = capture(lambda: paged_decode_attention(
        q, k_cache, v_cache, tables, seq_lens, d ** -0.5, out=out, num_splits=splits,
        workspace=ws, counters=counters))
    for lens in ([1000, max_len], [1, 0], [5000, 257], [max_len, 31999], [64, 65]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        err = rel_err(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens,
                                                      d ** -0.5))
        assert err < TOL, f"seed={seed} lens={lens} rel err {err:.2e}"
        assert torch.all(counters == 0), f"seed={seed} lens={lens}: {counters.tolist()}"
    seq_lens.copy_(torch.tensor([3000, 20000], dtype=torch.int32))
    for i in range(20):
        # Fresh queries each time: a merge that read a partial of the previous replay (a
        # missing memory fence) would be off by far more than the tolerance.
        q.copy_(torch.randn_like(q))
        graph.replay()
        first = out.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first), f"seed={seed}: replay {i}: not deterministic"
        err = rel_err(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens,
                                                      d ** -0.5))
        assert err < TOL, f"seed={seed} replay {i} rel err {err:.2e}"


# ----------------------------------------------------------------------------- prefill

def _prefill_case(seed, qlens, cached, num_q_heads=32, num_kv_heads=8, head_dim=128,
                  block_size=16):
    lens = [q + c for q, c in zip(qlens, cached, strict=True)]
    pool, tables, seq_lens = make_pool(lens, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                       device=DEV)
    q = torch.randn(sum(qlens), num_q_heads, head_dim, dtype=BF16, device=DEV)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    paged_prefill_attention(q, k_cache, v_cache, qsl, seq_lens, tables, scale, max(qlens),
                            out=out)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, qsl, seq_lens, tables, scale)
    err = rel_err(out, ref)
    assert err < TOL, f"seed={seed} qlens={qlens} cached={cached} rel err {err:.2e}"


def test_prefill_2k_chunk_over_30k_cached(seed):
    _prefill_case(seed, [2048], [30720])


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"),
    [(32, 8, 128), (32, 8, 64), (16, 8, 256), (28, 4, 128)],
    ids=["llama8b", "d64", "d256", "qwen7b-group7"])
def test_prefill_mixed_chunks(seed, num_q_heads, num_kv_heads, head_dim):
    _prefill_case(seed, [1, 700, 333, 1024], [900, 0, 2000, 64], num_q_heads, num_kv_heads,
                  head_dim)


# ----------------------------------------------------------------------------- small kernels

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
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim)
    freqs = torch.outer(torch.arange(131072, device=DEV).float(), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)
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


# ----------------------------------------------------------------------------- backend

@pytest.mark.parametrize("rope", [False, True], ids=["store", "rope-store"])
def test_backend_mixed_batch_matches_torch_backend(seed, rope):
    hq, hkv, d, bs = 32, 8, 128, 16
    query_lens = [1] * 6 + [512, 1, 200]
    seq_lens = [3000, 17, 1, 900, 4096, 50, 512, 700, 1300]
    pool, tables, _ = make_pool(seq_lens, bs, hkv, d, num_layers=2)
    meta = step_metadata(query_lens, seq_lens, tables, bs, DEV)
    torch_pool = pool.clone()
    tri = TritonAttentionBackend(pool, hq, d ** -0.5)
    ref = TorchAttentionBackend(torch_pool, hq, d ** -0.5)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens,
                                                                   strict=True)]).to(DEV)
    cache = rope_cache(d, 8192)
    for layer in (0, 1):
        heads = torch.randn(sum(query_lens), hq + 2 * hkv, d, dtype=BF16, device=DEV)
        heads_ref = heads.clone()
        r = Rope(positions, cache) if rope else None
        got = tri.forward(layer, *_views(heads, hq, hkv), meta, r)
        expected = ref.forward(layer, *_views(heads_ref, hq, hkv), meta, r)
        err = rel_err(got, expected)
        assert err < TOL, f"seed={seed} layer={layer} rel err {err:.2e}"
        assert rel_err(heads, heads_ref) < TOL, f"seed={seed} layer={layer}: q/k rotation"
    if rope:
        assert rel_err(pool, torch_pool) < TOL, f"seed={seed}"
    else:
        assert torch.equal(pool, torch_pool), f"seed={seed}"


def _views(heads: torch.Tensor, hq: int, hkv: int):  # type: ignore[no-untyped-def]
    return heads[:, :hq], heads[:, hq:hq + hkv], heads[:, hq + hkv:]


@pytest.mark.parametrize("rope", [False, True], ids=["store", "rope-store"])
@pytest.mark.parametrize("batch", [1, 4])
def test_backend_all_decode_cuda_graph(seed, batch, rope):
    """Capture one all-decode step in a CUDA graph (sized for 8k-token contexts, so batch 1
    splits 32 ways), then replay it with other contexts (longer, shorter, padding) and
    positions written into the same tensors: attention matches the reference, q and k come
    out rotated, the new K lands in its slot, the split counters are back at zero."""
    hq, hkv, d, bs, max_blocks = 32, 8, 128, 16, 512  # up to 8k tokens a sequence
    num_blocks = batch * max_blocks + 1
    pool = torch.randn(num_blocks, 2, 2, bs, hkv, d, dtype=BF16, device=DEV)
    tables = torch.randperm(num_blocks - 1, device=DEV).to(torch.int32)[
        :batch * max_blocks].view(batch, max_blocks).contiguous()
    backend = TritonAttentionBackend(pool, hq, d ** -0.5)
    cache = rope_cache(d, max_blocks * bs)
    positions = torch.zeros(batch, dtype=torch.long, device=DEV)

    def step_meta(lens: list[int]) -> AttentionMetadata:
        return step_metadata([1] * batch, lens[:batch], tables, bs, DEV)

    static = step_meta([100, 2000, 5, 7000])
    heads = torch.randn(batch, hq + 2 * hkv, d, dtype=BF16, device=DEV)
    q, k, v = _views(heads, hq, hkv)
    graph, graph_out = capture(lambda: backend.forward(
        1, q, k, v, static, Rope(positions, cache) if rope else None))

    for lens in ([8000, 1, 300, 4000], [16, 0, 8192, 1000], [1000, 8192, 0, 1],
                 [8192, 1000, 1, 0]):
        lens = lens[:batch]
        new = step_meta(lens)
        static.seq_lens.copy_(new.seq_lens)
        static.slot_mapping.copy_(new.slot_mapping)
        positions.copy_((new.seq_lens - 1).clamp(min=0))
        heads.copy_(torch.randn_like(heads))
        q0, k0 = q.clone(), k.clone()
        graph.replay()
        torch.cuda.synchronize()
        msg = f"seed={seed} lens={lens}"
        if rope:
            rotary_embedding_ref(positions, q0, k0, cache)
        assert rel_err(q, q0) < TOL and rel_err(k, k0) < TOL, f"{msg}: rotation"
        expected = paged_decode_attention_ref(q, pool[:, 1, 0], pool[:, 1, 1], tables,
                                              new.seq_lens, d ** -0.5)
        err = rel_err(graph_out, expected)
        assert err < TOL, f"{msg} rel err {err:.2e}"
        assert torch.all(backend.split_counters == 0), f"{msg}: split counters not reset"
        # The step's new (rotated) K landed in its slot.
        for b, n in enumerate(lens):
            if n:
                blk, off = int(tables[b, (n - 1) // bs]), (n - 1) % bs
                assert torch.equal(pool[blk, 1, 0, off], k[b]), f"{msg} seq {b}"
