"""The decode engine core's side of a handoff: the prefill pools it maps, the KV pulls from
them, and the leases it holds until their one LeaseDone.

    Add (with a lease) ─▶ hold ─▶ the engine admits the request ─▶ pull (or drop: it ended first)
                                                                     └─▶ settle: one LeaseDone,
                                                                         with the pull's figures

The engine calls `pull` and `drop` (the puller and dropper of its PromptPulls,
engine/kv_handoff.py); the worker turns each LeaseDone into a Release on the prefill worker.

A pull over CUDA IPC is launched on the engine's stream and not waited for (`launch_pull`): the
next step, launched after it, reads the blocks in stream order, so pipelined steps go on
(`in_stream`, which the engine asks); its lease is settled once the copy is done (`poll`, each
loop of the engine core; `flush` before the core idles, maps a peer's pool anew, or closes).

A pull over NIXL completes outside the stream: it is a `NixlPull` the engine polls between
steps (its sequence is not scheduled meanwhile; engine/kv_handoff.py), so the steps of the
other requests go on while it moves. Its READ is posted once the stream has passed the point
where the pull was made (a step in flight may still write blocks freed since) and the pulls
before it are posted, with no more bytes in flight than the link moves in about a second
(NIXL_INFLIGHT_S), and its lease is settled when it ends.
"""

from __future__ import annotations

import contextlib
import time
from multiprocessing.connection import Connection
from typing import Any

from engine.sequence import RemoteKV
from engine.serving.core_messages import LeaseDone, LeasesRenewed, MapPool
from kvtransfer.runs import block_runs


