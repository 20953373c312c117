"""The decode engine core's side of a handoff: the prefill pools it maps, the KV pulls from
them, and the leases it holds until their one LeaseDone.

    Add (with a lease) ─▶ hold ─▶ the engine admits the request ─▶ pull (or drop: it ended first)
                                                                     └─▶ settle: one LeaseDone,
                                                                         with the pull's figures

The engine calls `pull`, `drop` and `in_stream` (this object is its DecodeConnector's
transport side, engine/kv_connector.py); the worker turns each LeaseDone into a Release on the
prefill worker.

Every pull is one `Pull` in one list, from its start to its one settlement, whatever its
transport (kvtransfer/transports.py): the transport starts it (a Transfer) and says when it
ends. A copy done at once (shm, heads between tensor-parallel sizes) is settled at once; one
launched on the engine's stream (cuda_ipc) is settled once done (`poll`, each loop of the engine
core, in launch order; `flush` before the core idles, maps a peer's pool anew, or closes): the
next step, launched after it, reads the blocks in stream order, so pipelined steps go on. One
that completes outside the stream (NIXL) is returned to the engine, which polls it between steps
(its sequence is not scheduled meanwhile), and is settled when it ends.
"""

from __future__ import annotations

import contextlib
import time
from multiprocessing.connection import Connection
from typing import Any

from tandem.engine.sequence import RemoteKV
from tandem.engine.serving.core_messages import LeaseDone, LeasesRenewed, MapPool
from tandem.kvtransfer import transports
from tandem.kvtransfer.runs import block_runs


