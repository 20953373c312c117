"""kvtransfer on the CPU: descriptors, shm pools shared with a separate process, and block
pulls by exact ids (leases: test_lease.py)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tandem.errors import InvalidArgument, LayoutMismatch
from tandem.kvtransfer.descriptor import LAYOUT_FIELDS, PoolDescriptor, check_compatible
from tandem.kvtransfer.pool import allocate_pool
from tandem.kvtransfer.remote import open_remote_pool, pull_blocks
from tandem.kvtransfer.shm import SHM_DIR

REPO = Path(__file__).resolve().parents[2]
SHAPE = dict(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
IPC_HANDLE = bytes(range(0xA0, 0xE0))  # 64 recognisable bytes


def _desc(**changes: object) -> PoolDescriptor:
    fields: dict[str, object] = dict(dtype="bfloat16", block_size=16, num_layers=32,
                                     num_kv_heads=8, head_dim=128, num_blocks=100,
                                     transport="cuda_ipc", handle=IPC_HANDLE, device_index=0,
                                     owner_pid=1234)
    fields.update(changes)
    return PoolDescriptor(**fields)  # type: ignore[arg-type]


def _fill(pool: torch.Tensor) -> None:
    """Block b holds (b * 1009 + i) % 251 at flat index i: exact in every KV dtype, and
    different in every block."""
    flat = pool.view(pool.shape[0], -1)
    i = torch.arange(flat.shape[1])
    for b in range(flat.shape[0]):
        flat[b] = ((b * 1009 + i) % 251).to(pool.dtype)


def _segments() -> set[str]:
    """This process's segments: other processes (services under test) may have their own."""
    return {f for f in os.listdir(SHM_DIR) if f.startswith(f"tandem-kv-{os.getpid()}-")}


def _mapped_segments() -> str:
    return "".join(line for line in Path("/proc/self/maps").read_text().splitlines(True)
                   if "tandem-kv-" in line)


# --- descriptor ---------------------------------------------------------------------------


def test_block_bytes_of_an_8b_shaped_pool_is_2_mib() -> None:
    desc = _desc()
    assert desc.block_bytes == 32 * 2 * 16 * 8 * 128 * 2 == 2 << 20
    assert desc.pool_bytes == 100 * desc.block_bytes
    assert desc.shape == (100, 32, 2, 16, 8, 128)


@pytest.mark.parametrize("field", LAYOUT_FIELDS)
def test_check_compatible_names_the_differing_field(field: str) -> None:
    other = {"dtype": "float16"}.get(field, getattr(_desc(), field) * 2)
    with pytest.raises(LayoutMismatch) as err:
        check_compatible(_desc(), _desc(**{field: other}))
    assert err.value.field == field
    assert field in str(err.value)


def test_check_compatible_reports_the_first_difference_and_ignores_num_blocks() -> None:
    check_compatible(_desc(num_blocks=10), _desc(num_blocks=5000))
    with pytest.raises(LayoutMismatch) as err:
        check_compatible(_desc(), _desc(head_dim=64, block_size=32))
    assert err.value.field == "block_size"


def test_handle_never_shows_in_repr_str_redacted_or_errors() -> None:
    desc = _desc()
    leaks = (IPC_HANDLE.hex(), repr(IPC_HANDLE)[2:-1], repr(IPC_HANDLE[:10])[2:-1])
    texts = [repr(desc), str(desc), f"{desc}", str(desc.redacted())]
    with pytest.raises(LayoutMismatch) as err:
        check_compatible(desc, _desc(dtype="float32"))
    texts.append(str(err.value))
    with pytest.raises(InvalidArgument) as bad:
        _desc(handle=IPC_HANDLE[:10])
    texts.append(str(bad.value))
    for text in texts:
        for leak in leaks:
            assert leak not in text
    assert "handle" not in desc.redacted()
    assert desc.redacted()["num_blocks"] == 100


@pytest.mark.parametrize(("changes", "field"), [
    ({"dtype": "int8"}, "dtype"),
    ({"head_dim": 0}, "head_dim"),
    ({"transport": "rdma"}, "transport"),
    ({"handle": b""}, "handle"),
    ({"handle": IPC_HANDLE + b"x"}, "handle"),
    ({"device_index": -1}, "device_index"),
    ({"transport": "shm", "handle": b"tandem-kv-1-ab", "device_index": 0}, "device_index"),
])
def test_descriptor_rejects_bad_fields_by_name(changes: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        _desc(**changes)
    assert err.value.field == field


def test_descriptor_is_frozen_and_picklable_with_its_handle() -> None:
    desc = _desc()
    with pytest.raises(dataclasses.FrozenInstanceError):
        desc.num_blocks = 1  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(desc)) == desc


# --- shm pools ------------------------------------------------------------------------------


