"""The router's view of its workers: channels, health, load, membership, and what each caches.

Which worker takes a request is a routing policy's choice (router_svc/routing/: the default,
prefix affinity, and the others registered there); this module gathers what the policy is
given (each candidate's load, and how much of the prompt it caches) and routes to the worker it
picks.

What each worker's prefix cache holds, the router learns from the worker itself: every worker
streams the block hashes it caches and evicts (WatchKV, on the channel the router already has
to it), into one map (router_svc/kv_index.py). A prompt's chained block hashes, over the whole
prompt, then tell how many of its leading blocks each worker holds.

Health: every worker's GetLoad is polled, from a thread of its own (router_svc/liveness.py),
never on the event loop that carries the requests: a burst that holds the loop for seconds
must not pass for every worker's silence. A worker is taken out of routing on its own signals
only: it refuses polls (nothing listens, the connection was reset, it drains), its Stream call
breaks, a call to it fails UNAVAILABLE; it is back once it answers again. One whose polls go
unanswered for `worker_timeout_s` of the poller's own time (hung: stopped, stuck, cut off) is
lost: the calls in flight on it give up at once (UNAVAILABLE; the orchestrator moves or
retries them) rather than when the connection's pings go unanswered (GRPC_OPTIONS: 5 s after a
ping, which a busy stream sends soon, a quiet call at the next keepalive, up to 15 s). A poll
that times out before that takes nothing out: a worker slow to answer is busy, not gone. A
worker that refuses polls (draining, or dead) is not lost: its streams finish, or broke
already.
A worker whose answers carry a new instance id restarted (counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence, Set
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from tandem.engine.block_pool import hash_block, salt_root
from tandem.router_svc.kv_index import DEFAULT_MAX_BLOCKS, KVIndex, TierMatch
from tandem.router_svc.liveness import Poller, PollResult, Target, probe_channel
from tandem.router_svc.routing import (
    Placement,
    RouteRequest,
    RoutingPolicy,
    WorkerLoad,
    make_policy,
)
from tandem.router_svc.worker_stream import StreamBroken, WorkerStream
from tandem.runtime.lifecycle import GRPC_OPTIONS
from tandem.runtime.security import ClusterTls, internal_channel
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# Prompts at least this long are hashed (and checked: router_svc/frontend.py) in a worker
# thread rather than on the event loop every request shares: about 0.5 ms of work.
OFF_LOOP_TOKENS = 2048


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
    # Other routers' requests its engine ran and queued at its last poll: the poll's counts
    # less this router's in flight when the poll was applied (counted as running first, the
    # rest as waiting). Policies add this router's own count, exact, to them: a poll lags by up
    # to an interval, and one still counting a burst that has since ended would make an idle
    # worker look busy to the next burst.
    other_running: int = 0
    other_waiting: int = 0
    # Prompt tokens of this router's requests the worker prefills itself (no lease) that have
    # not streamed a first token yet: work its polls show only as requests waiting.
    local_prefill_tokens: int = 0
    last_seen: float = 0.0  # time.monotonic() of its last answered poll
    instance_id: str = ""  # the worker process that answered last (Load.instance_id)
    drain_heard: str | None = None  # the instance whose Stream call said it drains
    # Set when the worker is lost (no poll answered for worker_timeout_s): calls in flight on
    # it give up. A fresh one once it answers again.
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    dynamic: bool = False  # learnt from a membership source (router_svc.membership)
    draining: bool = False  # gone from its source: no new requests; removed once idle
    idle_polls: int = 0  # poll rounds it has been draining with nothing in flight
    slot: int = -1  # its bit in the KV index, while its events are watched (WorkerSet sets it)
    watch: asyncio.Task | None = None  # the WatchKV call feeding the KV index
    # Its polls' own blocking channel and stub (router_svc/liveness.py): off the event loop.
    probe_channel: grpc.Channel | None = None
    probe: worker_pb2_grpc.WorkerStub | None = None
    # Set while it answers polls but the data channel above still connects: up once it has.
    connecting: asyncio.Task | None = None

    @property
    def leaving(self) -> bool:
        """Gone from its membership source, or draining itself (Load.draining): no new
        requests, and not a failure."""
        return self.draining or self.load.draining

    def heard_draining(self) -> None:
        """It said it drains (its Stream call's StreamResponse.closing, a move it asked for, a
        refusal carrying DRAINING_METADATA): no new request from now, as its next poll will
        say. Held for as long as this process (its instance id) answers: a poll answered
        before the drain began may be applied after it (a round of polls is applied whole,
        once its slowest answer is in)."""
        self.load.draining = True
        self.drain_heard = self.load.instance_id

    def polled(self, load: worker_pb2.Load) -> None:
        """An answered poll: its load, still draining if this process said it drains."""
        if load.instance_id != self.drain_heard:  # another process (restarted): its own say
            self.drain_heard = None
        elif self.drain_heard is not None:
            load.draining = True
        self.load = load
        self.other_running = max(0, load.num_running - self.in_flight)
        self.other_waiting = max(0, load.num_waiting - max(0, self.in_flight - load.num_running))

    @property
    def queued(self) -> int:
        """Requests ahead of a new one (WorkerLoad.queued)."""
        return self.in_flight + self.other_waiting

    def as_load(self, cached: TierMatch = TierMatch(0, 0)) -> WorkerLoad:
        """What a routing policy sees of this worker."""
        ld = self.load
        return WorkerLoad(self.address, self.role, self.in_flight, ld.num_waiting,
                          ld.num_running, ld.num_free_blocks, cached.gpu,
                          other_running=self.other_running,
                          other_waiting=self.other_waiting,
                          step_seconds=ld.step_seconds,
                          prompt_token_seconds=ld.prompt_token_seconds,
                          kv_bandwidth=(ld.kv_bytes_pulled / ld.kv_pull_seconds
                                        if ld.kv_pull_seconds > 0 else 0.0),
                          kv_block_bytes=(ld.kv_bytes_pulled // ld.kv_blocks_pulled
                                          if ld.kv_blocks_pulled else 0),
                          host_blocks=cached.host,
                          local_prefill_tokens=self.local_prefill_tokens)


@dataclass(frozen=True)
class Placed:
    """A request's placement and the decode worker it was weighed against (its decode leg's,
    whether it prefills there or pulls)."""

    placement: Placement
    decode: Worker


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
    """The router's fault counters and its event loop's lag, on its /metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = self.registry = registry or CollectorRegistry()
        self.restarts = Counter("tandem:worker_restarts", "Worker restarts the router saw (a "
                                "new process answered at a worker's address)", ["worker"],
                                registry=reg)
        self.lost = Counter("tandem:worker_lost", "Times a worker answered no poll for "
                            "--worker-timeout: its calls in flight were failed or moved",
                            ["worker"], registry=reg)
        self.migrations = Counter("tandem:request_migrations", "Requests moved to another "
                                  "decode worker after their worker failed mid-stream",
                                  registry=reg)
        self.live_migrations = Counter(
            "tandem:live_migrations", "Requests moved by lending their KV (live migration) "
            "off a draining decode worker or, rebalancing, off a nearly full one: handed_over, "
            "or replayed (a drain's new decode worker could not pull it: moved by token replay "
            "instead)", ["outcome"], registry=reg)
        self.prefill_fallbacks = Counter(
            "tandem:prefill_fallbacks", "Prompts prefilled on their decode worker because no "
            "prefill worker was up (no_prefill) or every one was past --prefill-saturation "
            "(saturated)", ["reason"], registry=reg)
        self.placements = Counter(
            "tandem:placements", "Requests the routing policy placed (cost-placement): "
            "disaggregated (prefill worker, then decode worker) or decode (wholly on the decode "
            "worker), and why (router_svc/routing/placement.py)", ["placement", "reason"],
            registry=reg)
        self.loop_lag = Histogram("tandem:router_loop_lag_seconds", "How much later than due "
                                  "the router's event loop ran a 0.1 s timer (what a burst "
                                  "costs every request and health answer)", registry=reg,
                                  buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                                           5.0, 10.0))


