"""The paged attention kernels against their torch references on a GPU, at real model shapes in
bfloat16 (Llama-3.1-8B attention: 32 query heads, 8 KV heads, head dim 128; also head dims 64 and
256): decode (split-KV in one launch, 32k-token contexts, a split launch captured in a CUDA graph
and replayed) and prefill (chunks over long cached contexts).

Run on a CUDA box:  pytest -m gpu tests/gpu/test_paged_attention_gpu.py -v
Tolerance and seeds: tests/gpu_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
from gpu_kernels import BF16, DEV, ON_GPU, TOL, capture, make_pool, rel_err

pytestmark = ON_GPU

if torch.cuda.is_available():
    from tandem.kernels import (
        SplitPolicy,
        decode_num_splits,
        decode_workspace_numel,
        paged_decode_attention,
        paged_decode_attention_ref,
        paged_prefill_attention,
        paged_prefill_attention_ref,
    )
    from tandem.kernels._common import num_sms


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


@pytest.mark.parametrize("min_split_tokens", [1, 256])
@pytest.mark.parametrize("lens", [[1000], [8192, 1000, 1, 0, 130]], ids=["b1-1k", "ragged"])
def test_decode_single_launch_split(seed, lens, min_split_tokens):
    """Split-KV merged by each (sequence, KV head)'s last split in the same launch: a grid of
    33 splits over ragged contexts (one-tile splits with min_split_tokens 1), NaN-filled
    workspace; the counters come back to zero."""
    pool, tables, seq_lens = make_pool(lens, 16, 8, 128)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    q = torch.randn(len(lens), 32, 128, dtype=BF16, device=DEV)
    ws = torch.full((decode_workspace_numel(len(lens), 32, 128, 33),), float("nan"), device=DEV)
    counters = torch.zeros(len(lens) * 8, dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5, out=out,
                           num_splits=33, workspace=ws, counters=counters,
                           policy=SplitPolicy(min_split_tokens=min_split_tokens))
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5)
    err = rel_err(out, ref)
    assert err < TOL, f"seed={seed} rel err {err:.2e}"
    assert torch.all(counters == 0), f"seed={seed}: counters {counters.tolist()}"
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.all(out[b] == 0), f"seed={seed}: padding row"


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("batch", [64, 72, 96, 136, 512])
def test_decode_unsplit_tiles_by_the_last_wave(seed, batch, kv_dtype):
    """An unsplit launch without a config takes the candidate tiles of its cache's dtype that
    fill the grid's last wave (the card's own register counts), and matches the reference with
    each of them. The FP8 candidates cap the registers a thread may use: a lower cap holds at
    least as many programs on the card."""
    import importlib

    from tandem.kernels._common import FP8_DTYPE, quantize_fp8_ref
    from tandem.kernels.paged_decode_launch import (
        UNSPLIT_CANDIDATES,
        UNSPLIT_CANDIDATES_FP8,
        fullest_last_wave,
    )

    lens = torch.randint(1, 1024, (batch,)).tolist()
    pool, tables, seq_lens = make_pool(lens, 16, 8, 128)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    scales = {}
    candidates = UNSPLIT_CANDIDATES
    if kv_dtype == "fp8":
        k_scale = torch.rand(8, device=DEV) / 64 + 1e-3
        v_scale = torch.rand(8, device=DEV) / 64 + 1e-3
        k_cache = quantize_fp8_ref(k_cache, k_scale)
        v_cache = quantize_fp8_ref(v_cache, v_scale)
        assert k_cache.dtype == FP8_DTYPE
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        candidates = UNSPLIT_CANDIDATES_FP8
    q = torch.randn(batch, 32, 128, dtype=BF16, device=DEV)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5,
                                     **scales)
    out = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5,
                                 num_splits=1, **scales)
    assert rel_err(out, ref) < TOL, f"seed={seed} batch={batch}"
    launcher = importlib.import_module("tandem.kernels.paged_decode_attention")
    slots = [v for k, v in launcher._UNSPLIT_SLOTS.items()
             if k[0] == q.device and k[2] == k_cache.dtype]
    assert slots and all(len(s) == len(candidates) and min(s) >= num_sms(DEV)
                         for s in slots), slots
    if kv_dtype == "fp8":  # capped at 160, then 128 registers a thread
        assert all(s[0] <= s[1] for s in slots), slots
    for cfg in candidates:
        out = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5,
                                     num_splits=1, config=cfg, **scales)
        assert rel_err(out, ref) < TOL, f"seed={seed} batch={batch} {cfg}"
    assert 0 <= fullest_last_wave(batch * 8, slots[0]) < len(candidates)


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