def test_allocate_shm_pool_is_zeroed_block_major_and_removed_on_close() -> None:
    before = _segments()
    pool = allocate_pool(num_blocks=6, dtype=torch.float16, device="cpu", transport="shm",
                         **SHAPE)
    desc = pool.descriptor
    assert pool.tensor.shape == (6, 2, 2, 4, 2, 8) == desc.shape
    assert pool.tensor.dtype == torch.float16 and pool.tensor.is_contiguous()
    assert not pool.tensor.any()
    assert pool.tensor[1].data_ptr() - pool.tensor[0].data_ptr() == desc.block_bytes
    assert (desc.transport, desc.device_index, desc.owner_pid) == ("shm", -1, os.getpid())
    name = desc.handle.decode()
    assert name not in repr(pool)
    assert _segments() - before == {name}
    pool.close()
    pool.close()  # idempotent
    assert _segments() == before
    assert not pool.mapped and not _mapped_segments()
    with pytest.raises(RuntimeError, match="closed"):
        _ = pool.tensor


def test_allocate_pool_refuses_bad_arguments_by_name() -> None:
    kw = dict(SHAPE, num_blocks=4, dtype=torch.float32)
    cases = [
        (dict(kw, device="cpu", transport="cuda_ipc"), "transport"),
        (dict(kw, device="cuda:0", transport="shm"), "transport"),
        (dict(kw, device="cpu", transport="tcp"), "transport"),
        (dict(kw, device="cpu", transport="shm", dtype=torch.int8), "dtype"),
        (dict(kw, device="cpu", transport="shm", block_size=0), "block_size"),
        # 2 TB: refused before anything is created, not a SIGBUS later
        (dict(kw, device="cpu", transport="shm", num_blocks=1 << 30), "num_blocks"),
    ]
    before = _segments()
    for kwargs, field in cases:
        with pytest.raises(InvalidArgument) as err:
            allocate_pool(**kwargs)  # type: ignore[arg-type]
        assert err.value.field == field
    assert _segments() == before


def test_views_kept_past_close_stay_mapped_until_dropped() -> None:
    pool = allocate_pool(num_blocks=4, dtype=torch.float32, device="cpu", transport="shm",
                         **SHAPE)
    remote = open_remote_pool(pool.descriptor, "cpu")
    _fill(pool.tensor)
    local_view, remote_view = pool.tensor[2], remote.tensor[3]
    expected = remote_view.clone()
    pool.close()
    remote.close()
    # The name is gone at once; the memory stays until the last view is dropped.
    assert pool.descriptor.handle.decode() not in _segments()
    assert pool.mapped and remote.mapped
    assert torch.equal(remote_view, expected)
    local_view.fill_(1.0)  # writes to still-mapped memory, no crash
    del local_view, remote_view
    assert not pool.mapped and not remote.mapped
    assert not _mapped_segments()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pull_blocks_in_process_by_scattered_ids(dtype: torch.dtype) -> None:
    with allocate_pool(num_blocks=9, dtype=dtype, device="cpu", transport="shm",
                       **SHAPE) as owner:
        _fill(owner.tensor)
        remote = open_remote_pool(owner.descriptor, "cpu")
        local = torch.full((5, *owner.tensor.shape[1:]), -1.0, dtype=dtype)
        src, dst = [7, 2, 8, 0], [3, 0, 4, 1]
        stats = pull_blocks(remote, local, src, dst)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(local[d], owner.tensor[s])
        assert (local[2] == -1).all()  # untouched
        assert stats.num_blocks == 4 and stats.bytes == 4 * owner.descriptor.block_bytes
        assert stats.seconds > 0 and stats.gbps > 0
        assert pull_blocks(remote, local, [], []).bytes == 0
        remote.close()


def test_fp8_pool_moves_its_pages_unchanged_at_one_byte_an_element() -> None:
    """--kv-cache-dtype fp8: a block is half a bf16 block's bytes and pulls copy its bytes as
    they are (any bit pattern, NaN encodings included)."""
    assert _desc(dtype="float8_e4m3fn").block_bytes * 2 == _desc().block_bytes == 2 << 20
    fp8 = torch.float8_e4m3fn
    with allocate_pool(num_blocks=6, dtype=fp8, device="cpu", transport="shm", **SHAPE) as owner:
        owner.tensor.view(torch.uint8).copy_(torch.randint(0, 256, owner.tensor.shape,
                                                           dtype=torch.uint8))
        remote = open_remote_pool(owner.descriptor, "cpu")
        assert remote.descriptor.dtype == "float8_e4m3fn" and remote.tensor.dtype == fp8
        local = torch.zeros((4, *owner.tensor.shape[1:]), dtype=fp8)
        stats = pull_blocks(remote, local, [5, 1], [0, 3])
        for s, d in ((5, 0), (1, 3)):
            assert torch.equal(local[d].view(torch.uint8), owner.tensor[s].view(torch.uint8))
        assert not local[1].view(torch.uint8).any()
        assert stats.bytes == 2 * owner.descriptor.block_bytes == 2 * local[0].numel()
        with pytest.raises(InvalidArgument, match="cannot take blocks"):
            pull_blocks(remote, torch.zeros(local.shape, dtype=torch.bfloat16), [0], [0])
        remote.close()


