"""The cuda_ipc code paths of kvtransfer against a stand-in for cupy, on the CPU.

The stand-in keeps "device memory" in numpy buffers and records every runtime call with the
device current at the time. This checks what the GPU tests cannot show cheaply: which calls
happen on which device, that the allocation is freed and the mapping closed exactly once and
only after the last tensor view is gone, and that errors carry no handle. Whether CUDA accepts
the calls is for tests/gpu/test_kvtransfer_gpu.py.
"""

from __future__ import annotations

import ctypes
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch

from tandem.kvtransfer.cuda_ipc import IPC_LAZY_ENABLE_PEER_ACCESS
from tandem.kvtransfer.pool import allocate_pool
from tandem.kvtransfer.remote import open_remote_pool, pull_blocks

SHAPE = dict(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)


class CUDARuntimeError(RuntimeError):
    pass


class FakeCupy(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("cupy")
        self.current = 0
        self.calls: list[tuple[str, int, int]] = []  # (call, current device, pointer)
        self.buffers: dict[int, np.ndarray] = {}
        self.fail_open = False
        fake = self

        class Device:
            def __init__(self, index: int) -> None:
                self.index = index

            def __enter__(self) -> None:
                self.saved, fake.current = fake.current, self.index

            def __exit__(self, *exc: object) -> None:
                fake.current = self.saved

        class UnownedMemory:
            def __init__(self, ptr: int, size: int, owner: object, device_id: int) -> None:
                self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

        class MemoryPointer:
            def __init__(self, mem: UnownedMemory, offset: int) -> None:
                assert offset == 0
                self.mem = mem

        class KeepAlive(np.ndarray):
            pass

        class ndarray:  # cupy's name
            def __init__(self, shape: tuple[int], dtype: Any, memptr: MemoryPointer) -> None:
                assert dtype is np.uint8 and shape == (memptr.mem.size,)
                self.memptr = memptr

            def __dlpack_device__(self) -> tuple[int, int]:
                return (1, 0)  # CPU: torch gets a CPU tensor over the "device" buffer

            def __dlpack__(self, **kwargs: Any) -> Any:
                mem = self.memptr.mem
                raw = (ctypes.c_uint8 * mem.size).from_address(mem.ptr)
                arr = np.frombuffer(raw, dtype=np.uint8).view(KeepAlive)
                arr.owner = self  # the capsule keeps this array, and so the chain, alive
                return arr.__dlpack__(**kwargs)

        self.cuda = types.SimpleNamespace(
            Device=Device, UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer,
            runtime=types.SimpleNamespace(
                CUDARuntimeError=CUDARuntimeError, malloc=self._malloc, free=self._free,
                ipcGetMemHandle=self._get_handle, ipcOpenMemHandle=self._open,
                ipcCloseMemHandle=self._close))
        self.ndarray = ndarray
        self.uint8 = np.uint8

    def _log(self, call: str, ptr: int) -> None:
        self.calls.append((call, self.current, ptr))

    def _malloc(self, nbytes: int) -> int:
        buf = np.full(nbytes, 0xFF, dtype=np.uint8)  # not zeroed, like cudaMalloc
        ptr = buf.ctypes.data
        self.buffers[ptr] = buf
        self._log("malloc", ptr)
        return ptr

    def _free(self, ptr: int) -> None:
        self._log("free", ptr)
        del self.buffers[ptr]

    def _get_handle(self, ptr: int) -> bytes:
        return ptr.to_bytes(8, "little") + b"\xc3" * 56

    def _open(self, handle: bytes, flags: int) -> int:
        assert flags == IPC_LAZY_ENABLE_PEER_ACCESS
        ptr = int.from_bytes(handle[:8], "little")
        if self.fail_open or ptr not in self.buffers:
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        self._log("open", ptr)
        return ptr  # one address space: the mapping is the allocation itself

    def _close(self, ptr: int) -> None:
        self._log("close", ptr)


@pytest.fixture
def cupy(monkeypatch: pytest.MonkeyPatch) -> FakeCupy:
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return fake


def test_cuda_ipc_pool_lifecycle_on_the_right_devices(cupy: FakeCupy) -> None:
    owner = allocate_pool(num_blocks=6, dtype=torch.bfloat16, device="cuda:0",
                          transport="cuda_ipc", **SHAPE)
    desc = owner.descriptor
    (call, dev, ptr), = cupy.calls
    assert (call, dev) == ("malloc", 0)
    assert (desc.transport, desc.device_index, len(desc.handle)) == ("cuda_ipc", 0, 64)
    assert owner.tensor.shape == desc.shape and owner.tensor.dtype == torch.bfloat16
    assert owner.tensor.data_ptr() == ptr and not owner.tensor.any()  # zeroed
    assert desc.handle.hex() not in repr(owner) and "c3c3" not in repr(desc)
    owner.tensor.view(6, -1)[:] = torch.arange(6, dtype=torch.bfloat16)[:, None]

    remote = open_remote_pool(desc, "cuda:1")
    assert cupy.calls[-1] == ("open", 1, ptr)  # opened with the consumer's device current
    local = torch.zeros(4, *desc.shape[1:], dtype=torch.bfloat16)
    pull_blocks(remote, local, [5, 2], [1, 3])
    assert local.view(4, -1)[:, 0].tolist() == [0, 5, 0, 2]

    # A view kept past close() keeps the mapping; dropping it closes the mapping, once.
    view = remote.tensor[5]
    remote.close()
    assert remote.mapped and cupy.calls[-1][0] == "open"
    del view
    assert not remote.mapped
    assert cupy.calls[-1] == ("close", 1, ptr)
    remote.close()
    owner.close()
    assert not owner.mapped
    assert cupy.calls[-1] == ("free", 0, ptr) and not cupy.buffers
    assert [c for c, _, _ in cupy.calls] == ["malloc", "open", "close", "free"]


def test_open_failure_names_the_pool_but_not_the_handle(cupy: FakeCupy) -> None:
    with allocate_pool(num_blocks=2, dtype=torch.float16, device="cuda:0", transport="cuda_ipc",
                       **SHAPE) as owner:
        cupy.fail_open = True
        with pytest.raises(RuntimeError) as err:
            open_remote_pool(owner.descriptor, "cuda:1")
        text = str(err.value)
        assert "cudaErrorInvalidDevice" in text and "'num_blocks': 2" in text and "cuda:1" in text
        assert owner.descriptor.handle.hex() not in text
        assert repr(owner.descriptor.handle)[2:-1] not in text
        assert isinstance(err.value.__cause__, CUDARuntimeError)
    assert not cupy.buffers


def test_a_failed_handle_export_frees_the_allocation(cupy: FakeCupy,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(ptr: int) -> bytes:
        raise CUDARuntimeError("cudaErrorMemoryAllocation")
    monkeypatch.setattr(cupy.cuda.runtime, "ipcGetMemHandle", refuse)
    with pytest.raises(CUDARuntimeError):
        allocate_pool(num_blocks=2, dtype=torch.float32, device="cuda:3", transport="cuda_ipc",
                      **SHAPE)
    assert [(c, d) for c, d, _ in cupy.calls] == [("malloc", 3), ("free", 3)]
    assert not cupy.buffers