class KVPulls:
    def __init__(self, engine: Any, rank_kv: Any, events: Connection,
                 site: transports.WorkerSite | None = None) -> None:
        self.engine = engine  # its runner's pool and device, its tensor-parallel group
        self.site = site or transports.WorkerSite()  # how a transport dials peers (its TLS)
        # Rank 0's side of a handoff that moves heads between tensor-parallel sizes.
        self.rank_kv = rank_kv
        self.events = events
        # address -> (instance id, the peer's pool as its transport opened it): the pool of
        # the prefill process there now
        self.peers: dict[str, tuple[str, Any]] = {}
        # The leases this core owns, token -> request id, from Add until their one LeaseDone
        # (pulled, failed, or the request ended first): settled by popping.
        self.leases_held: dict[str, str] = {}
        # Held leases their prefill worker renewed since (LeasesRenewed): token -> deadline.
        self.renewed_deadlines: dict[str, float] = {}
        self.pulls: list[Pull] = []  # started and not ended, oldest first
        self.pullers: dict[str, Any] = {}  # transport name -> its puller into this pool
        self.blocks_pulled = self.bytes_pulled = self.runs_pulled = 0
        self.pull_seconds = 0.0
        # Of those, pulled from decode workers: running sequences moving here (live migration)
        self.blocks_migrated = self.migrations_in = 0

    def hold(self, kv: RemoteKV, request_id: str) -> None:
        self.leases_held[kv.lease_id] = request_id

    def renewed(self, cmd: LeasesRenewed) -> None:
        """The worker renewed these leases at their prefill workers: pulls wait until the new
        deadlines. Leases no longer held here are skipped."""
        for lease_id, deadline in cmd.deadlines:
            if lease_id in self.leases_held:
                old = self.renewed_deadlines.get(lease_id, 0.0)
                self.renewed_deadlines[lease_id] = max(old, deadline)

    def deadline(self, kv: RemoteKV) -> float:
        """The lease's deadline: the claim's, or its last renewal's."""
        return self.renewed_deadlines.get(kv.lease_id, kv.deadline)

    def map(self, cmd: MapPool) -> None:
        """Map a prefill worker's pool (once per address and instance: a worker restarted on
        the address has a new pool, which replaces the old one's mapping). `descriptor`: one
        pool, or a tensor-parallel prefill worker's pools in rank order; with tensor
        parallelism on either side every rank maps them all."""
        from tandem.kvtransfer.remote import open_remote_pool  # noqa: PLC0415 - torch, in the core only

        address, instance_id = cmd.address, cmd.instance_id
        descriptor = cmd.descriptor
        descs = list(descriptor) if isinstance(descriptor, (list, tuple)) else [descriptor]
        group = self.engine.tp_group
        if len(descs) > 1 or group is not None:
            self.peers.pop(address, None)
            if group is None:
                self.rank_kv.map(address, descs, instance_id)
            else:
                group.call("map", (address, descs, instance_id),
                           lambda: self.rank_kv.map(address, descs, instance_id))
            return
        self.rank_kv.peers.pop(address, None)
        descriptor = descs[0]
        old = self.peers.get(address)
        if old is not None and old[0] == instance_id:
            return
        self.flush()  # no copy still reads the mapping about to close
        device = transports.map_device(descriptor.transport, self.engine.runner.device)
        self.peers[address] = (instance_id, open_remote_pool(descriptor, device, self.site))
        if old is not None:
            with contextlib.suppress(Exception):
                old[1].close()

    def pull(self, kv: RemoteKV, src_block_ids: list[int], dst_block_ids: list[int]
             ) -> Pull | None:
        """Copy blocks src_block_ids of the lease (those of the prompt this worker's prefix
        cache does not hold: possibly none) into dst_block_ids; its lease is settled once the
        pull ends. Returns the Pull when it completes outside the engine's stream (the engine
        polls it), else None."""
        start_ns = time.time_ns()
        heads = kv.address in self.rank_kv.peers
        runs = 0 if heads else len(block_runs(src_block_ids, dst_block_ids) or ())
        transport = ""
        try:
            if heads:
                transfer, transport = self._pull_heads(kv, src_block_ids, dst_block_ids)
            else:
                transfer, transport = self._start(kv, src_block_ids, dst_block_ids)
        except Exception as e:
            self.settle(kv, pulled=True, start_ns=start_ns, end_ns=time.time_ns(),
                        num_blocks=len(src_block_ids), num_runs=runs, nbytes=0, seconds=0.0,
                        transport=transport, error=f"{type(e).__name__}: {e}")
            raise
        pull = Pull(self, kv, transfer, transport, len(src_block_ids), runs, start_ns)
        self.pulls.append(pull)
        if pull.outside:
            return pull
        self.poll()  # done at once (a CPU copy): settled now
        return None

    def _start(self, kv: RemoteKV, src_block_ids: list[int], dst_block_ids: list[int]
               ) -> tuple[Any, str]:
        """The pull started over the peer's transport, after the checks every one needs."""
        instance, pool = self.peers.get(kv.address, ("", None))
        if pool is None:
            raise RuntimeError(f"the KV pool of {kv.address} is not mapped")
        name = pool.descriptor.transport
        if instance != kv.instance_id:
            raise RuntimeError(f"the prefill worker at {kv.address} restarted: the "
                               "lease's KV went with it")
        if time.monotonic() > self.deadline(kv):
            raise TimeoutError("the prefill worker's lease ran out before the KV was pulled")
        puller = self.pullers.get(name)
        if puller is None:
            puller = self.pullers[name] = transports.load(name).puller(self.engine.runner.pool)
        return puller.start(pool, src_block_ids, dst_block_ids,
                            lambda: self.deadline(kv), kv.lease_id), name

    def _pull_heads(self, kv: RemoteKV, src_block_ids: list[int],
                    dst_block_ids: list[int]) -> tuple[Any, str]:
        """Tensor parallelism on either side: every rank copies its heads from the prefill
        ranks holding them (kvtransfer/tp_pull.py), done when this returns; the lease, one for
        every rank, is settled once all ranks are done."""
        from tandem.kvtransfer.remote import Finished, TransferStats  # noqa: PLC0415 - torch

        pools = self.rank_kv.peers.get(kv.address, ("", []))[1]
        name = pools[0].descriptor.transport if pools else ""
        args = (kv.address, kv.instance_id, src_block_ids, dst_block_ids)
        if time.monotonic() > self.deadline(kv):
            raise TimeoutError("the prefill worker's lease ran out before the KV was pulled")
        group = self.engine.tp_group
        local = lambda: self.rank_kv.pull(*args)  # noqa: E731
        stats = group.call("pull", args, local) if group is not None else [local()]
        return Finished(TransferStats(len(src_block_ids), sum(s.bytes for s in stats),
                                      max((s.seconds for s in stats), default=0.0))), name

    def in_stream(self, kv: RemoteKV) -> bool:
        """Whether kv's pull may start while a step is in flight: over any transport once its
        pool is mapped (a launch on the engine's stream, a CPU copy done when it returns, or a
        READ posted once the stream has passed the step and waited for by its sequence alone);
        not between tensor-parallel sizes."""
        if kv.address in self.rank_kv.peers:
            return False
        return self.peers.get(kv.address, ("", None))[1] is not None

    def poll(self) -> None:
        """Settle the pulls in the stream's order that are done (in launch order); those
        outside it are the engine's to poll."""
        for pull in [p for p in self.pulls if not p.outside]:
            if not pull.done():
                break

    def flush(self) -> None:
        """Wait for every pull (one outside the stream ends by its lease's deadline at the
        latest), and settle their leases."""
        for pull in [p for p in self.pulls if not p.outside]:
            pull.wait()
        while outside := [p for p in self.pulls if p.outside]:
            for pull in outside:
                with contextlib.suppress(Exception):  # its engine sees the error
                    pull.done()
            time.sleep(POLL_S if self.pulls else 0)

    def drop(self, kv: RemoteKV) -> None:
        self.settle(kv)

    def settle(self, kv: RemoteKV, **pull: Any) -> None:
        """The lease is done here: one LeaseDone (with the pull's figures, if one ran), once."""
        request_id = self.leases_held.pop(kv.lease_id, None)
        self.renewed_deadlines.pop(kv.lease_id, None)
        if pull.get("error") is None:
            self.blocks_pulled += pull.get("num_blocks", 0)
            self.bytes_pulled += pull.get("nbytes", 0)
            self.runs_pulled += pull.get("num_runs", 0)
            self.pull_seconds += pull.get("seconds", 0.0)
            if kv.handover and pull.get("pulled"):
                self.blocks_migrated += pull.get("num_blocks", 0)
                self.migrations_in += 1
        if request_id is not None:
            self.events.send(LeaseDone(request_id, kv.address, kv.lease_id, **pull))

    def close(self) -> None:
        """Unmap the peers' pools (those rank_kv maps are its own to close), once no copy
        reads them (pulls outside the stream cancelled)."""
        for pull in [p for p in self.pulls if p.outside]:
            with contextlib.suppress(Exception):
                pull.cancel()
        with contextlib.suppress(Exception):
            self.flush()
        for _, pool in self.peers.values():
            with contextlib.suppress(Exception):
                pool.close()


