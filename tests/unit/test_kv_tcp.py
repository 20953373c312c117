"""The tcp transport (kvtransfer/tcp.py) on 127.0.0.1: a pool served by its owner, pulled in
block runs into another pool, only blocks of a live lease, every message bounded, errors naming
the field, mutual TLS with the cluster's certificates, and nothing left serving after close."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch

from tandem.cli.certs import make_cluster_ca
from tandem.errors import InvalidArgument
from tandem.kvtransfer import tcp
from tandem.kvtransfer.descriptor import PoolDescriptor
from tandem.kvtransfer.lease import LeaseTable
from tandem.kvtransfer.pool import allocate_pool
from tandem.kvtransfer.remote import open_remote_pool, pull_blocks
from tandem.kvtransfer.transports import SiteTls, WorkerSite
from tandem.runtime.cluster_roles import peer_name, spiffe_id

LAYOUT = dict(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
NUM_BLOCKS = 8


@pytest.fixture
def table():
    return LeaseTable()


def _owner(lease_blocks, tls=None):
    pool = allocate_pool(num_blocks=NUM_BLOCKS, device="cpu", transport="tcp",
                         site=WorkerSite("127.0.0.1", tls, lease_blocks), **LAYOUT)
    # Each block's values tell it apart.
    pool.tensor.copy_(torch.arange(pool.tensor.numel()).view(pool.tensor.shape).half())
    return pool


@pytest.fixture
def owner(table):
    pool = _owner(table.blocks)
    yield pool
    pool.close()


def _local(num_blocks=6):
    return torch.zeros(num_blocks, LAYOUT["num_layers"], 2, LAYOUT["block_size"],
                       LAYOUT["num_kv_heads"], LAYOUT["head_dim"], dtype=torch.float16)


def _serving_threads():
    return [t for t in threading.enumerate() if t.name.startswith("tcp-kv-")
            and t.name != "tcp-kv-pull" and not t.name.startswith("tcp-kv-pull_")]


def test_pulls_block_runs_of_a_lease_and_closes_clean(owner, table):
    lease = table.grant([1, 2, 3, 6], ttl_s=60, now=time.monotonic())
    remote = open_remote_pool(owner.descriptor, "cpu")
    local = _local()
    src, dst = [6, 1, 2, 3], [0, 3, 4, 5]  # a lone block, then a run of three
    stats = pull_blocks(remote, local, src, dst, lease_id=lease)
    assert torch.equal(local[dst], owner.tensor[src])
    assert local[[1, 2]].count_nonzero() == 0  # nothing else written
    assert (stats.num_blocks, stats.bytes) == (4, 4 * owner.descriptor.block_bytes)
    # The connection is kept: a second pull of the same lease reuses it.
    pull_blocks(remote, local, [2], [1], lease_id=lease)
    assert torch.equal(local[1], owner.tensor[2])
    remote.close()
    owner.close()
    assert _serving_threads() == []
    with pytest.raises(OSError):  # nobody listens any more
        socket.create_connection(("127.0.0.1", tcp.TcpHandle.unpack(
            owner.descriptor.handle).port), timeout=5).close()


def test_refuses_blocks_outside_the_lease_and_leases_not_live(owner, table):
    lease = table.grant([1, 2], ttl_s=60, now=time.monotonic())
    other = table.grant([4], ttl_s=60, now=time.monotonic())
    remote = open_remote_pool(owner.descriptor, "cpu")
    local = _local()
    with pytest.raises(tcp.PullRefused, match=r"^src_block_ids: block 4 is not one of the "
                                              r"lease's") as e:
        pull_blocks(remote, local, [1, 4], [0, 1], lease_id=lease)  # another lease's block
    assert e.value.field == "src_block_ids" and local.count_nonzero() == 0
    with pytest.raises(tcp.PullRefused, match=r"^lease_id: no live lease"):
        pull_blocks(remote, local, [1], [0], lease_id="f" * 32)
    table.release(other)
    with pytest.raises(tcp.PullRefused, match=r"^lease_id: no live lease"):
        pull_blocks(remote, local, [4], [0], lease_id=other)  # released: opens nothing
    pull_blocks(remote, local, [2, 1], [0, 1], lease_id=lease)  # refusals leave it usable
    assert torch.equal(local[[0, 1]], owner.tensor[[2, 1]])
    remote.close()


def test_a_lease_that_ends_mid_send_fails_the_pull(table):
    """The owner looks at the lease again once the blocks went: gone meanwhile, the reader is
    told to discard them (they may be another prompt's by now)."""
    lease = table.grant([0, 1], ttl_s=60, now=time.monotonic())
    looks = []

    def lease_blocks(lease_id):
        looks.append(lease_id)
        return table.blocks(lease_id) if len(looks) == 1 else None  # released during the send

    owner = _owner(lease_blocks)
    remote = open_remote_pool(owner.descriptor, "cpu")
    with pytest.raises(tcp.PullRefused, match=r"^lease_id: the lease ended while its blocks"):
        pull_blocks(remote, _local(), [0, 1], [0, 1], lease_id=lease)
    assert looks == [lease, lease]
    remote.close()
    owner.close()


def _raw_request(owner, token=None, lease=b"a" * 32, count=None, ids=(0,), magic=tcp.MAGIC):
    handle = tcp.TcpHandle.unpack(owner.descriptor.handle)
    with socket.create_connection(("127.0.0.1", handle.port), timeout=30) as s:
        s.sendall(tcp._HEAD.pack(magic, token or handle.token, len(lease)) + lease
                  + struct.pack("!I", len(ids) if count is None else count)
                  + struct.pack(f"!{len(ids)}I", *ids))
        reply = b""
        try:
            while chunk := s.recv(4096):  # the owner closes the connection after these
                reply += chunk
        except ConnectionResetError:  # closed with our bytes unread: nothing was answered
            assert reply == b""
    return reply


def _refusal(reply):
    status, length = tcp._REPLY.unpack_from(reply)
    assert status == tcp.REFUSED and len(reply) == tcp._REPLY.size + length  # then closed
    return reply[tcp._REPLY.size:].decode()


def test_every_message_is_bounded(owner, table):
    """A peer's numbers never size an allocation: a count past the pool, a long lease id, a
    wrong token or protocol are refused (by field) and the connection closed before the rest
    of the message is read."""
    lease = table.grant([0], ttl_s=60, now=time.monotonic()).encode()
    too_many = _raw_request(owner, lease=lease, count=2**32 - 1, ids=())
    assert _refusal(too_many) == f"src_block_ids: at most {NUM_BLOCKS} blocks a pull, got " \
                                 f"{2**32 - 1}"
    assert _refusal(_raw_request(owner, lease=b"x" * 200)).startswith(
        f"lease_id: must be 1 to {tcp.MAX_LEASE_ID} bytes, got 200")
    assert _refusal(_raw_request(owner, lease=lease, token=b"\0" * 16)) == \
        "handle: does not open this pool"
    assert _raw_request(owner, lease=lease, magic=b"GET ") == b""  # not ours: closed
    ok = _raw_request_keep(owner, lease)
    assert ok == owner.descriptor.block_bytes


def _raw_request_keep(owner, lease):
    """A good request by hand: OK, one block, then the lease-kept byte (connection kept)."""
    handle = tcp.TcpHandle.unpack(owner.descriptor.handle)
    with socket.create_connection(("127.0.0.1", handle.port), timeout=30) as s:
        s.sendall(tcp._HEAD.pack(tcp.MAGIC, handle.token, len(lease)) + lease
                  + struct.pack("!II", 1, 0))
        want = tcp._REPLY.size + owner.descriptor.block_bytes + 1
        reply = b""
        while len(reply) < want:
            reply += s.recv(want - len(reply))
    assert reply[:tcp._REPLY.size] == tcp._REPLY.pack(tcp.OK, 0)
    assert reply[-1] == tcp.LEASE_KEPT
    assert reply[tcp._REPLY.size:-1] == owner.tensor[0].view(torch.uint8).numpy().tobytes()
    return len(reply) - tcp._REPLY.size - 1


def test_bad_descriptors_and_arguments_name_the_field(owner, table):
    desc = owner.descriptor
    fields = {k: getattr(desc, k) for k in ("dtype", "block_size", "num_layers",
                                            "num_kv_heads", "head_dim", "num_blocks",
                                            "owner_pid")}
    with pytest.raises(InvalidArgument, match=r"^device_index: a tcp pool is on the CPU"):
        PoolDescriptor(transport="tcp", handle=desc.handle, device_index=0, **fields)
    for handle in (b"short", desc.handle[:tcp._HANDLE.size], b"\0" * 19 + b"h"):
        with pytest.raises(InvalidArgument, match=r"^handle: "):
            open_remote_pool(PoolDescriptor(transport="tcp", handle=handle, device_index=-1,
                                            **fields), "cpu")
    with pytest.raises(InvalidArgument, match=r"^handle: the pool is served with cluster TLS"):
        open_remote_pool(desc, "cpu", WorkerSite(tls=SiteTls(b"", b"", b"")))
    with pytest.raises(InvalidArgument, match=r"^transport: a tcp pool is served by a "):
        allocate_pool(num_blocks=2, device="cpu", transport="tcp", **LAYOUT)  # no lease table
    lease = table.grant([1], ttl_s=60, now=time.monotonic())
    remote = open_remote_pool(desc, "cpu")
    cases = [(dict(local=_local().float()), "local"),
             (dict(dst=[9]), "dst_block_ids"), (dict(src=[8]), "src_block_ids"),
             (dict(dst=[0, 1]), "dst_block_ids"), (dict(lease_id=""), "lease_id")]
    for change, field in cases:
        args = dict(local=_local(), src=[1], dst=[0], lease_id=lease) | change
        with pytest.raises(InvalidArgument, match=rf"^{field}: "):
            pull_blocks(remote, args["local"], args["src"], args["dst"],
                        lease_id=args["lease_id"])
    remote.close()


class _Silent:
    """An owner that accepts and never answers (a stalled peer)."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.accepted = threading.Event()
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        conn, _ = self.listener.accept()
        self.conns.append(conn)
        self.accepted.set()

    def descriptor(self):
        handle = tcp.TcpHandle(b"t" * 16, self.listener.getsockname()[1], False, "127.0.0.1")
        return PoolDescriptor(dtype="float16", transport="tcp", handle=handle.pack(),
                              device_index=-1, owner_pid=1, num_blocks=NUM_BLOCKS,
                              **{k: v for k, v in LAYOUT.items() if k != "dtype"})

    def close(self):
        for c in self.conns:
            c.close()
        self.listener.close()


def test_puller_pulls_outside_the_stream_and_cancel_stops_a_stalled_read(owner, table):
    lease = table.grant([5, 6], ttl_s=60, now=time.monotonic())
    local = _local()
    puller = tcp.TRANSPORT.puller(local)
    remote = open_remote_pool(owner.descriptor, "cpu")
    pull = puller.start(remote, [5, 6], [2, 3], lambda: time.monotonic() + 60, lease)
    assert pull.outside_stream
    pull.wait()
    assert pull.done() and pull.stats().bytes == 2 * owner.descriptor.block_bytes
    assert torch.equal(local[[2, 3]], owner.tensor[[5, 6]])
    remote.close()

    silent = _Silent()
    stalled = open_remote_pool(silent.descriptor(), "cpu")
    pull = puller.start(stalled, [1], [0], lambda: time.monotonic() + 600, "a" * 32)
    assert silent.accepted.wait(30)  # the read is in flight
    pull.cancel()  # returns once nothing writes the blocks
    assert pull.future.done()
    with pytest.raises(RuntimeError):
        pull.done()
    assert pull.stats().bytes == 0
    stalled.close()
    silent.close()


def test_a_stalled_owner_times_out_at_the_lease_deadline():
    silent = _Silent()
    remote = open_remote_pool(silent.descriptor(), "cpu")
    with pytest.raises(TimeoutError):
        pull_blocks(remote, _local(), [1], [0], deadline=time.monotonic() + 0.5,
                    lease_id="a" * 32)
    remote.close()
    silent.close()


def test_mutual_tls_serves_decode_workers_alone(tmp_path, table):
    assert spiffe_id("decode", "d1").startswith(tcp.DECODE_IDENTITY)
    assert not spiffe_id("router").startswith(tcp.DECODE_IDENTITY)
    assert peer_name("prefill") == tcp.PREFILL_NAME
    certs = make_cluster_ca(tmp_path)
    owner = _owner(table.blocks, tls=SiteTls.read(certs.tls("prefill")))
    lease = table.grant([3], ttl_s=60, now=time.monotonic())
    remote = open_remote_pool(owner.descriptor, "cpu", WorkerSite(tls=SiteTls.read(certs.tls("decode"))))
    local = _local()
    pull_blocks(remote, local, [3], [0], lease_id=lease)
    assert torch.equal(local[0], owner.tensor[3])
    remote.close()
    # A router's certificate (signed by the same CA) opens nothing.
    router = open_remote_pool(owner.descriptor, "cpu", WorkerSite(tls=SiteTls.read(certs.tls("router"))))
    with pytest.raises((ConnectionError, OSError)):
        pull_blocks(router, local, [3], [1], lease_id=lease)
    router.close()
    owner.close()
    assert _serving_threads() == []