class KVPulls:
    def __init__(self, engine: Any, rank_kv: Any, events: Connection) -> None:
        self.engine = engine  # its runner's pool and device, its tensor-parallel group
        # Rank 0's side of a handoff that moves heads between tensor-parallel sizes.
        self.rank_kv = rank_kv
        self.events = events
        # address -> (instance id, RemotePool): the pool of the prefill process there now
        self.peers: dict[str, tuple[str, Any]] = {}
        # The leases this core owns, token -> request id, from Add until their one LeaseDone
        # (pulled, failed, or the request ended first): settled by popping.
        self.leases_held: dict[str, str] = {}
        # Held leases their prefill worker renewed since (LeasesRenewed): token -> deadline.
        self.renewed_deadlines: dict[str, float] = {}
        self.outside: list[NixlPull] = []  # NIXL pulls not ended, oldest first
        # Bytes a second the last NIXL pulls moved (posting to seen done; a running average):
        # how many bytes may be in flight at once (NixlPull.may_post)
        self.nixl_rate: float | None = None
        self.blocks_pulled = self.bytes_pulled = self.runs_pulled = 0
        self.pull_seconds = 0.0
        # (lease, start ns, PendingPull, runs)
        self.pending: list[tuple[RemoteKV, int, Any, int]] = []

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
        from kvtransfer.remote import open_remote_pool  # noqa: PLC0415 - torch, in the core only

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
        device = "cpu" if descriptor.transport == "shm" else self.engine.runner.device
        self.peers[address] = (instance_id, open_remote_pool(descriptor, device))
        if old is not None:
            with contextlib.suppress(Exception):
                old[1].close()

    def pull(self, kv: RemoteKV, src_block_ids: list[int], dst_block_ids: list[int]
             ) -> NixlPull | None:
        """Copy blocks src_block_ids of the lease (those of the prompt this worker's prefix
        cache does not hold: possibly none) into dst_block_ids, then settle the lease; over
        NIXL, start it and return the NixlPull to poll."""
        from kvtransfer.remote import pull_blocks  # noqa: PLC0415 - torch, in the core only

        if kv.address in self.rank_kv.peers:
            return self._pull_heads(kv, src_block_ids, dst_block_ids)
        start_ns = time.time_ns()
        stats = error = None
        runs = len(block_runs(src_block_ids, dst_block_ids) or ())
        instance, pool = self.peers.get(kv.address, ("", None))
        try:
            if pool is None:
                raise RuntimeError(f"the KV pool of {kv.address} is not mapped")
            if instance != kv.instance_id:
                raise RuntimeError(f"the prefill worker at {kv.address} restarted: the "
                                   "lease's KV went with it")
            if time.monotonic() > self.deadline(kv):
                raise TimeoutError("the prefill worker's lease ran out before the KV was pulled")
            if pool.descriptor.transport == "cuda_ipc":  # in stream order; settled when done
                from kvtransfer.remote import launch_pull  # noqa: PLC0415 - torch, in the core

                self.pending.append((kv, start_ns, launch_pull(
                    pool, self.engine.runner.pool, src_block_ids, dst_block_ids), runs))
                return None
            if pool.descriptor.transport == "nixl" and src_block_ids:  # polled by the engine
                pull = NixlPull(self, kv, pool, src_block_ids, dst_block_ids, runs, start_ns)
                self.outside.append(pull)
                return pull
            stats = pull_blocks(pool, self.engine.runner.pool, src_block_ids, dst_block_ids,
                                deadline=self.deadline(kv))
            return None
        except Exception as e:
            error = e
            raise
        finally:
            if error is not None or stats is not None:  # else started: settled when done
                self.settle(kv, pulled=True, start_ns=start_ns, end_ns=time.time_ns(),
                            num_blocks=len(src_block_ids), num_runs=runs,
                            nbytes=stats.bytes if stats else 0,
                            seconds=stats.seconds if stats else 0.0,
                            transport=pool.descriptor.transport if pool is not None else "",
                            error=f"{type(error).__name__}: {error}" if error is not None
                            else None)

    def _pull_heads(self, kv: RemoteKV, src_block_ids: list[int],
                    dst_block_ids: list[int]) -> None:
        """Tensor parallelism on either side: every rank copies its heads from the prefill
        ranks holding them (kvtransfer/tp_pull.py); the lease, one for every rank, is settled
        once all ranks are done."""
        start_ns = time.time_ns()
        stats: list[Any] = []
        error = None
        args = (kv.address, kv.instance_id, src_block_ids, dst_block_ids)
        try:
            if time.monotonic() > self.deadline(kv):
                raise TimeoutError("the prefill worker's lease ran out before the KV was pulled")
            group = self.engine.tp_group
            local = lambda: self.rank_kv.pull(*args)  # noqa: E731
            stats = group.call("pull", args, local) if group is not None else [local()]
        except Exception as e:
            error = e
            raise
        finally:
            pools = self.rank_kv.peers.get(kv.address, ("", []))[1]
            self.settle(kv, pulled=True, start_ns=start_ns, end_ns=time.time_ns(),
                        num_blocks=len(src_block_ids), nbytes=sum(s.bytes for s in stats),
                        seconds=max((s.seconds for s in stats), default=0.0),
                        transport=pools[0].descriptor.transport if pools else "",
                        error=f"{type(error).__name__}: {error}" if error is not None else None)

    def in_stream(self, kv: RemoteKV) -> bool:
        """Whether kv's pull may start while a step is in flight: over CUDA IPC (a launch on
        the engine's stream), shared memory (a CPU copy, done when it returns) or NIXL (posted
        once the stream has passed the step, and waited for by its sequence alone); not
        between tensor-parallel sizes."""
        if kv.address in self.rank_kv.peers:
            return False
        pool = self.peers.get(kv.address, ("", None))[1]
        return pool is not None and pool.descriptor.transport in ("cuda_ipc", "shm", "nixl")

    def poll(self) -> None:
        """Settle the leases whose in-stream copy is done (in launch order)."""
        while self.pending and self.pending[0][2].done():
            self._settle_pending(*self.pending.pop(0))

    def flush(self) -> None:
        """Wait for every in-stream copy and every NIXL pull (each ends by its lease's deadline
        at the latest), and settle their leases."""
        while self.pending:
            kv, start_ns, pull, runs = self.pending.pop(0)
            pull.wait()
            self._settle_pending(kv, start_ns, pull, runs)
        while self.outside:
            for nixl_pull in list(self.outside):
                with contextlib.suppress(Exception):  # its engine sees the error
                    nixl_pull.done()
            time.sleep(NIXL_POLL_S if self.outside else 0)

    def _settle_pending(self, kv: RemoteKV, start_ns: int, pull: Any, runs: int) -> None:
        stats = pull.stats()
        self.settle(kv, pulled=True, start_ns=start_ns, end_ns=time.time_ns(),
                    num_blocks=stats.num_blocks, num_runs=runs, nbytes=stats.bytes,
                    seconds=stats.seconds, transport="cuda_ipc", error=None)

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
        if request_id is not None:
            self.events.send(LeaseDone(request_id, kv.address, kv.lease_id, **pull))

    def close(self) -> None:
        """Unmap the peers' pools (those rank_kv maps are its own to close), once no copy
        reads them (NIXL pulls in flight cancelled)."""
        for nixl_pull in list(self.outside):
            with contextlib.suppress(Exception):
                nixl_pull.cancel()
        with contextlib.suppress(Exception):
            self.flush()
        for _, pool in self.peers.values():
            with contextlib.suppress(Exception):
                pool.close()