# How often `flush` looks at pulls outside the stream in flight.
POLL_S = 1e-4


class Pull:
    """One pull of a held lease's blocks, from its start to its one settlement: its
    transport's Transfer, and what its LeaseDone reports. The engine polls one that completes
    outside its stream (engine/sequence.py PendingPull: done, cancel)."""

    def __init__(self, owner: KVPulls, kv: RemoteKV, transfer: Any, transport: str,
                 num_blocks: int, runs: int, start_ns: int) -> None:
        self.owner, self.kv, self.transfer, self.transport = owner, kv, transfer, transport
        self.num_blocks, self.runs, self.start_ns = num_blocks, runs, start_ns
        self.outside: bool = transfer.outside_stream
        self.ended = False
        self.error: Exception | None = None

    def done(self) -> bool:
        """Whether it ended, without waiting; raises its error if it failed."""
        if self.ended:
            if self.error is not None:
                raise self.error
            return True
        try:
            finished = self.transfer.done()
        except Exception as e:
            self._end(e)
            raise
        if finished:
            self._end(None)
        return finished

    def wait(self) -> None:
        """Block until it ended (settled either way)."""
        with contextlib.suppress(Exception):  # recorded; done() raises it
            self.transfer.wait()
        with contextlib.suppress(Exception):
            self.done()

    def cancel(self) -> None:
        """Its request ended first: stopped, and settled with that as its error."""
        if not self.ended:
            self.transfer.cancel()
            self._end(RuntimeError("the request ended before its KV arrived"))

    def _end(self, error: Exception | None) -> None:
        self.ended, self.error = True, error
        self.owner.pulls.remove(self)
        stats = self.transfer.stats()
        self.owner.settle(self.kv, pulled=True, start_ns=self.start_ns, end_ns=time.time_ns(),
                          num_blocks=self.num_blocks, num_runs=self.runs,
                          nbytes=stats.bytes if error is None else 0, seconds=stats.seconds,
                          transport=self.transport,
                          error=None if error is None else f"{type(error).__name__}: {error}")
