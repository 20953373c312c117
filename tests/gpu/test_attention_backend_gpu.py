"""The Triton attention backend on a GPU at Llama-3.1-8B attention shapes in bfloat16: a mixed
prefill and decode batch against the torch backend, and an all-decode step captured in a CUDA
graph and replayed with other contexts.

Run on a CUDA box:  pytest -m gpu tests/gpu/test_attention_backend_gpu.py -v
Tolerance and seeds: tests/gpu_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
from gpu_kernels import BF16, DEV, ON_GPU, TOL, capture, make_pool, rel_err, rope_cache

pytestmark = ON_GPU

if torch.cuda.is_available():
    from paged_meta import step_metadata
    from tandem.engine.attention.base import AttentionMetadata, Rope
    from tandem.engine.attention.torch_backend import TorchAttentionBackend
    from tandem.engine.attention.triton_backend import TritonAttentionBackend
    from tandem.kernels import paged_decode_attention_ref, rotary_embedding_ref


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