# How often `flush` looks at NIXL pulls in flight.
NIXL_POLL_S = 1e-4
# NIXL READs in flight share the link: posted all at once on a slow one, each takes as long as
# all of them, and every one outlives its lease (2x H100, UCX over TCP at 0.4 GB/s: 247 of 300
# requests failed). So pulls are posted oldest first while the bytes in flight would move in
# NIXL_INFLIGHT_S at the rate the last pulls moved (at least NIXL_INFLIGHT_MIN bytes, and
# always one pull); the others wait, their leases renewed by the worker meanwhile.
NIXL_INFLIGHT_S = 1.0
NIXL_INFLIGHT_MIN = 256 << 20


class NixlPull:
    """A pull over NIXL in flight (engine/kv_handoff.py PendingPull): its READ posted once the
    engine's stream has passed the pull's making, polled by the engine between steps; its lease
    settled once, when it ends (done, failed, past the lease's deadline, or cancelled because
    its request ended)."""

    def __init__(self, owner: KVPulls, kv: RemoteKV, pool: Any, src_block_ids: list[int],
                 dst_block_ids: list[int], runs: int, start_ns: int) -> None:
        self.owner, self.kv, self.pool, self.runs = owner, kv, pool, runs
        self.src, self.dst, self.start_ns = src_block_ids, dst_block_ids, start_ns
        self.local = owner.engine.runner.pool
        self.gate: Any = None  # CUDA: an event after the work the stream holds now
        if self.local.is_cuda:
            import torch  # noqa: PLC0415 - torch, in the core only

            with torch.cuda.device(self.local.device):
                self.gate = torch.cuda.Event()
                self.gate.record()
        self.transfer: Any = None
        self.posted = 0.0
        self.ended = False
        self.error: Exception | None = None

    def done(self) -> bool:
        if self.ended:
            if self.error is not None:
                raise self.error
            return True
        try:
            if self.transfer is None:
                if (self.gate is not None and not self.gate.query()) or not self.may_post():
                    return self._in_time()
                self.posted = time.perf_counter()
                self.transfer = self.pool.start_pull(self.local, self.src, self.dst)
            if not self.pool.endpoint.poll(self.transfer):
                return self._in_time()
        except Exception as e:
            self._end(e)
            raise
        self._end(None)
        return True

    @property
    def nbytes(self) -> int:
        return len(self.src) * self.pool.descriptor.block_bytes

    def may_post(self) -> bool:
        """Every older pull posted, and this one's bytes within what may be in flight (or
        nothing in flight)."""
        in_flight = 0
        for pull in self.owner.outside:
            if pull is self:
                break
            if pull.transfer is None:
                return False
            in_flight += pull.nbytes
        rate = self.owner.nixl_rate
        cap = max(NIXL_INFLIGHT_MIN, rate * NIXL_INFLIGHT_S if rate is not None else 0)
        return in_flight == 0 or in_flight + self.nbytes <= cap

    def cancel(self) -> None:
        if not self.ended:
            self._end(RuntimeError("the request ended before its KV arrived"))

    def _in_time(self) -> bool:
        if time.monotonic() > self.owner.deadline(self.kv):
            raise TimeoutError("the KV pull did not complete before the lease's deadline")
        return False

    def _end(self, error: Exception | None) -> None:
        self.ended, self.error = True, error
        if self.transfer is not None and error is not None:
            self.pool.endpoint.abandon(self.transfer)  # cancelled, or outwaited
        self.owner.outside.remove(self)
        n = len(self.src)
        seconds = time.perf_counter() - self.posted if self.transfer is not None else 0.0
        if error is None and seconds > 0:
            rate = self.nbytes / seconds
            old = self.owner.nixl_rate
            self.owner.nixl_rate = rate if old is None else 0.7 * old + 0.3 * rate
        self.owner.settle(self.kv, pulled=True, start_ns=self.start_ns, end_ns=time.time_ns(),
                          num_blocks=n, num_runs=self.runs,
                          nbytes=self.nbytes if error is None else 0,
                          seconds=seconds, transport="nixl",
                          error=None if error is None else f"{type(error).__name__}: {error}")
