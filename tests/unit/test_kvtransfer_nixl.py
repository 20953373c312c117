"""The nixl transport on the CPU: the pool handle and descriptor (no agent), the errors that name
the extra when the package is missing, and DRAM pools registered with real NIXL agents (UCX over
the loopback device): pulls of scattered block ids, ids and layouts refused by name, concurrent
pulls. Cancelled, timed-out and failed pulls are in
test_kvtransfer_nixl_faults.py.

UCX is held to the loopback device here (UCX_NET_DEVICES=lo, set by nixl_pools). Every test
leaves each endpoint with nothing registered and no peer loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from nixl_pools import REPO, SHAPE, fill, local_blocks, needs_nixl, owner_pool

from tandem.errors import InvalidArgument
from tandem.kvtransfer.descriptor import PoolDescriptor
from tandem.kvtransfer.pool import allocate_pool
from tandem.kvtransfer.remote import pull_blocks

# --- handle and descriptor (no agent) -------------------------------------------------------


def test_handle_round_trips_and_garbage_is_refused_without_echoing_it() -> None:
    from tandem.kvtransfer.nixl import NixlHandle

    h = NixlHandle("tandem-host-1-ab", 0x7F00DEAD0000, b"\x00metadata\xff" * 3)
    assert NixlHandle.unpack(h.pack()) == h
    assert "metadata" not in repr(h)
    for bad in (b"", b"TNX1", b"XXXX" + h.pack()[4:], h.pack()[:18]):
        with pytest.raises(InvalidArgument, match=r"^handle: is not a nixl pool handle$"):
            NixlHandle.unpack(bad)


def test_descriptor_takes_nixl_pools_in_host_or_device_memory() -> None:
    kw = dict(dtype="float16", num_blocks=4, transport="nixl", handle=b"x", owner_pid=1, **SHAPE)
    assert PoolDescriptor(device_index=-1, **kw).device_index == -1
    assert PoolDescriptor(device_index=3, **kw).device_index == 3
    with pytest.raises(InvalidArgument, match=r"^device_index"):
        PoolDescriptor(device_index=-2, **kw)


def test_without_the_package_the_error_names_the_extra(monkeypatch) -> None:
    from tandem.kvtransfer import nixl

    monkeypatch.setitem(sys.modules, "nixl", None)  # import nixl raises ImportError
    with pytest.raises(nixl.NixlUnavailable, match=r"pip install 'tandem\[nixl\]'"):
        nixl.NixlEndpoint()
    monkeypatch.setattr(nixl, "_default", None)
    with pytest.raises(nixl.NixlUnavailable, match=r"tandem\[nixl\]"):
        allocate_pool(num_blocks=2, dtype=torch.float16, device="cpu", transport="nixl", **SHAPE)


# --- real agents ----------------------------------------------------------------------------


@needs_nixl
def test_pull_moves_scattered_blocks_exactly_and_nothing_else(nixl_endpoints) -> None:
    owner, reader = nixl_endpoints(), nixl_endpoints()
    with owner_pool(owner, 8, torch.bfloat16) as pool:
        remote = reader.connect(pool.descriptor)
        local = local_blocks(6, torch.bfloat16)
        stats = pull_blocks(remote, local, [4, 1, 3], [5, 0, 2])
        assert (stats.num_blocks, stats.bytes) == (3, 3 * pool.descriptor.block_bytes)
        for src, dst in ((4, 5), (1, 0), (3, 2)):
            assert torch.equal(local[dst], pool.tensor[src])
        assert (local[[1, 3, 4]] == -1).all()  # untouched
        assert pull_blocks(remote, local, [], []).num_blocks == 0
        remote.close()
        remote.close()  # idempotent
    assert owner.num_registered == 0  # the pool's close deregistered it
    reader.close()
    owner.close()
    assert (reader.num_registered, reader.num_peers, owner.num_peers) == (0, 0, 0)


class _CountingDescs:
    """A real agent that records how many descriptors each side of each transfer had."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self.sizes: list[int] = []

    def __getattr__(self, name):
        return getattr(self.agent, name)

    def get_xfer_descs(self, rows, mem):
        self.sizes.append(len(rows))
        return self.agent.get_xfer_descs(rows, mem)


@needs_nixl
def test_blocks_adjacent_on_both_sides_move_as_one_descriptor_per_run(nixl_endpoints) -> None:
    """A run of blocks (ascending or descending on both sides) is one NIXL descriptor on each
    side; blocks adjacent on one side only are one each. Every byte lands either way."""
    owner = nixl_endpoints()
    reader = nixl_endpoints(_CountingDescs)
    counting = reader.agent
    with owner_pool(owner, 16, torch.bfloat16) as pool, \
            reader.connect(pool.descriptor) as remote:
        local = local_blocks(12, torch.bfloat16)
        src = [2, 3, 4, 5, 11, 10, 9, 14]
        dst = [0, 1, 2, 3, 8, 7, 6, 11]  # runs: 2..5 -> 0..3, 9..11 -> 6..8, 14 -> 11
        remote.pull(local, src, dst)
        assert counting.sizes == [3, 3]  # local and remote descriptors
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(local[d], pool.tensor[s])
        assert (local[[4, 5, 9, 10]] == -1).all()
        counting.sizes.clear()
        remote.pull(local, [1, 2, 3], [5, 4, 9])  # adjacent on the source side only
        assert counting.sizes == [3, 3]
        for s, d in ((1, 5), (2, 4), (3, 9)):
            assert torch.equal(local[d], pool.tensor[s])


