"""What the nixl transport's CPU tests share: UCX held to the loopback device, the pool shape,
whether the nixl package is there, and DRAM pools made on a given endpoint, filled with a
pattern each block can be told apart by, and a reader whose transfers a wrapper holds in flight
(`gated_reader`)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem.kvtransfer.descriptor import PoolDescriptor

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
    from tandem.kvtransfer import nixl
    from tandem.kvtransfer.pool import DTYPE_NAMES, LocalPool

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


class Gated:
    """A real agent whose transfers look in flight (PROC) until `gate` is set, and which can
    refuse to release an in-flight transfer (as NIXL does when it cannot cancel). Counts the
    releases each handle got."""

    def __init__(self, agent, refuse_release_while_gated: bool = False) -> None:
        self.agent = agent
        self.gate = threading.Event()
        self.refuse = refuse_release_while_gated
        self.refused = threading.Event()
        # Releases per transfer made, by the order it was made: handles are held here, so an
        # id is never reused for another transfer while the test runs.
        self.made: list = []
        self.released: dict[int, int] = {}

    def __getattr__(self, name):
        return getattr(self.agent, name)

    def transfer(self, handle):
        state = self.agent.transfer(handle)
        return "PROC" if state != "ERR" else state

    def check_xfer_state(self, handle):
        if not self.gate.is_set():
            return "PROC"
        # Gate open: the real state (a real READ of a few KiB is done or about to be).
        while (state := self.agent.check_xfer_state(handle)) == "PROC":
            time.sleep(0.001)
        return state

    def initialize_xfer(self, *args, **kwargs):
        handle = self.agent.initialize_xfer(*args, **kwargs)
        self.made.append(handle)
        return handle

    def release_xfer_handle(self, handle):
        if self.refuse and not self.gate.is_set():
            self.refused.set()
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.agent.release_xfer_handle(handle)
        k = next(i for i, h in enumerate(self.made) if h is handle)
        self.released[k] = self.released.get(k, 0) + 1


def gated_reader(nixl_endpoints, refuse_release_while_gated: bool = False):
    """A reader endpoint whose agent is wrapped in a Gated, and that Gated."""
    made: list[Gated] = []

    def wrap(agent):
        made.append(Gated(agent, refuse_release_while_gated))
        return made[-1]

    reader = nixl_endpoints(wrap)
    return reader, made[0]
