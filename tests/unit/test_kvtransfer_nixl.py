"""The nixl transport on the CPU: DRAM pools registered with real NIXL agents (UCX over the
loopback device), pulls of scattered block ids, concurrent pulls, a cancelled pull, a pull past
its deadline, a transfer NIXL cannot cancel, and a peer process that vanished.

UCX is held to the loopback device here (UCX_NET_DEVICES=lo). Every test leaves each endpoint
with nothing registered and no peer loaded, and every transfer handle released exactly once.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtransfer.descriptor import PoolDescriptor
from kvtransfer.pool import allocate_pool
from kvtransfer.remote import pull_blocks
from tandem.errors import InvalidArgument

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before any agent exists: loopback only

REPO = Path(__file__).resolve().parents[2]
SHAPE = dict(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)


def _have_nixl() -> str | None:
    try:
        import nixl._api  # noqa: F401
    except ImportError as e:
        return f"the nixl package is not installed (pip install 'tandem[nixl]'): {e}"
    return None


NO_NIXL = _have_nixl()
needs_nixl = pytest.mark.skipif(NO_NIXL is not None, reason=NO_NIXL or "")


def _fill(pool: torch.Tensor, salt: int = 0) -> None:
    flat = pool.view(pool.shape[0], -1)
    i = torch.arange(flat.shape[1])
    for b in range(flat.shape[0]):
        flat[b] = ((b * 1009 + i + salt) % 251).to(pool.dtype)


def _local(num_blocks: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.full((num_blocks, SHAPE["num_layers"], 2, SHAPE["block_size"],
                       SHAPE["num_kv_heads"], SHAPE["head_dim"]), -1, dtype=dtype)


@pytest.fixture
def endpoints():
    """Fresh endpoints (one NIXL agent each, as two processes would have); checked clean and
    closed after the test."""
    from kvtransfer.nixl import NixlEndpoint

    made: list[NixlEndpoint] = []

    def make(agent_wrapper=None) -> NixlEndpoint:
        ep = NixlEndpoint()
        if agent_wrapper is not None:
            ep.agent = agent_wrapper(ep.agent)
        made.append(ep)
        return ep

    yield make
    for ep in reversed(made):  # readers before the owners they read from
        ep.close()


# --- handle and descriptor (no agent) -------------------------------------------------------


def test_handle_round_trips_and_garbage_is_refused_without_echoing_it() -> None:
    from kvtransfer.nixl import NixlHandle

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
    from kvtransfer import nixl

    monkeypatch.setitem(sys.modules, "nixl", None)  # import nixl raises ImportError
    with pytest.raises(nixl.NixlUnavailable, match=r"pip install 'tandem\[nixl\]'"):
        nixl.NixlEndpoint()
    monkeypatch.setattr(nixl, "_default", None)
    with pytest.raises(nixl.NixlUnavailable, match=r"tandem\[nixl\]"):
        allocate_pool(num_blocks=2, dtype=torch.float16, device="cpu", transport="nixl", **SHAPE)


# --- real agents ----------------------------------------------------------------------------


def _owner_pool(ep, num_blocks: int, dtype=torch.float16):
    """A pool made like allocate_pool(transport="nixl") does, on a given endpoint."""
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
    _fill(pool.tensor)
    return pool


@needs_nixl
def test_pull_moves_scattered_blocks_exactly_and_nothing_else(endpoints) -> None:
    owner, reader = endpoints(), endpoints()
    with _owner_pool(owner, 8, torch.bfloat16) as pool:
        remote = reader.connect(pool.descriptor)
        local = _local(6, torch.bfloat16)
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


@needs_nixl
def test_pull_refuses_bad_ids_and_layouts_by_name_before_any_transfer(endpoints) -> None:
    owner, reader = endpoints(), endpoints()
    with _owner_pool(owner, 4) as pool, reader.connect(pool.descriptor) as remote:
        local = _local(4)
        for src, dst, name in (([4], [0], "src_block_ids"), ([0], [4], "dst_block_ids"),
                               ([0, 1], [2, 2], "dst_block_ids"), ([0], [], "dst_block_ids"),
                               ([-1], [0], "src_block_ids")):
            with pytest.raises(InvalidArgument, match=f"^{name}"):
                remote.pull(local, src, dst)
        with pytest.raises(InvalidArgument, match=r"^local"):
            remote.pull(_local(4, torch.float32), [0], [0])
        assert reader.num_registered == 0  # refused before registering anything
        assert (local == -1).all()


@needs_nixl
def test_concurrent_pulls_from_two_pools_land_in_their_own_blocks(endpoints) -> None:
    a, b, reader = endpoints(), endpoints(), endpoints()
    with _owner_pool(a, 16) as pa, _owner_pool(b, 16) as pb:
        _fill(pb.tensor, salt=7)
        ra, rb = reader.connect(pa.descriptor), reader.connect(pb.descriptor)
        local = _local(64)
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

    def make_prepped_xfer(self, *args, **kwargs):
        handle = self.agent.make_prepped_xfer(*args, **kwargs)
        self.made.append(handle)
        return handle

    def release_xfer_handle(self, handle):
        if self.refuse and not self.gate.is_set():
            self.refused.set()
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.agent.release_xfer_handle(handle)
        k = next(i for i, h in enumerate(self.made) if h is handle)
        self.released[k] = self.released.get(k, 0) + 1


@needs_nixl
def test_a_cancelled_pull_releases_its_transfer_once_and_the_next_pull_works(endpoints) -> None:
    from kvtransfer.nixl import PullCancelled

    owner = endpoints()
    gated = None

    def wrap(agent):
        nonlocal gated
        gated = Gated(agent)
        return gated

    reader = endpoints(wrap)
    with _owner_pool(owner, 4) as pool, reader.connect(pool.descriptor) as remote:
        local = _local(4)
        cancel = threading.Event()
        cancel.set()
        with pytest.raises(PullCancelled):
            remote.pull(local, [1, 2], [0, 3], cancel=cancel)
        assert list(gated.released.values()) == [1]
        gated.gate.set()
        remote.pull(local, [3], [1])
        assert torch.equal(local[1], pool.tensor[3])
        assert list(gated.released.values()) == [1, 1]


@needs_nixl
def test_a_pull_past_its_deadline_times_out_and_releases_once(endpoints) -> None:
    owner = endpoints()
    gated = None

    def wrap(agent):
        nonlocal gated
        gated = Gated(agent)
        return gated

    reader = endpoints(wrap)
    with _owner_pool(owner, 4) as pool, reader.connect(pool.descriptor) as remote:
        with pytest.raises(TimeoutError, match="deadline"):
            remote.pull(_local(4), [0], [0], deadline=time.monotonic())
        assert list(gated.released.values()) == [1]


@needs_nixl
def test_a_transfer_that_cannot_be_cancelled_is_waited_for_before_the_pull_returns(
        endpoints) -> None:
    """The caller frees its destination blocks when pull raises: by then nothing may write
    into them."""
    from kvtransfer.nixl import PullCancelled

    owner = endpoints()
    gated = None

    def wrap(agent):
        nonlocal gated
        gated = Gated(agent, refuse_release_while_gated=True)
        return gated

    reader = endpoints(wrap)
    with _owner_pool(owner, 4) as pool, reader.connect(pool.descriptor) as remote:
        cancel = threading.Event()
        cancel.set()
        outcome: list[BaseException] = []
        returned = threading.Event()

        def run() -> None:
            try:
                remote.pull(_local(4), [0], [0], cancel=cancel)
            except BaseException as e:  # noqa: BLE001
                outcome.append(e)
            returned.set()

        t = threading.Thread(target=run)
        t.start()
        assert gated.refused.wait(30)  # cancelled, and NIXL refused to drop the transfer
        assert not returned.is_set()   # still waiting: the transfer is in flight (gated PROC)
        gated.gate.set()               # the transfer ends
        t.join()
        assert isinstance(outcome[0], PullCancelled)
        assert list(gated.released.values()) == [1]


_OWNER = textwrap.dedent("""
    import os, pickle, sys
    out = os.fdopen(os.dup(1), "wb")  # the descriptor goes here; NIXL's log lines to stderr
    os.dup2(2, 1)
    os.environ["UCX_NET_DEVICES"] = "lo"
    import torch
    sys.path.insert(0, sys.argv[1])
    from kvtransfer.pool import allocate_pool
    pool = allocate_pool(num_blocks=8, dtype=torch.float16, device="cpu", transport="nixl",
                         num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    pool.tensor.view(8, -1)[:] = torch.arange(8, dtype=torch.float16)[:, None]
    out.write(pickle.dumps(pool.descriptor))
    out.flush()
    sys.stdin.read()  # until the test closes our stdin (or kills us)
""")


@needs_nixl
def test_a_peer_process_that_vanished_fails_the_pull_instead_of_hanging(endpoints) -> None:
    """The owner is another process (UCX over loopback, as between two hosts' agents); once it
    is killed, a pull raises (NIXL's error, or the deadline) and releases its transfer."""
    from kvtransfer.nixl import TransferFailed

    child = subprocess.Popen([sys.executable, "-c", _OWNER, str(REPO)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        desc = pickle.load(child.stdout)
        assert desc.transport == "nixl" and desc.owner_pid == child.pid
        gated = None

        def wrap(agent):
            nonlocal gated
            gated = Gated(agent)
            gated.gate.set()
            return gated

        reader = endpoints(wrap)
        remote = reader.connect(desc)
        local = _local(8)
        remote.pull(local, [6, 2], [0, 1])
        assert (local[0] == 6).all() and (local[1] == 2).all()
        child.send_signal(signal.SIGKILL)
        child.wait()
        with pytest.raises((TransferFailed, TimeoutError)):
            remote.pull(local, [5], [2], deadline=time.monotonic() + 20)
        assert set(gated.released.values()) == {1}  # each transfer made released once
        assert len(gated.released) == len(gated.made)
        remote.close()
        assert reader.num_peers == 0
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()


@needs_nixl
def test_the_benchmarks_nixl_rows_move_the_right_bytes_on_the_cpu(monkeypatch) -> None:
    """benchmarks/kv_transfer.py --nixl runs unattended on a GPU box; its producer process and
    READ loop are the same code on host memory, checked here."""
    import argparse
    import random

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # the producer process imports it too
    from kv_transfer import measure_nixl

    shape = dict(num_blocks=32, **SHAPE)
    rng = random.Random(1)
    rows = measure_nixl(argparse.Namespace(warmup=1, repeats=2), "cpu", "cpu", shape,
                        "bfloat16", rng.sample(range(32), 9), rng.sample(range(32), 9))
    assert set(rows) == {"nixl READ (NixlRemotePool.pull)", "nixl READ, contiguous blocks"}
    assert all(r["correct"] and r["gbps"] > 0 for r in rows.values()), rows


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
        [sys.executable, "-m", "cli.main", "prefill", "--model", "tandem-demo", "--device", "cpu",
         "--transport", "nixl", "--port", "0", "--num-blocks", "16", "--cpu-threads", "1"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
    assert proc.returncode != 0
    assert "tandem[nixl]" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
