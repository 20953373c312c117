"""The router's view of its workers: channels, health, load, and the two picking policies.

What each worker's prefix cache holds, the router learns from the worker itself: every worker
streams the block hashes it caches and evicts (WatchKV, on the channel the router already has
to it), into one map (router_svc/kv_index.py). A prompt's chained block hashes, over the whole
prompt, then tell how many of its leading blocks each worker holds.

Prefill: among the workers no busier than the least loaded one plus `balance_slack` requests,
the one holding the longest prefix of the prompt; ties to the least loaded.

Decode (and colocated): among the workers no busier than the least loaded plus
`balance_slack`, the one holding the longest prefix of the prompt (a conversation's earlier
turns, pulled or generated there: only the rest is pulled); ties to the most free KV blocks per
request in flight.

Health: every worker's GetLoad is polled; a worker that fails a poll, or whose Stream call
breaks, is taken out until it answers again. One whose polls time out, unanswered for
`worker_timeout_s` (hung: stopped, stuck, cut off), is lost: the calls in flight on it give up at
once (UNAVAILABLE; the orchestrator moves or retries them) rather than when the connection's
pings go unanswered (GRPC_OPTIONS: 5 s after a ping, which a busy stream sends soon, a quiet
call at the next keepalive, up to 15 s). A worker that refuses polls (draining, or dead) is not
lost: its streams finish, or broke already.
A worker whose answers carry a new instance id restarted (counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry, Counter

from engine.block_pool import hash_block, salt_root
from router_svc.kv_index import DEFAULT_MAX_BLOCKS, KVIndex
from router_svc.worker_stream import StreamBroken, WorkerStream
from runtime.lifecycle import GRPC_OPTIONS
from runtime.security import ClusterTls, internal_channel
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class Worker:
    address: str
    role: str  # prefill | decode | both
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    stream: WorkerStream  # the Stream call its decode and colocated requests ride
    healthy: bool = False
    load: worker_pb2.Load = field(default_factory=worker_pb2.Load)
    in_flight: int = 0  # requests this router has on the worker now
    last_seen: float = 0.0  # time.monotonic() of its last answered poll
    instance_id: str = ""  # the worker process that answered last (Load.instance_id)
    # Set when the worker is lost (no poll answered for worker_timeout_s): calls in flight on
    # it give up. A fresh one once it answers again.
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    dynamic: bool = False  # learnt from a membership source (router_svc.membership)
    draining: bool = False  # gone from its source: no new requests; removed once idle
    idle_polls: int = 0  # poll rounds it has been draining with nothing in flight
    slot: int = -1  # its bit in the KV index, while its events are watched (WorkerSet sets it)
    watch: asyncio.Task | None = None  # the WatchKV call feeding the KV index

    @property
    def free_blocks(self) -> int:
        return self.load.num_free_blocks

    def score_load(self) -> int:
        return self.in_flight + self.load.num_waiting


async def unless_lost(w: Worker, call: grpc.aio.UnaryUnaryCall):
    """A unary call's response, or UNAVAILABLE (the call cancelled) as soon as `w` is lost."""
    answer = asyncio.ensure_future(call)
    waiter = asyncio.ensure_future(w.lost.wait())
    try:
        done, _ = await asyncio.wait((answer, waiter), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the caller left
        call.cancel()
        answer.cancel()
        raise
    finally:
        waiter.cancel()
    if answer in done:
        return answer.result()
    call.cancel()
    answer.cancel()
    raise StreamBroken(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                       f"worker {w.address} stopped answering")


class FaultMetrics:
    """The router's fault counters, on its /metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry or CollectorRegistry()
        self.restarts = Counter("tandem:worker_restarts", "Worker restarts the router saw (a "
                                "new process answered at a worker's address)", ["worker"],
                                registry=reg)
        self.lost = Counter("tandem:worker_lost", "Times a worker answered no poll for "
                            "--worker-timeout: its calls in flight were failed or moved",
                            ["worker"], registry=reg)
        self.migrations = Counter("tandem:request_migrations", "Requests moved to another "
                                  "decode worker after their worker failed mid-stream",
                                  registry=reg)


class WorkerSet:
    def __init__(self, prefill: list[str], decode: list[str], both: list[str], *,
                 poll_interval_s: float = 0.5, balance_slack: int = 4,
                 block_size: int = 16, worker_timeout_s: float = 3.0,
                 metrics: FaultMetrics | None = None, tls: ClusterTls | None = None,
                 kv_index_max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.workers: list[Worker] = []
        self.tls = tls  # mutual TLS with a cluster CA on every worker channel, when set
        self.kv_index = KVIndex(kv_index_max_blocks)
        self._free_slots: list[int] = []
        self._next_slot = 0
        for role, addrs in (("prefill", prefill), ("decode", decode), ("both", both)):
            for a in addrs:
                self.workers.append(self._connect(a, role))
        self.poll_interval_s = poll_interval_s
        self.worker_timeout_s = worker_timeout_s
        self.metrics = metrics or FaultMetrics()
        # Called (a task, on the loop) when all_healthy() may have changed: the router's gRPC
        # health follows it, as its HTTP /health does.
        self.on_health: Callable[[], Awaitable[None]] | None = None
        self._was_healthy: bool | None = None
        self._health_tasks: set[asyncio.Task] = set()
        self.balance_slack = balance_slack
        self.block_size = block_size
        self.dtype = ""  # the workers' model dtype, once one has answered a poll
        self._poller: asyncio.Task | None = None
        self._changed = asyncio.Event()

    @property
    def disaggregated(self) -> bool:
        return any(w.role == "prefill" for w in self.workers)

    def by_role(self, role: str, healthy_only: bool = True) -> list[Worker]:
        return [w for w in self.workers if w.role == role and not w.draining
                and (w.healthy or not healthy_only)]

    def _connect(self, address: str, role: str, dynamic: bool = False) -> Worker:
        ch = internal_channel(address, self.tls, GRPC_OPTIONS)
        stub = worker_pb2_grpc.WorkerStub(ch)
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        return Worker(address, role, ch, stub, WorkerStream(stub, address), dynamic=dynamic,
                      slot=slot)

    # -- KV events (what each worker caches) -------------------------------------------------
    def _watch_kv(self, w: Worker) -> None:
        """Follow w's KV events unless already following them (started from each answered
        poll, so a call that ended is made again once the worker answers)."""
        if w.watch is None or w.watch.done():
            w.watch = asyncio.create_task(self._follow_kv(w), name=f"watch-kv {w.address}")

    async def _follow_kv(self, w: Worker) -> None:
        index = self.kv_index
        try:
            async for msg in w.stub.WatchKV(worker_pb2.WatchKVRequest()):
                if msg.reset:
                    index.clear(w.slot)
                index.apply(w.slot, msg.stored, msg.removed)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                log.info("KV events of worker %s (%s) stopped: %s", w.address, w.role,
                         e.code().name)
        finally:
            index.clear(w.slot)  # what it said no longer holds once nobody listens

    async def _stop_watch(self, w: Worker) -> None:
        task, w.watch = w.watch, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.kv_index.clear(w.slot)

    # -- membership (router_svc.membership) --------------------------------------------------
    def set_members(self, members: dict[str, set[str]]) -> None:
        """The learnt workers are now `members` (role -> addresses): add the new ones (polled
        from the next round; routed to once they answer), drain the ones gone (no new
        requests; removed once nothing of this router's is in flight there). Workers given by
        flags are never drained. A drained worker that comes back is routed to again."""
        fixed = {(w.role, w.address) for w in self.workers if not w.dynamic}
        wanted = {(role, a) for role, addrs in members.items() for a in addrs} - fixed
        for w in self.workers:
            if not w.dynamic:
                continue
            gone = (w.role, w.address) not in wanted
            if gone and not w.draining:
                log.info("worker %s (%s) left the membership: draining its %d requests",
                         w.address, w.role, w.in_flight)
            elif not gone and w.draining:
                log.info("worker %s (%s) is back in the membership", w.address, w.role)
            w.draining = gone
        have = {(w.role, w.address) for w in self.workers}
        for role, address in sorted(wanted - have):
            log.info("worker %s (%s) joined the membership", address, role)
            self.workers.append(self._connect(address, role, dynamic=True))
        self._health_changed_soon()

    async def _remove_drained(self) -> None:
        """Close and forget draining workers idle for two poll rounds in a row (a request that
        picked one just before it was drained counts in_flight only after an await)."""
        for w in self.workers:
            w.idle_polls = w.idle_polls + 1 if w.draining and w.in_flight == 0 else 0
        for w in [w for w in self.workers if w.idle_polls >= 2]:
            self.workers.remove(w)
            log.info("worker %s (%s) drained and removed", w.address, w.role)
            await self._stop_watch(w)
            self._free_slots.append(w.slot)
            await w.stream.close()
            await w.channel.close()

    def _health_changed_soon(self) -> None:
        with contextlib.suppress(RuntimeError):  # no loop yet: start() publishes health
            asyncio.get_running_loop()
            self._health_changed()

    # -- health ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for w in self.workers:
            await self._stop_watch(w)
            await w.stream.close()
            await w.channel.close()

    async def poll_once(self) -> None:
        await self._remove_drained()
        await asyncio.gather(*(self._poll(w) for w in self.workers))
        self._health_changed()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.poll_once()

    async def _poll(self, w: Worker) -> None:
        try:
            w.load = await w.stub.GetLoad(worker_pb2.GetLoadRequest(),
                                          timeout=max(1.0, self.poll_interval_s * 2))
        except grpc.aio.AioRpcError as e:
            if w.healthy:
                log.warning("worker %s (%s) is down: %s", w.address, w.role, e.code().name)
            w.healthy = False
            # No answer at all (a refusal is an answer: a draining worker refuses polls while
            # its streams finish; a dead one's streams broke already).
            silent = time.monotonic() - w.last_seen
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not w.lost.is_set() \
                    and silent >= self.worker_timeout_s:
                self._lose(w, silent)
            return
        if not w.healthy:
            log.info("worker %s (%s, %s) is up", w.address, w.role, w.load.worker_id)
        instance = w.load.instance_id
        if w.instance_id and instance != w.instance_id:
            log.warning("worker %s (%s) restarted", w.address, w.role)
            self.metrics.restarts.labels(w.address).inc()
        w.instance_id = instance
        if w.lost.is_set():
            w.lost = asyncio.Event()
        w.healthy = True
        w.last_seen = time.monotonic()
        if w.load.block_size:
            self.block_size = w.load.block_size
        self._watch_kv(w)
        if w.load.dtype:
            self.dtype = w.load.dtype

    def _lose(self, w: Worker, silent: float) -> None:
        """No answer for `silent` seconds: whatever this router has in flight there gives up
        now (the streams fail UNAVAILABLE and move), not when keepalive notices."""
        log.warning("worker %s (%s) has answered no poll for %.1f s: failing over its %d "
                    "requests in flight", w.address, w.role, silent, w.in_flight)
        self.metrics.lost.labels(w.address).inc()
        w.lost.set()
        w.stream.abandon(f"worker {w.address} answered no poll for {silent:.1f} s")
        if w.watch is not None:  # its cache may be gone with it: route as if it held nothing
            w.watch.cancel()

    def mark_down(self, w: Worker) -> None:
        if w.healthy:
            log.warning("worker %s (%s) failed a call: taken out", w.address, w.role)
        w.healthy = False
        self._health_changed()

    def _health_changed(self) -> None:
        ok = self.all_healthy()
        if ok == self._was_healthy or self.on_health is None:
            return
        self._was_healthy = ok
        task = asyncio.get_running_loop().create_task(self.on_health())
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    def all_healthy(self) -> bool:
        """Every worker up (draining ones aside), and at least one: a router that learns its
        workers (router_svc.membership) may know none yet."""
        current = [w for w in self.workers if not w.draining]
        return bool(current) and all(w.healthy for w in current)

    # -- picking -----------------------------------------------------------------------------
    def prefix_hashes(self, prompt: list[int], cache_salt: str = "") -> list[int]:
        """The chained hashes of every full block of the prompt, as the workers key them."""
        bs = self.block_size
        hashes: list[int] = []
        parent = salt_root(cache_salt)
        for i in range(len(prompt) // bs):
            parent = hash_block(parent, prompt[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return hashes

    def cached_blocks(self, candidates: list[Worker], hashes: list[int]) -> dict[str, int]:
        """address -> how many leading blocks of the prompt (hashes) the worker caches."""
        by_slot = self.kv_index.match(hashes, [w.slot for w in candidates if w.slot >= 0])
        return {w.address: by_slot.get(w.slot, 0) for w in candidates}

    def _near_least_loaded(self, candidates: list[Worker]) -> list[Worker]:
        least = min(w.score_load() for w in candidates)
        return [w for w in candidates if w.score_load() - least <= self.balance_slack]

    def pick_prefill(self, prompt: list[int], exclude: set[str] = frozenset(),
                     cache_salt: str = "") -> Worker | None:
        candidates = [w for w in self.by_role("prefill") if w.address not in exclude]
        if not candidates:
            return None
        near = self._near_least_loaded(candidates)
        hits = self.cached_blocks(near, self.prefix_hashes(prompt, cache_salt))
        return max(near, key=lambda w: (hits[w.address], -w.score_load()))

    def pick_decode(self, role: str = "decode", exclude: set[str] = frozenset(),
                    prompt: list[int] | None = None, cache_salt: str = "") -> Worker | None:
        candidates = [w for w in self.by_role(role) if w.address not in exclude]
        if not candidates:
            return None
        near = self._near_least_loaded(candidates)
        hashes = self.prefix_hashes(prompt, cache_salt) if prompt else []
        hits = self.cached_blocks(near, hashes)
        return max(near, key=lambda w: (hits[w.address],
                                        w.free_blocks / (1 + w.in_flight + w.load.num_running),
                                        -w.in_flight))
