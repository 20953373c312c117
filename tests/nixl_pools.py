"""What the nixl transport's CPU tests share: UCX held to the loopback device, the pool shape,
whether the nixl package is there, and DRAM pools made on a given endpoint, filled with a
pattern each block can be told apart by."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvtransfer.descriptor import PoolDescriptor

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before any agent exists: loopback only

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)


def _have_nixl() -> str | None:
    try:
        import nixl._api  # noqa: F401
    except ImportError as e:
        return f"the nixl package is not installed (pip install 'tandem[nixl]'): {e}"
    return None


NO_NIXL = _have_nixl()
needs_nixl = pytest.mark.skipif(NO_NIXL is not None, reason=NO_NIXL or "")


def fill(pool: torch.Tensor, salt: int = 0) -> None:
    flat = pool.view(pool.shape[0], -1)
    i = torch.arange(flat.shape[1])
    for b in range(flat.shape[0]):
        flat[b] = ((b * 1009 + i + salt) % 251).to(pool.dtype)


def local_blocks(num_blocks: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A destination pool of SHAPE, every element -1 (a pull's untouched blocks stay so)."""
    return torch.full((num_blocks, SHAPE["num_layers"], 2, SHAPE["block_size"],
                       SHAPE["num_kv_heads"], SHAPE["head_dim"]), -1, dtype=dtype)


def owner_pool(ep, num_blocks: int, dtype=torch.float16):
    """A pool made like allocate_pool(transport="nixl") does, on a given endpoint; filled."""
    from kvtransfer import nixl
    from kvtransfer.pool import DTYPE_NAMES, LocalPool

    desc_shape = (num_blocks, SHAPE["num_layers"], 2, SHAPE["block_size"],
                  SHAPE["num_kv_heads"], SHAPE["head_dim"])
    nbytes = torch.Size(desc_shape).numel() * dtype.itemsize
    tensor, memory, handle, dev, on_close = nixl.allocate_nixl_pool(nbytes, torch.device("cpu"),
                                                                    ep)
    desc = PoolDescriptor(dtype=DTYPE_NAMES[dtype], num_blocks=num_blocks, transport="nixl",
                          handle=handle, device_index=dev, owner_pid=os.getpid(), **SHAPE)
    pool = LocalPool(tensor.view(dtype).view(desc_shape), desc, memory, on_close)
    fill(pool.tensor)
    return pool
