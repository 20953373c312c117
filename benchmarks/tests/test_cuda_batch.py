"""benchmarks/transfer/cuda_batch.py: the ctypes view of cuMemcpyBatchAsync_v2 that kv_transfer.py
measures against the copy_blocks kernel (its copies are checked byte for byte there, on GPUs)."""

from __future__ import annotations

import ctypes

import pytest

from benchmarks.transfer import cuda_batch


def test_attributes_match_cuda_h() -> None:
    """CUmemcpyAttributes: an enum, two CUmemLocation {enum, int}, unsigned flags: 24 bytes."""
    a = cuda_batch._Attributes
    assert ctypes.sizeof(a) == 24
    assert [getattr(a, f).offset for f in ("src_access_order", "src_loc_hint", "dst_loc_hint",
                                           "flags")] == [0, 4, 12, 20]


def test_without_the_driver_entry_point_the_error_names_it(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setattr(cuda_batch, "_entry", lambda: None)
    assert not cuda_batch.available()
    with pytest.raises(RuntimeError, match="cuMemcpyBatchAsync_v2"):
        cuda_batch.batch_copy(0, 0, [1], [2], 4096, stream=1, device=0)
