from __future__ import annotations

import pytest
import torch

from tandem.engine.attention.base import max_prefill_tiles, prefill_tiles
from tandem.kernels import paged_prefill_attention, paged_prefill_attention_ref
from tandem.kernels.paged_prefill_attention import PrefillConfig


def _batch(seed: int) -> tuple[list[int], list[int]]:
    """Chunk lengths and contexts after the chunk: a decode-like chunk of 1, a fresh prompt
    (no cached context) and two chunks over cached context, one of them long."""
    g = torch.Generator().manual_seed(seed)
    qlens = [1, int(torch.randint(5, 40, (), generator=g)),
             int(torch.randint(2, 30, (), generator=g)), int(torch.randint(40, 70, (), generator=g))]
    cached = [int(torch.randint(1, 60, (), generator=g)), 0,
              int(torch.randint(1, 50, (), generator=g)), int(torch.randint(1, 40, (), generator=g))]
    return qlens, [q + c for q, c in zip(qlens, cached, strict=True)]


def _run(seed, device, make_paged_context, group, head_dim, config, num_kv_heads=2,
         work_list=False):
    block_size = [8, 16, 32][seed % 3]
    qlens, lens = _batch(seed)
    pool, tables, seq_lens = make_paged_context(lens, 40, block_size, 3, 1, num_kv_heads,
                                                head_dim, torch.float32, device)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                       device=device)
    q = torch.randn(sum(qlens), num_kv_heads * group, head_dim, device=device)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    tiles = None
    if work_list:  # the list a captured step reads: exact items, then spare capacity
        block_q = (config.block_m // group)
        cap = max_prefill_tiles(sum(qlens), len(qlens), block_q) + 3
        tiles = torch.tensor(prefill_tiles(qlens, block_q, cap), dtype=torch.int32,
                             device=device).view(-1, 2)
    paged_prefill_attention(q, k_cache, v_cache, qsl, seq_lens, tables, scale, max(qlens),
                            out=out, tiles=tiles, config=config)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, qsl, seq_lens, tables, scale)
    msg = f"seed={seed} block_size={block_size} qlens={qlens} seq_lens={lens} config={config}"
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"{msg}\n{m}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_matches_reference(seed, device, make_paged_context, group, head_dim):
    _run(seed, device, make_paged_context, group, head_dim, None)


@pytest.mark.parametrize("config", [PrefillConfig(16, 16, 4, 1), PrefillConfig(32, 32, 4, 2)],
                         ids=["m16n16", "m32n32"])
def test_small_tiles(seed, device, make_paged_context, config):
    """Tiles smaller than the chunks: several query tiles per sequence, the diagonal tile
    split across key tiles, and a GQA group (4) that packs 4 or 8 tokens per tile."""
    _run(seed, device, make_paged_context, 4, 64, config)


def test_group_not_power_of_two(seed, device, make_paged_context):
    """Qwen2.5-7B has 7 query heads per KV head: rows = tokens x 7 fill a tile unevenly."""
    _run(seed, device, make_paged_context, 7, 64, PrefillConfig(32, 16, 4, 1), num_kv_heads=1)


def test_work_list_with_spare_capacity(seed, device, make_paged_context):
    """The exact (sequence, tile) items of the chunks, padded with unused items, as a step
    replayed from a CUDA graph passes them: every row written, equal to the reference."""
    _run(seed, device, make_paged_context, 4, 64, PrefillConfig(32, 16, 4, 1), work_list=True)


def test_prefill_tiles_lists_each_tile_once_last_first():
    assert prefill_tiles([1, 5, 0, 3], 2, capacity=8) == [
        0, 0, 1, 2, 1, 1, 1, 0, 3, 1, 3, 0, -1, 0, -1, 0]
    assert max_prefill_tiles(9, 4, 2) >= len(prefill_tiles([1, 5, 0, 3], 2)) // 2