class _WorkerUp:
    """tandem:worker_up{worker, role}: 1 while the router routes to the worker, read when
    Prometheus scrapes."""

    def __init__(self, workers: WorkerSet) -> None:
        self.workers = workers

    def collect(self):
        g = GaugeMetricFamily("tandem:worker_up", "1 while the router routes requests to the "
                              "worker (it answers, it is not draining), else 0",
                              labels=["worker", "role"])
        for w in self.workers.workers:
            g.add_metric([w.address, w.role], float(w.healthy and not w.leaving))
        yield g


class WorkerSet:
    def __init__(self, prefill: list[str], decode: list[str], both: list[str], *,
                 poll_interval_s: float = 0.5, policy: RoutingPolicy | None = None,
                 block_size: int = 16, worker_timeout_s: float = 3.0,
                 metrics: FaultMetrics | None = None, tls: ClusterTls | None = None,
                 kv_index_max_blocks: int = DEFAULT_MAX_BLOCKS,
                 prefill_fallback: bool = True) -> None:
        self.workers: list[Worker] = []
        self.policy = policy or make_policy()  # picks each leg's worker
        # With no prefill worker up, decode workers prefill prompts themselves (the router is
        # ready with decode workers alone): router_svc/orchestrator.py.
        self.prefill_fallback = prefill_fallback
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
        self.metrics.registry.register(_WorkerUp(self))
        # Called (a task, on the loop) when ready() may have changed: the router's gRPC
        # readiness follows it, as its HTTP /health/ready does.
        self.on_health: Callable[[], Awaitable[None]] | None = None
        self._was_healthy: bool | None = None
        self._health_tasks: set[asyncio.Task] = set()
        self.block_size = block_size
        self.dtype = ""  # the workers' model dtype, once one has answered a poll
        # Polls run in a thread of their own (router_svc/liveness.py), off the event loop.
        self._poller = Poller(max(1.0, poll_interval_s * 2), worker_timeout_s)
        self._polling = False
        self._round = asyncio.Condition()  # notified after each round of polls is applied

    @property
    def disaggregated(self) -> bool:
        """Split workers, not colocated ones: decode workers alone count (a fleet whose roles
        change may have no prefill worker for a while; prefill fallback serves it then)."""
        return any(w.role in ("prefill", "decode") for w in self.workers)

    def by_role(self, role: str, healthy_only: bool = True) -> list[Worker]:
        return [w for w in self.workers if w.role == role and not w.leaving
                and (w.healthy or not healthy_only)]

    def _connect(self, address: str, role: str, dynamic: bool = False) -> Worker:
        ch = internal_channel(address, self.tls, GRPC_OPTIONS, role)  # a worker of that role
        stub = worker_pb2_grpc.WorkerStub(ch)
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        probe = probe_channel(address, self.tls, role)
        w = Worker(address, role, ch, stub, WorkerStream(stub, address), dynamic=dynamic,
                   slot=slot, probe_channel=probe, probe=worker_pb2_grpc.WorkerStub(probe))
        w.stream.on_closing = w.heard_draining
        return w

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
                    index.set_tier(w.slot, msg.host_tier_id)
                index.apply(w.slot, msg.stored, msg.removed, msg.host_stored, msg.host_removed)
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
            self._poller.forget(w)
            await self._close(w)

    def _health_changed_soon(self) -> None:
        with contextlib.suppress(RuntimeError):  # no loop yet: start() publishes health
            asyncio.get_running_loop()
            self._health_changed()

    # -- health ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Poll every worker once (so that the router starts knowing who is up), then keep
        polling from the poller's thread."""
        await self.poll_once()
        loop = asyncio.get_running_loop()

        def deliver(results: list[PollResult]) -> None:
            loop.call_soon_threadsafe(self._apply_round, results)

        self._poller.start(self.poll_interval_s, self._targets, deliver)
        self._polling = True

    async def close(self) -> None:
        if self._polling:
            await asyncio.to_thread(self._poller.stop)
            self._polling = False
        for w in self.workers:
            await self._stop_watch(w)
            await self._close(w)

    @staticmethod
    async def _close(w: Worker) -> None:
        WorkerSet._stop_connecting(w)
        await w.stream.close()
        await w.channel.close()
        if w.probe_channel is not None:
            w.probe_channel.close()

    async def poll_once(self) -> None:
        """One round of polls, waited for (start-up, and tests that poll by hand rather than
        start() the poller)."""
        self._apply_round(await asyncio.to_thread(self._poller.poll, self._targets()))
        # Those that answered are up once their data channels connect (bounded): wait for it.
        connecting = [w.connecting for w in self.workers if w.connecting is not None]
        await asyncio.gather(*connecting, return_exceptions=True)

    def _targets(self) -> list[Target]:
        """What the poller polls (called in its thread: a copy of the list, not the list)."""
        return [Target(w, w.probe) for w in list(self.workers) if w.probe is not None]

    async def next_round(self) -> None:
        """Until the next round of polls has been applied."""
        async with self._round:
            await self._round.wait()

    def _apply_round(self, results: list[PollResult]) -> None:
        """A round of polls, on the event loop: each worker's answer applied, drained workers
        removed once idle, health published."""
        for r in results:
            if r.key in self.workers:
                self._apply(r.key, r)
        self._health_changed()
        task = asyncio.ensure_future(self._round_done())
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _round_done(self) -> None:
        await self._remove_drained()
        async with self._round:
            self._round.notify_all()

    def _apply(self, w: Worker, r: PollResult) -> None:
        if r.load is None:
            self._stop_connecting(w)
            if r.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                # Silent: slow (busy) until the poller counts it lost.
                if r.lost and not w.lost.is_set():
                    w.healthy = False
                    self._lose(w, r.silent_s)
                return
            # A refusal is an answer: draining, or nothing listens there (dead). One leaving
            # the membership (a role change, scaling in) is expected to go.
            if w.healthy:
                (log.info if w.draining else log.warning)(
                    "worker %s (%s) is down: %s", w.address, w.role,
                    r.code.name if r.code else "no answer")
            w.healthy = False
            return
        w.polled(r.load)
        instance = w.load.instance_id
        if w.instance_id and instance != w.instance_id:
            log.warning("worker %s (%s) restarted", w.address, w.role)
            self.metrics.restarts.labels(w.address).inc()
        w.instance_id = instance
        if w.lost.is_set():
            w.lost = asyncio.Event()
        w.last_seen = time.monotonic()
        if w.load.block_size:
            self.block_size = w.load.block_size
        if w.load.dtype:
            self.dtype = w.load.dtype
        if w.healthy:
            self._watch_kv(w)
            return
        # Up once the router's own channel to it is connected, not when the poll (its own
        # channel) says so: a worker restarted on the same port answers polls while the data
        # channel may still sit out gRPC's reconnect backoff, failing every call at once.
        if w.channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            self._up(w)
        elif w.connecting is None or w.connecting.done():
            w.connecting = asyncio.ensure_future(self._up_once_connected(w))

    def _up(self, w: Worker) -> None:
        log.info("worker %s (%s, %s) is up", w.address, w.role, w.load.worker_id)
        w.healthy = True
        self._watch_kv(w)

    async def _up_once_connected(self, w: Worker) -> None:
        """Mark w up when its data channel connects (within worker_timeout_s; otherwise the
        next answered poll tries again). A poll that fails meanwhile cancels this."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(w.channel.channel_ready(), self.worker_timeout_s)
            if w in self.workers and not w.healthy:
                self._up(w)
                self._health_changed()

    @staticmethod
    def _stop_connecting(w: Worker) -> None:
        task, w.connecting = w.connecting, None
        if task is not None:
            task.cancel()

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
        if w.leaving:  # going, not failing (a call it refused as it stops): no new request
            return     # goes there either way, and its polls say when it is back
        if w.healthy:
            log.warning("worker %s (%s) failed a call: taken out", w.address, w.role)
        w.healthy = False
        self._health_changed()

    def _health_changed(self) -> None:
        ok = self.ready()
        if ok == self._was_healthy or self.on_health is None:
            return
        self._was_healthy = ok
        task = asyncio.get_running_loop().create_task(self.on_health())
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    def ready(self) -> bool:
        """Can a request be served now: at least one path through the workers, a prefill and
        a decode worker up (neither draining; a decode worker alone with prefill fallback), or
        a colocated one. What the router's readiness (gRPC health, HTTP /health/ready) says."""
        def up(role: str) -> bool:
            return any(w.healthy for w in self.by_role(role))

        prefill = up("prefill") or (self.prefill_fallback and self.disaggregated)
        return (prefill and up("decode")) or up("both")

    def all_healthy(self) -> bool:
        """Every worker up (draining ones aside), and at least one: a router that learns its
        workers (router_svc.membership) may know none yet. Full capacity, not readiness."""
        current = [w for w in self.workers if not w.leaving]
        return bool(current) and all(w.healthy for w in current)

    def states(self) -> list[dict]:
        """Each worker's state as this router sees it (HTTP /workers)."""
        now = time.monotonic()
        return [{"address": w.address, "role": w.role,
                 "state": "lost" if w.lost.is_set() else "up" if w.healthy else "down",
                 "draining": w.leaving, "in_flight": w.in_flight,
                 "running": w.load.num_running, "waiting": w.load.num_waiting,
                 "last_answer_s": round(now - w.last_seen, 3) if w.last_seen else None,
                 "instance_id": w.instance_id, "worker_id": w.load.worker_id}
                for w in self.workers]

    # -- picking -----------------------------------------------------------------------------
    async def route_request(self, prompt: list[int], cache_salt: str = "",
                            priority: int = 0) -> RouteRequest:
        """What the policy is told of a request, made once per request (every pick of its legs
        reads it): the prompt's block hashes only for a policy that reads the caches."""
        hashes = (await self.prompt_hashes(prompt, cache_salt)
                  if self.policy.uses_prefix_cache else [])
        return RouteRequest(prompt, hashes, priority)

    async def prompt_hashes(self, prompt: list[int], cache_salt: str = "") -> list[int]:
        """prefix_hashes, once per request: in a worker thread for a long prompt (25 ms of
        hashing for 100k tokens would hold every other request on the event loop)."""
        if len(prompt) >= OFF_LOOP_TOKENS:
            return await asyncio.to_thread(self.prefix_hashes, prompt, cache_salt)
        return self.prefix_hashes(prompt, cache_salt)

    def prefix_hashes(self, prompt: list[int], cache_salt: str = "") -> list[int]:
        """The chained hashes of every full block of the prompt, as the workers key them."""
        bs = self.block_size
        hashes: list[int] = []
        parent = salt_root(cache_salt)
        for i in range(len(prompt) // bs):
            parent = hash_block(parent, prompt[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return hashes

    def cached_blocks(self, candidates: list[Worker], hashes: Sequence[int]) -> dict[str, int]:
        """address -> how many leading blocks of the prompt (hashes) the worker caches."""
        by_slot = self.kv_index.match(hashes, [w.slot for w in candidates if w.slot >= 0])
        return {w.address: by_slot.get(w.slot, 0) for w in candidates}

    def tier_hits(self, candidates: list[Worker], hashes: Sequence[int]) -> dict[str, TierMatch]:
        """address -> how many leading blocks of the prompt the worker holds on GPU, and how
        many more it can read from a host tier (its own or its host's shared one)."""
        by_slot = self.kv_index.match_tiers(hashes, [w.slot for w in candidates if w.slot >= 0])
        return {w.address: by_slot.get(w.slot, TierMatch(0, 0)) for w in candidates}

    def pick_prefill(self, request: RouteRequest,
                     exclude: Set[str] = frozenset()) -> Worker | None:
        """The policy's prefill worker for `request`, among the healthy ones not in `exclude`
        (None: there is none)."""
        return self._pick(self.policy.pick_prefill, "prefill", request, exclude)

    def pick_decode(self, request: RouteRequest, role: str = "decode",
                    exclude: Set[str] = frozenset()) -> Worker | None:
        """The policy's worker to generate `request`'s tokens: a `decode` worker, or a `both`
        one for a colocated request."""
        return self._pick(self.policy.pick_decode, role, request, exclude)

    def place(self, request: RouteRequest) -> Placed | None:
        """Where a disaggregated request runs (RoutingPolicy.place), with the decode worker the
        policy picked for it; None when the policy places nothing, or no prefill or no decode
        worker is up (the prefill fallback decides then)."""
        if not self.policy.places:
            return None
        p = self._pick_load(self.policy.pick_prefill, "prefill", request, frozenset())
        d = self._pick_load(self.policy.pick_decode, "decode", request, frozenset())
        if p is None or d is None:
            return None
        return Placed(self.policy.place(request, p[1], d[1], self.block_size), d[0])

    def _pick(self, pick: Callable[[RouteRequest, list[WorkerLoad]], WorkerLoad], role: str,
              request: RouteRequest, exclude: Set[str]) -> Worker | None:
        chosen = self._pick_load(pick, role, request, exclude)
        return None if chosen is None else chosen[0]

    def _pick_load(self, pick: Callable[[RouteRequest, list[WorkerLoad]], WorkerLoad],
                   role: str, request: RouteRequest,
                   exclude: Set[str]) -> tuple[Worker, WorkerLoad] | None:
        candidates = [w for w in self.by_role(role) if w.address not in exclude]
        if not candidates:
            return None
        hits = (self.tier_hits(candidates, request.block_hashes)
                if self.policy.uses_prefix_cache else {})
        loads = [w.as_load(hits.get(w.address, TierMatch(0, 0))) for w in candidates]
        chosen = pick(request, loads)
        for w, seen in zip(candidates, loads):
            if seen is chosen:
                return w, seen
        raise TypeError(f"routing policy {self.policy.name!r} picked {chosen!r}, "
                        "not one of the workers it was given")
