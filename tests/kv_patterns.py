"""KV pools filled with a byte pattern each block can be told apart by, in any KV dtype, and a
producer process that serves one as a prefill worker with `--transport nixl` does (the GPU
transport tests read from it)."""

from __future__ import annotations

import contextlib
from multiprocessing.connection import Connection

import torch


def as_bytes(pool: torch.Tensor) -> torch.Tensor:
    """The pool as [num_blocks, block bytes] of uint8 (any KV dtype, FP8 included)."""
    return pool.view(pool.shape[0], -1).view(torch.uint8)


def _pattern(blocks: torch.Tensor, width: int) -> torch.Tensor:
    """Block b holds byte (b * 1009 + i) % 251 at byte i."""
    i = torch.arange(width, device=blocks.device, dtype=torch.int32)
    return ((blocks.to(torch.int32)[:, None] * 1009 + i) % 251).to(torch.uint8)


def fill_pattern(pool: torch.Tensor) -> None:
    flat = as_bytes(pool)
    for start in range(0, flat.shape[0], 16):
        b = torch.arange(start, min(start + 16, flat.shape[0]), device=pool.device)
        flat[start:start + 16] = _pattern(b, flat.shape[1])


def blocks_match(pool: torch.Tensor, dst_ids: list[int], src_ids: list[int]) -> bool:
    """Whether pool blocks dst_ids[k] hold the producer's pattern of blocks src_ids[k]."""
    flat = as_bytes(pool)
    for start in range(0, len(src_ids), 16):
        s = torch.tensor(src_ids[start:start + 16], device=pool.device)
        d = torch.tensor(dst_ids[start:start + 16], device=pool.device)
        if not torch.equal(flat[d], _pattern(s, flat.shape[1])):
            return False
    return True


def nixl_producer(conn: Connection, device: str, shape: dict[str, int], dtype: str) -> None:
    """A prefill worker's pool with `--transport nixl`: pattern-filled, registered with its
    NIXL agent, its descriptor sent on `conn`, served until the other end says stop."""
    from tandem.kvtransfer.pool import TORCH_DTYPES, allocate_pool

    pool = allocate_pool(device=device, transport="nixl", dtype=TORCH_DTYPES[dtype], **shape)
    fill_pattern(pool.tensor)
    if pool.tensor.device.type == "cuda":
        torch.cuda.synchronize(pool.tensor.device)
    conn.send(pool.descriptor)
    with contextlib.suppress(EOFError):
        conn.recv()
    pool.close()
    with contextlib.suppress(OSError):
        conn.send(True)