def test_a_kv_cache_dtype_mismatch_names_the_flag() -> None:
    with pytest.raises(LayoutMismatch) as err:
        check_compatible(_desc(dtype="float8_e4m3fn"), _desc(dtype="bfloat16"))
    assert err.value.field == "dtype" and "--kv-cache-dtype" in str(err.value)
    again = pickle.loads(pickle.dumps(err.value))  # it travels from the engine core
    assert str(again) == str(err.value) and again.hint == err.value.hint
    with pytest.raises(LayoutMismatch, match="--block-size"):
        check_compatible(_desc(block_size=16), _desc(block_size=32))


def test_pull_blocks_refuses_bad_ids_and_layouts_before_copying() -> None:
    with allocate_pool(num_blocks=4, dtype=torch.float32, device="cpu", transport="shm",
                       **SHAPE) as owner:
        remote = open_remote_pool(owner.descriptor, "cpu")
        local = torch.zeros(3, *owner.tensor.shape[1:])
        cases = [
            (local, [0, 1], [0], "dst_block_ids"),
            (local, [4], [0], "src_block_ids"),
            (local, [-1], [0], "src_block_ids"),
            (local, [0], [3], "dst_block_ids"),
            (local, [0, 1], [2, 2], "dst_block_ids"),
            (local.to(torch.float16), [0], [0], "local"),
            (torch.zeros(3, 2, 2, 4, 2, 4), [0], [0], "local"),
        ]
        for dst_pool, src, dst, field in cases:
            with pytest.raises(InvalidArgument) as err:
                pull_blocks(remote, dst_pool, src, dst)
            assert err.value.field == field
        assert not local.any()
        remote.close()


def test_open_refuses_a_segment_that_is_not_a_tandem_pool() -> None:
    with pytest.raises(InvalidArgument) as err:
        open_remote_pool(_desc(transport="shm", handle=b"../etc/passwd", device_index=-1), "cpu")
    assert err.value.field == "handle" and "passwd" not in str(err.value)
    gone = _desc(transport="shm", handle=b"tandem-kv-0-gone", device_index=-1)
    with pytest.raises(RuntimeError) as missing:
        open_remote_pool(gone, "cpu")
    assert "tandem-kv-0-gone" not in str(missing.value)


# A decode worker in its own interpreter (its own resource tracker, as in deployment): maps the
# pool it is given, pulls blocks into a pool of its own, and sends that pool back.
_CHILD = textwrap.dedent("""
    import pickle, sys, torch
    from tandem.kvtransfer.remote import open_remote_pool, pull_blocks
    desc, src, dst, num_local = pickle.load(sys.stdin.buffer)
    remote = open_remote_pool(desc, "cpu")
    local = torch.zeros((num_local, *desc.shape[1:]), dtype=remote.tensor.dtype)
    stats = pull_blocks(remote, local, src, dst)
    remote.close()
    pickle.dump((local, stats, remote.mapped), sys.stdout.buffer)
""")


def test_shm_pool_is_pulled_from_another_process_and_survives_its_exit() -> None:
    before = _segments()
    owner = allocate_pool(num_blocks=16, dtype=torch.bfloat16, device="cpu", transport="shm",
                          **SHAPE)
    _fill(owner.tensor)
    expected = owner.tensor.clone()
    name = owner.descriptor.handle.decode()
    src, dst = [13, 2, 9, 2, 15, 0, 7], [4, 9, 0, 6, 1, 10, 3]  # scattered, unordered, a repeat
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.run([sys.executable, "-c", _CHILD], input=pickle.dumps(
        (owner.descriptor, src, dst, 12)), capture_output=True, cwd=REPO, env=env, timeout=120)
    assert child.returncode == 0, child.stderr.decode()
    local, stats, still_mapped = pickle.loads(child.stdout)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(local[d], expected[s]), (s, d)
    untouched = sorted(set(range(12)) - set(dst))
    assert not local[untouched].any()
    assert stats.num_blocks == 7 and stats.bytes == 7 * owner.descriptor.block_bytes
    assert not still_mapped
    # The child and its resource tracker are gone (run() waited for the tracker too: it holds
    # the stderr pipe): the owner's segment is still there, intact, and nothing was "leaked".
    assert b"leaked" not in child.stderr and name.encode() not in child.stderr
    assert name in _segments()
    assert torch.equal(owner.tensor, expected)
    owner.close()
    assert _segments() == before
