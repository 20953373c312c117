"""The alternative to kernels.copy_blocks that kv_transfer.py measures: scattered block copies
as one driver call, cuMemcpyBatchAsync (CUDA 12.8+ drivers; the `_v2` entry point, without the
failure index, is the one CUDA 13 headers name), through ctypes.

The copy engines move every block and the host makes one call for any number of blocks (one
cudaMemcpyAsync per block costs ~9 µs each). The batch as a whole runs in stream order (not the
legacy default stream: the driver refuses it), copies within it in any order. Measured against
the kernel in BENCHMARKS ("KV transfer between GPUs"): no faster on the device, dearer on the
host, so pull_blocks keeps the kernel.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

# CUmemcpySrcAccessOrder / CUmemLocationType / CUmemcpyFlags values from cuda.h
SRC_ACCESS_ORDER_STREAM = 0x1
MEM_LOCATION_TYPE_DEVICE = 0x1
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", _Location),
                ("dst_loc_hint", _Location), ("flags", ctypes.c_uint)]


@functools.cache
def _entry() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = getattr(lib, "cuMemcpyBatchAsync_v2", None)
    if fn is None:
        return None
    size_p = ctypes.POINTER(ctypes.c_size_t)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), size_p,
                   ctypes.c_size_t, ctypes.POINTER(_Attributes), size_p, ctypes.c_size_t,
                   ctypes.c_void_p]
    return fn


def available() -> bool:
    """Whether this host's CUDA driver has cuMemcpyBatchAsync_v2."""
    return _entry() is not None


def batch_copy(dst_base: int, src_base: int, dst_ids: Sequence[int], src_ids: Sequence[int],
               block_bytes: int, stream: int, device: int, flags: int = 0) -> None:
    """Enqueue on `stream` (a CUstream handle) copies of `block_bytes` bytes from
    src_base + src_ids[i] * block_bytes to dst_base + dst_ids[i] * block_bytes, one call.
    Addresses are device pointers (an IPC-mapped peer pool's included)."""
    fn = _entry()
    if fn is None:
        raise RuntimeError("this CUDA driver has no cuMemcpyBatchAsync_v2 (needs a CUDA 13 "
                           "driver)")
    n = len(dst_ids)
    if n == 0:
        return
    dsts = (ctypes.c_uint64 * n)(*[dst_base + i * block_bytes for i in dst_ids])
    srcs = (ctypes.c_uint64 * n)(*[src_base + i * block_bytes for i in src_ids])
    sizes = (ctypes.c_size_t * n)(*([block_bytes] * n))
    here = _Location(MEM_LOCATION_TYPE_DEVICE, device)
    attrs = _Attributes(SRC_ACCESS_ORDER_STREAM, here, here, flags)
    first = ctypes.c_size_t(0)
    rc = fn(dsts, srcs, sizes, n, ctypes.byref(attrs), ctypes.byref(first), 1, stream)
    if rc != 0:
        raise RuntimeError(f"cuMemcpyBatchAsync_v2 failed: CUresult {rc}")