@needs_nixl
def test_push_writes_scattered_blocks_into_the_peers_pool_exactly(nixl_endpoints) -> None:
    """A push (one NIXL WRITE) lands blocks of the local pool in the given blocks of the
    peer's, and nothing else; ids are checked by name first (the written ones distinct)."""
    owner, writer = nixl_endpoints(), nixl_endpoints()
    with owner_pool(owner, 8, torch.bfloat16) as pool, \
            writer.connect(pool.descriptor) as remote:
        before = pool.tensor.clone()
        local = local_blocks(6, torch.bfloat16)
        fill(local, salt=7)
        remote.push(local, [5, 0, 2], [4, 1, 3])
        for src, dst in ((5, 4), (0, 1), (2, 3)):
            assert torch.equal(pool.tensor[dst], local[src])
        for b in (0, 2, 5, 6, 7):
            assert torch.equal(pool.tensor[b], before[b])  # untouched
        for src, dst, name in (([6], [0], "src_block_ids"), ([0], [8], "dst_block_ids"),
                               ([0, 1], [2, 2], "dst_block_ids")):
            with pytest.raises(InvalidArgument, match=f"^{name}"):
                remote.push(local, src, dst)
    writer.close()
    owner.close()


@needs_nixl
def test_pull_refuses_bad_ids_and_layouts_by_name_before_any_transfer(
        nixl_endpoints) -> None:
    owner, reader = nixl_endpoints(), nixl_endpoints()
    with owner_pool(owner, 4) as pool, reader.connect(pool.descriptor) as remote:
        local = local_blocks(4)
        for src, dst, name in (([4], [0], "src_block_ids"), ([0], [4], "dst_block_ids"),
                               ([0, 1], [2, 2], "dst_block_ids"), ([0], [], "dst_block_ids"),
                               ([-1], [0], "src_block_ids")):
            with pytest.raises(InvalidArgument, match=f"^{name}"):
                remote.pull(local, src, dst)
        with pytest.raises(InvalidArgument, match=r"^local"):
            remote.pull(local_blocks(4, torch.float32), [0], [0])
        assert reader.num_registered == 0  # refused before registering anything
        assert (local == -1).all()


@needs_nixl
def test_concurrent_pulls_from_two_pools_land_in_their_own_blocks(nixl_endpoints) -> None:
    a, b, reader = nixl_endpoints(), nixl_endpoints(), nixl_endpoints()
    with owner_pool(a, 16) as pa, owner_pool(b, 16) as pb:
        fill(pb.tensor, salt=7)
        ra, rb = reader.connect(pa.descriptor), reader.connect(pb.descriptor)
        local = local_blocks(64)
        # 8 threads, each its own 8 destination blocks: (pool, src ids, dst ids)
        jobs = [((ra, pa) if t % 2 == 0 else (rb, pb), [(t * 5 + k * 3) % 16 for k in range(8)],
                 list(range(t * 8, t * 8 + 8))) for t in range(8)]
        start = threading.Barrier(len(jobs))
        errors: list[BaseException] = []

        def run(remote, src, dst) -> None:
            try:
                start.wait()
                for _ in range(3):
                    remote.pull(local, src, dst)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(r, s, d)) for (r, _), s, d in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for (_, owner), src, dst in jobs:
            for s, d in zip(src, dst):
                assert torch.equal(local[d], owner.tensor[s])
        ra.close()
        rb.close()
    assert reader.num_peers == 0


@needs_nixl
def test_the_process_endpoint_runs_a_progress_thread_only_where_it_serves(monkeypatch) -> None:
    """A decode worker's endpoint (made by opening a peer's pool) reads without NIXL's progress
    thread and then refuses to serve a pool, by a message; a prefill worker's (made by
    allocating its pool) runs the thread, and reads through it too."""
    from tandem.kvtransfer import nixl

    monkeypatch.setattr(nixl, "_default", None)
    reader = nixl.default_endpoint(serves=False)
    try:
        assert not reader.progress_thread and nixl.default_endpoint(serves=False) is reader
        with pytest.raises(RuntimeError, match="made to read only"):
            allocate_pool(num_blocks=2, dtype=torch.float16, device="cpu", transport="nixl",
                          **SHAPE)
        assert reader.num_registered == 0
    finally:
        reader.close()
    server = nixl.default_endpoint(serves=True)  # the closed one is replaced
    try:
        assert server is not reader and server.progress_thread
        assert nixl.default_endpoint(serves=False) is server
    finally:
        server.close()
        monkeypatch.setattr(nixl, "_default", None)


def test_a_prefill_worker_without_the_package_exits_naming_the_extra(tmp_path) -> None:
    """`tandem prefill --transport nixl` where nixl cannot be imported (a package shadowing it
    raises ImportError, in the worker and in its engine core alike): it exits non-zero and says
    which extra to install."""
    shadow = tmp_path / "shadow" / "nixl"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no NIXL here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(shadow.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", "prefill", "--model", "tandem-demo", "--device", "cpu",
         "--transport", "nixl", "--port", "0", "--num-blocks", "16", "--cpu-threads", "1"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
    assert proc.returncode != 0
    assert "tandem[nixl]" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
