"""Copy whole blocks between block-major pools in one launch.

A pool is [num_blocks, ...] where each block (one dim-0 row: all layers, K and V) is one
contiguous chunk. Pair i copies src[src_block_ids[i]] -> dst[dst_block_ids[i]]. The blocks are
moved as raw words, the widest (8, 4, 2 or 1 bytes) that divides the block size, the block
strides and the base addresses; Triton turns 8-byte words into 16-byte vector accesses when
the addresses allow it. Each program moves one CHUNK of one block:

    grid = (pairs, chunks per block)    block: | chunk 0 | chunk 1 | ... |  (CHUNK words each)

src may be peer or IPC-mapped memory of another GPU presented as a tensor on dst's device (the
kernel then reads over NVLink/PCIe); src may also be dst (copy-on-write within one pool). Within
one call the destination blocks must be distinct and not among the sources.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels._common import check, check_same_device, device_guard

_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


@dataclass(frozen=True)
class CopyConfig:
    """Words per tile (one load + store per thread group), tiles per program, warps, and the
    load cache modifier ("" or ".cg": stream past L1, useful for peer reads)."""

    block: int = 2048
    tiles: int = 8
    num_warps: int = 8
    cache: str = ""


DEFAULT_CONFIG = CopyConfig()


# The id lists are often two rows of one upload (an offset that varies with their length): no
# specialisation on their alignment, so one variant serves every transfer.
@triton.jit(do_not_specialize_on_alignment=["src_ids_ptr", "dst_ids_ptr"])
def _copy_blocks_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr,
    words_per_block, stride_src, stride_dst,  # in words
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr, CACHE: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    src = src_ptr + src_block * stride_src
    dst = dst_ptr + dst_block * stride_dst
    for i in tl.static_range(0, CHUNK, BLOCK):
        offs = chunk * CHUNK + i + tl.arange(0, BLOCK)
        if MASKED:
            mask = offs < words_per_block
            tl.store(dst + offs, tl.load(src + offs, mask=mask, cache_modifier=CACHE), mask=mask)
        else:
            tl.store(dst + offs, tl.load(src + offs, cache_modifier=CACHE))


def _as_words(pool: torch.Tensor, word: torch.dtype) -> torch.Tensor | None:
    """pool viewed as [num_blocks, words] of `word`, or None when the alignment forbids it."""
    try:
        return pool.view(pool.shape[0], -1).view(torch.uint8).view(word)
    except RuntimeError:
        return None


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_block_ids: torch.Tensor,
                dst_block_ids: torch.Tensor, *, config: CopyConfig | None = None) -> None:
    """src, dst: block-major pools [N_src, ...], [N_dst, ...] with equal block shape and dtype,
    each block contiguous; ids: int32/int64 [num_pairs] on dst's device."""
    check(src.dim() >= 2 and src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype,
          f"src and dst blocks differ: {src.dtype} {tuple(src.shape)} vs "
          f"{dst.dtype} {tuple(dst.shape)}")
    check(src.shape[0] > 0 and dst.shape[0] > 0, "empty pool")
    check(src[0].is_contiguous() and dst[0].is_contiguous(),
          "each block (dim-0 row) of src and dst must be contiguous")
    check(src_block_ids.dim() == 1 and src_block_ids.shape == dst_block_ids.shape
          and src_block_ids.dtype in (torch.int32, torch.int64)
          and dst_block_ids.dtype in (torch.int32, torch.int64)
          and src_block_ids.is_contiguous() and dst_block_ids.is_contiguous(),
          f"block ids must be contiguous int32/int64 [num_pairs] of equal length, got "
          f"{src_block_ids.dtype} {tuple(src_block_ids.shape)} and "
          f"{dst_block_ids.dtype} {tuple(dst_block_ids.shape)}")
    check_same_device(src=src, dst=dst, src_block_ids=src_block_ids, dst_block_ids=dst_block_ids)
    num_pairs = src_block_ids.shape[0]
    if num_pairs == 0 or src[0].numel() == 0:
        return
    for word in _WORD_DTYPES:
        src_w, dst_w = _as_words(src, word), _as_words(dst, word)
        if src_w is not None and dst_w is not None:
            break
    assert src_w is not None and dst_w is not None  # uint8 always works
    cfg = config or DEFAULT_CONFIG
    words = src_w.shape[1]
    block = min(cfg.block, triton.next_power_of_2(words))
    chunk = min(cfg.tiles * block, triton.next_power_of_2(words))
    with device_guard(dst):
        _copy_blocks_kernel[(num_pairs, triton.cdiv(words, chunk))](
            src_w, dst_w, src_block_ids, dst_block_ids,
            words, src_w.stride(0), dst_w.stride(0),
            CHUNK=chunk, BLOCK=block, MASKED=words % chunk != 0, CACHE=cfg.cache,
            num_warps=cfg.num_warps,
        )


def copy_blocks_ref(src: torch.Tensor, dst: torch.Tensor, src_block_ids: torch.Tensor,
                    dst_block_ids: torch.Tensor) -> None:
    dst[dst_block_ids.long()] = src[src_block_ids.long()].to(dst.device)
