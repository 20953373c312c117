from __future__ import annotations

import pytest
import torch

from tandem.kernels import copy_blocks, copy_blocks_ref


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_between_pools(seed, device, dtype, ids_dtype):
    shape = (2, 2, 8, 2, 64)  # [L, 2, bs, Hkv, D] per block
    src = torch.randn(10, *shape, device=device).to(dtype)
    dst = torch.full((12, *shape), float("nan"), device=device).to(dtype)
    expected = dst.clone()
    src_ids = torch.randperm(10, device=device)[:6].to(ids_dtype)
    dst_ids = torch.randperm(12, device=device)[:6].to(ids_dtype)
    copy_blocks(src, dst, src_ids, dst_ids)
    copy_blocks_ref(src, expected, src_ids, dst_ids)
    # Bitwise, NaN blocks included: the copied blocks match, the others are untouched.
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8)), f"seed={seed}"


def test_within_one_pool(seed, device):
    """Copy-on-write: source and destination blocks in the same pool."""
    pool = torch.randn(16, 3, 2, 8, 1, 64, device=device)
    expected = pool.clone()
    perm = torch.randperm(16, device=device)
    src_ids, dst_ids = perm[:4], perm[4:8]
    copy_blocks(pool, pool, src_ids, dst_ids)
    copy_blocks_ref(expected, expected, src_ids, dst_ids)
    assert torch.equal(pool, expected), f"seed={seed}"


@pytest.mark.parametrize("block_elems", [(3, 5), (7,), (2, 2)])
def test_odd_block_sizes_use_narrower_words(seed, device, block_elems):
    """6, 14 and 8 bytes per fp16 block: 2-, 2- and 8-byte words."""
    src = torch.randn(5, *block_elems, device=device).half()
    dst = torch.zeros(6, *block_elems, device=device).half()
    expected = dst.clone()
    src_ids = torch.tensor([4, 0, 2], device=device)
    dst_ids = torch.tensor([1, 5, 3], device=device)
    copy_blocks(src, dst, src_ids, dst_ids)
    copy_blocks_ref(src, expected, src_ids, dst_ids)
    assert torch.equal(dst, expected), f"seed={seed}"


def test_strided_pool_of_contiguous_blocks(seed, device):
    """A pool whose block stride exceeds the block size (blocks padded apart)."""
    backing = torch.randn(8, 2 * 4 * 64 + 32, device=device)
    src = backing[:, :2 * 4 * 64].view(8, 2, 4, 64)
    dst = torch.zeros(8, 2, 4, 64, device=device)
    ids = torch.randperm(8, device=device)[:5]
    copy_blocks(src, dst, ids, ids.flip(0))
    assert torch.equal(dst[ids.flip(0)], src[ids]), f"seed={seed}"


def test_rejects_mismatched_blocks(device):
    with pytest.raises(ValueError, match="blocks differ"):
        copy_blocks(torch.zeros(2, 4, device=device), torch.zeros(2, 8, device=device),
                    torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))


def test_large_blocks_span_several_programs(seed, device):
    """160 kB blocks: two chunks per block, the last one ragged."""
    src = torch.randn(4, 5, 8000, device=device)
    dst = torch.zeros(4, 5, 8000, device=device)
    copy_blocks(src, dst, torch.tensor([2, 0], device=device), torch.tensor([1, 3], device=device))
    assert torch.equal(dst[1], src[2]) and torch.equal(dst[3], src[0]), f"seed={seed}"
    assert torch.all(dst[0] == 0) and torch.all(dst[2] == 0)
