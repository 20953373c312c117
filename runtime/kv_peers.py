"""The peers whose KV pools a worker's engine core maps and pulls from, as its servicer sees
them: a decode worker's prefill workers (and the decode workers that lend it a moving
sequence), and any worker's lenders of a cached prefix (LendPrefix).

    peer(address, instance, role) ── Register (once per peer process) ──▶ the pool's descriptor,
                                     checked, then mapped in the engine core (MapPool)
    claim_prefix(kv, prompt, salt) ── ClaimLease ──▶ the lent prefix's blocks, checked against
                                     this prompt's tokens and cache salt (a RemoteKV, or None:
                                     computed here instead)
    spawn_release(address, token) ── Release ──▶ once the core is done with the lease

One channel per peer, dialed with cluster TLS as the role its lease names (a prefill worker's
certificate, or a decode worker's): whoever answers at an address must prove, with its key, to
be one. Without cluster TLS a peer is taken only on this machine's loopback (unless
--insecure), and its pool only from the process that owns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from typing import Any

import grpc

from tandem.engine.sequence import RemoteKV
from tandem.errors import InvalidArgument
from tandem.kvtransfer.descriptor import check_compatible
from tandem.kvtransfer.lease import prefix_digest
from tandem.runtime.convert import descriptor_from_proto
from tandem.runtime.lifecycle import GRPC_OPTIONS
from tandem.runtime.local_peers import loopback_ips, pool_owner_listens, split_address
from tandem.runtime.request_trace import client_call
from tandem.runtime.security import internal_channel
from tandem.runtime.worker import WorkerError
from tandem.runtime.worker_inputs import check_kv
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# Pull only while the lease has this much time left: its lender reuses blocks of an expired
# lease, and the request may wait for room here before its pull.
LEASE_MARGIN_S = 2.0
# How long a call to a peer first waits for this worker's channel to it to connect. A peer the
# router just heard from (it granted the lease) may be one this channel last saw down, back on
# its port after a restart: gRPC dials a failed peer again only after its backoff (at most
# ~1.2 s with GRPC_OPTIONS), and a call made before then fails at once with the old error.
PEER_CONNECT_S = 3.0


async def connected(channel: grpc.aio.Channel, within: float = PEER_CONNECT_S) -> None:
    """Return once `channel` is READY (at once, without yielding, when it is), or after
    `within` seconds (the call that follows then fails as it would have, with the channel's
    own error). A cancel of the caller while it waits propagates (asyncio.timeout, not
    Python 3.11's wait_for, which returns instead when its awaitable finished meanwhile)."""
    if channel.get_state() == grpc.ChannelConnectivity.READY:
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(within):
            await channel.channel_ready()


class PeerPools:
    """Owned by a worker's servicer (`owner`: its engine, worker id, telemetry, cluster TLS
    and --insecure, read when used: the worker sets them after making the servicer)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.layout = worker_pb2.PoolDescriptor(**owner.engine.info.layout)
        # peer address -> the instance (process) whose pool the engine core mapped
        self.peers: dict[str, str] = {}
        self._pool_addresses: dict[bytes, str] = {}  # a mapped pool's handle -> its address
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._roles: dict[str, str] = {}  # a peer's address -> its role (TLS name)
        self._background: set[asyncio.Task] = set()

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        ch = self._channels.get(address)
        if ch is None:
            # With cluster TLS only a certificate of the role the lease names is accepted
            # here (a prefill worker's; a decode worker's for a running sequence it lends):
            # whoever answers at an address a lease names must prove, with its key, to be one.
            role = self._roles.get(address, "prefill")
            ch = self._channels[address] = internal_channel(address, self.owner.cluster_tls,
                                                            GRPC_OPTIONS, role)
        return worker_pb2_grpc.WorkerStub(ch)

    async def connected_stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        """stub(address), once its channel is connected (`connected`): for the calls a
        request waits on (Register, ClaimLease)."""
        stub = self.stub(address)
        await connected(self._channels[address])
        return stub

    async def peer(self, address: str, instance_id: str, role: str = "prefill") -> None:
        """Register with the worker at `address` and map its pool in the engine core, on first
        use and again once the worker there restarted (a new instance has a new pool). A lease
        from an instance that is gone fails its request: its KV went with it. `role`: the
        peer's (a decode worker lends running sequences); an address keeps the role it was
        first dialed as."""
        if self._roles.setdefault(address, role) != role:
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION, f"kv.role: {address} is "
                              f"a {self._roles[address]} worker, not {role}")
        if self.peers.get(address) == instance_id or (not instance_id and address in self.peers):
            return  # mapped (a lease naming no instance is for the claim to judge)
        async with self._peer_locks.setdefault(address, asyncio.Lock()):
            if address not in self.peers or (instance_id and self.peers[address] != instance_id):
                with self.owner.telemetry.tracer.start_as_current_span(
                        "kv_pool_registration", attributes={
                            "tandem.kv.source": address,
                            # Charged to the request that happened to come first.
                            "tandem.kv.registration": "once per peer worker instance"}):
                    await self._register(address)
        if instance_id and self.peers[address] != instance_id:
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"worker {address} restarted "
                              "since it granted the lease")

    async def _register(self, address: str) -> None:
        """Ask the worker at `address` for its pool's descriptor and map it."""
        self._check_plaintext_peer(address)
        with client_call("/tandem.v1.Worker/Register", address) as call:
            resp = await (await self.connected_stub(address)).Register(worker_pb2.RegisterRequest(
                decode_worker_id=self.owner.worker_id, layout=self.layout), timeout=30,
                metadata=call.metadata)
        desc = descriptor_from_proto(resp.pool)
        # A tensor-parallel prefill worker: its ranks' pools, each checked.
        descs = [desc, *(descriptor_from_proto(d) for d in resp.rank_pools)]
        for d in descs:
            check_compatible(self.layout, d)
        if len(descs) != max(1, desc.tensor_parallel_size):
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"worker {address} described {len(descs)} pools "
                              f"for {desc.tensor_parallel_size} ranks")
        await self._check_pool_owner(address, desc.owner_pid)
        # One address per pool: a peer presenting a pool mapped for another would answer
        # claims for that pool's blocks itself. Unless the pool's owner listens here now: a
        # worker that changed role in place (runtime/role_switch.py) keeps its pool and
        # serves at a new address.
        known = self._pool_addresses.setdefault(desc.handle, address)
        if known != address and not await asyncio.to_thread(pool_owner_listens,
                                                             desc.owner_pid, address):
            log.warning("refused %s: it presents the pool of %s", address, known)
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"worker {address} presents the KV pool of another "
                              "worker")
        self._pool_addresses[desc.handle] = address
        await self.owner.engine.map_pool(address, descs if len(descs) > 1 else desc,
                                         resp.instance_id)
        self.peers[address] = resp.instance_id
        log.info("mapped the KV pool of %s (%s)", resp.prefill_worker_id, desc.redacted())

    def _check_plaintext_peer(self, address: str) -> None:
        """Without cluster TLS nobody proves a role: a peer is then taken only on this machine
        (unless --insecure), and its pool only from the process that owns it
        (_check_pool_owner)."""
        if self.owner.cluster_tls is not None or self.owner.insecure:
            return
        try:
            host, _ = split_address(address)
        except ValueError:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT,
                              "kv.address: not host:port") from None
        if loopback_ips(host) is None:
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"worker {address} is not on this machine's loopback: "
                              "without cluster TLS a worker takes KV from other hosts only "
                              "with --insecure")

    async def _check_pool_owner(self, address: str, owner_pid: int) -> None:
        """Without cluster TLS, a pool is mapped only when the process that owns it listens at
        the address dialed (runtime/local_peers.py), not whoever answers there. The lookup
        reads /proc: off the event loop."""
        if self.owner.cluster_tls is not None or self.owner.insecure:
            return
        if not await asyncio.to_thread(pool_owner_listens, owner_pid, address):
            log.warning("refused %s: it presents a KV pool it does not own", address)
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"worker {address} presents the KV pool of another "
                              "process (its owner does not listen there)")

    # -- a lent prefix -------------------------------------------------------------------------
    async def claim_prefix(self, kv: worker_pb2.KVLocation, prompt: list[int],
                           cache_salt: str) -> RemoteKV | None:
        """The prefix of `prompt` another worker lent (LendPrefix, handed here by the router),
        claimed and its lender's pool mapped: what the engine core pulls instead of computing
        it. None when it cannot be (its lender gone or restarted, the lease refused, run out,
        or not a prefix of this prompt under this salt): the prompt is then computed whole.
        Every lease handed here is released once, here or (for the RemoteKV returned) after
        the core's LeaseDone, except one whose claim its lender refused (never ours)."""
        if not kv.address or not kv.lease_id:  # (its fields' bounds: check_kv, on arrival)
            return None
        claimed = False
        try:
            await self.peer(kv.address, kv.instance_id, kv.role or "prefill")
            sent = time.monotonic()
            with client_call("/tandem.v1.Worker/ClaimLease", kv.address) as call:
                resp = await (await self.connected_stub(kv.address)).ClaimLease(
                    worker_pb2.ClaimLeaseRequest(lease_id=kv.lease_id), timeout=10,
                    metadata=call.metadata)
            claimed = True
            n, bs = resp.num_tokens, self.layout.block_size
            if not 0 < n < len(prompt) or resp.prompt_digest != prefix_digest(prompt[:n],
                                                                              cache_salt):
                raise ValueError("the lease holds no prefix of this prompt under its salt")
            if n % bs or len(resp.block_ids) != n // bs:  # what the engine would refuse
                raise ValueError(f"{len(resp.block_ids)} blocks for {n} tokens")
            deadline = sent + resp.ttl_ms / 1000 - LEASE_MARGIN_S
            if deadline <= time.monotonic():
                raise TimeoutError(f"the lease has {resp.ttl_ms} ms left")
        except BaseException as e:
            # Its lender refused the claim (never ours), or it names no address to reach: not
            # released. Else ours (or maybe: a claim cut short) to give back.
            refused = (isinstance(e, grpc.aio.AioRpcError)
                       and e.code() == grpc.StatusCode.FAILED_PRECONDITION and not claimed)
            nowhere = isinstance(e, WorkerError) and e.code == grpc.StatusCode.INVALID_ARGUMENT
            if not refused and not nowhere:
                self.spawn_release(kv.address, kv.lease_id)
            if not isinstance(e, Exception):
                raise  # cancelled: the request is gone
            log.warning("a prefix lent by %s is not used (%s): computing it", kv.address,
                        e.details() if isinstance(e, grpc.aio.AioRpcError) else e)
            return None
        return RemoteKV(kv.address, kv.lease_id, deadline, tuple(resp.block_ids), (), (),
                        instance_id=kv.instance_id, num_tokens=n, prefix=True)

    def let_go(self, kv: worker_pb2.KVLocation) -> None:
        """A lent prefix handed here and not used (its request refused, or one that computes its
        prompt whole): released unclaimed, if it names one within the fields' bounds."""
        try:
            check_kv(kv, "prefix_kv")
        except InvalidArgument:
            return
        if kv.address and kv.lease_id:
            self.spawn_release(kv.address, kv.lease_id)

    # -- releases ------------------------------------------------------------------------------
    def spawn_release(self, address: str, lease_id: str,
                      context: contextvars.Context | None = None) -> None:
        # In the request's context: the Release call joins its trace, its log lines its id.
        task = asyncio.get_running_loop().create_task(self._release(address, lease_id),
                                                      context=context)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, address: str, lease_id: str) -> None:
        try:
            with client_call("/tandem.v1.Worker/Release", address) as call:
                resp = await self.stub(address).Release(
                    worker_pb2.ReleaseRequest(lease_id=lease_id), timeout=10, metadata=call.metadata)
            if not resp.released:
                log.warning("lease at %s had already ended when released", address)
        except grpc.aio.AioRpcError as e:
            log.warning("release at %s failed: %s (the lease will expire)", address,
                        e.code().name)
        except Exception as e:  # noqa: BLE001 - an address no channel can be made to
            log.warning("release at %s failed: %s (the lease will expire)", address,
                        type(e).__name__)

    async def close(self) -> None:
        """The server stopped: the releases under way finish, then the channels close."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for ch in self._channels.values():
            with contextlib.suppress(Exception):
                await ch.close()
