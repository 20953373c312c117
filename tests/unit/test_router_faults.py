"""The router's fault handling with fake workers (no processes): a decode leg that fails moves
with every sample's tokens so far, at most --max-migrations times, then fails UNAVAILABLE saying
so; a worker whose polls time out is lost (its stream abandoned, its unary calls given up),
one that refuses polls is not; a new instance id counts a restart; gRPC health hears of every
change of the workers' health."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry import trace

from tandem.engine.sampling_params import SamplingParams
from tandem.router_svc.decode_legs import DecodeLegs, RouterError
from tandem.router_svc.routing import RouteRequest
from tandem.router_svc.worker_stream import Refused, SampleUpdate, StreamBroken, Update
from tandem.router_svc.workers import FaultMetrics, Worker, WorkerSet, unless_lost
from tandem.runtime.convert import params_to_proto
from tandem.v1 import worker_pb2


def _rpc_error(code: grpc.StatusCode, cls=grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    return cls(code, grpc.aio.Metadata(), grpc.aio.Metadata(), f"fake {code.name}")


class FakeStream:
    """A decode worker's stream: each request gets `steps` tokens per sample, then fails (a
    broken call) or ends; the first `refuse` requests are refused with that status at once."""

    def __init__(self, steps: int, fail: bool,
                 refuse: list[grpc.StatusCode] | None = None) -> None:
        self.steps, self.fail, self.refuse = steps, fail, list(refuse or [])
        self.fail_code = grpc.StatusCode.UNAVAILABLE
        self.sent: list[worker_pb2.DecodeRequest] = []

    async def request(self, msg, md=None, timeout=None, on_sent=None):
        req = msg.decode
        self.sent.append(req)
        if on_sent is not None:
            on_sent()  # on its way: the lease is the worker's now
        if self.refuse:
            raise _rpc_error(self.refuse.pop(0))
        n = req.params.n
        done = [len(s.token_ids) + 1 for s in req.resume] or [1] * n
        for _ in range(self.steps):
            yield Update([SampleUpdate(i, [100 + done[i] + i], [None], None)
                          for i in range(n)], 3, 0)
            done = [d + 1 for d in done]
        if self.fail:
            raise _rpc_error(self.fail_code, StreamBroken)
        yield Update([SampleUpdate(i, [], [None], "length") for i in range(n)], 3, 0)


class FakeOrchestrator:
    """What DecodeLegs asks of its orchestrator (decode_legs.LegHost), over fake streams."""

    def __init__(self, streams: list[FakeStream], max_migrations: int) -> None:
        self.tracer = trace.get_tracer("test")
        self.workers = WorkerSet([], [], [], metrics=FaultMetrics())
        self.decode = [Worker(f"d{i}", "decode", None, None, s, healthy=True)
                       for i, s in enumerate(streams)]
        self.workers.workers = self.decode
        self.max_migrations = max_migrations
        self.prefills = 0
        self.released: list[str] = []
        self.lease_ttl_ms = 0  # what each lease's answer says (0: nothing)

    async def prefill(self, rid, route, params, deadline, md, may_fall_back=False):
        self.prefills += 1
        n = params.n
        return None, worker_pb2.PrefillResponse(
            first_token_ids=[10 + i for i in range(n)], finish_reasons=[""] * n,
            kv=worker_pb2.KVLocation(lease_id=f"lease{self.prefills}",
                                     lease_ttl_ms=self.lease_ttl_ms))

    def pick(self, w, role):
        if w is None:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"no healthy {role} worker")
        return w

    def remaining(self, deadline):
        return None

    def release_later(self, p, lease_id, md=None):
        self.released.append(lease_id)

    async def lend_prefix(self, route, dest, cache_salt, prompt_logprobs, ctx):
        return None  # no worker lends a prefix here


async def _run(orch: FakeOrchestrator, n: int) -> tuple[list[list[int]], Exception | None]:
    params = SamplingParams(n=n, max_tokens=100)
    legs = DecodeLegs(orch, "r", RouteRequest([1, 2, 3]), params, params_to_proto(params),
                     None, None)
    out: list[list[int]] = [[] for _ in range(n)]
    try:
        async for u in legs.run():
            for s in u.samples:
                out[s.index] += s.token_ids
    except RouterError as e:
        return out, e
    return out, None


@pytest.mark.parametrize("n", [1, 2])
def test_each_move_carries_every_samples_tokens_so_far(n):
    streams = [FakeStream(3, fail=True), FakeStream(2, fail=True), FakeStream(4, fail=False)]
    orch = FakeOrchestrator(streams, max_migrations=2)
    out, error = asyncio.run(_run(orch, n))
    assert error is None
    # Leg 1 on d0, then (d0 down) d1, then d2: one token per step, positions continuing.
    assert out == [[10 + i, *(100 + k + i for k in range(1, 10))] for i in range(n)]
    (a,), (b,), (c,) = (s.sent for s in streams)
    assert [r.request_id for r in (a, b, c)] == ["r", "r.1", "r.2"]
    assert [len(r.resume) for r in (a, b, c)] == [0, n, n]
    assert [list(s.token_ids) for s in c.resume] == [out[i][1:6] for i in range(n)]
    assert [r.kv.lease_id for r in (a, b, c)] == ["lease1", "lease2", "lease3"]
    assert orch.released == []  # every lease went with a decode request
    assert [w.healthy for w in orch.decode] == [False, False, True]


def test_a_lease_sent_to_a_worker_whose_stream_breaks_before_any_update_is_released():
    """The decode worker died (or hung) with the request sent: it may never have claimed the
    lease, and never will release it, so the router does, at once, not a time to live later,
    if nobody claimed it (a worker that did may be copying); the request is prefilled again for
    the other worker. A leg that broke after its first update had pulled its lease (and
    released it): nothing to release for it."""
    streams = [FakeStream(0, fail=True), FakeStream(2, fail=True), FakeStream(2, fail=False)]
    orch = FakeOrchestrator(streams, max_migrations=1)
    out, error = asyncio.run(_run(orch, 1))
    assert error is None and len(out[0]) == 1 + 2 + 2
    assert [s.sent[0].kv.lease_id for s in streams] == ["lease1", "lease2", "lease3"]
    assert orch.released == ["lease1"]


def test_moves_are_bounded_then_unavailable():
    streams = [FakeStream(3, fail=True), FakeStream(2, fail=True), FakeStream(4, fail=False)]
    orch = FakeOrchestrator(streams, max_migrations=1)
    out, error = asyncio.run(_run(orch, 1))
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "moved 1 times, --max-migrations 1" in error.message
    assert len(out[0]) == 1 + 3 + 2 and not streams[2].sent  # no third leg, no prefill for it
    assert orch.prefills == 2 and orch.released == []


def test_a_lease_too_short_to_pull_is_retried_with_a_fresh_one_on_the_same_worker():
    """ABORTED (the lease ran too short: a busy decode worker) is no refusal of the worker:
    the request is prefilled again and the same, only, decode worker takes the fresh lease."""
    orch = FakeOrchestrator([FakeStream(2, fail=False, refuse=[grpc.StatusCode.ABORTED])],
                            max_migrations=1)
    out, error = asyncio.run(_run(orch, 1))
    assert error is None and len(out[0]) == 1 + 2
    assert [r.kv.lease_id for r in orch.decode[0].stream.sent] == ["lease1", "lease2"]
    assert orch.prefills == 2 and orch.decode[0].healthy


class LateClaimStream(FakeStream):
    """A decode worker too busy to claim its first request's lease in time: it refuses it
    FAILED_PRECONDITION (the prefill worker knows the token no more) once the lease's time to
    live has passed."""

    async def request(self, msg, md=None, timeout=None, on_sent=None):
        if not self.sent:
            loop = asyncio.get_running_loop()
            until = loop.time() + msg.decode.kv.lease_ttl_ms / 1000
            while loop.time() < until:  # the lease's time runs out (the same clock)
                await asyncio.sleep(until - loop.time())
            self.refuse = [grpc.StatusCode.FAILED_PRECONDITION]
        async for update in super().request(msg, md, timeout, on_sent):
            yield update


def test_a_lease_that_ran_out_before_its_claim_is_no_refusal_of_the_worker():
    """FAILED_PRECONDITION for a lease whose time ran out before the decode worker claimed it
    (a busy worker, seen under overload while workers drained) is retried with a fresh lease,
    that worker included: the only decode worker takes the request."""
    orch = FakeOrchestrator([LateClaimStream(2, fail=False)], max_migrations=1)
    orch.lease_ttl_ms = 5
    out, error = asyncio.run(_run(orch, 1))
    assert error is None and len(out[0]) == 1 + 2
    assert [r.kv.lease_id for r in orch.decode[0].stream.sent] == ["lease1", "lease2"]
    assert orch.prefills == 2


@pytest.mark.parametrize("sent", [0, 2])
def test_an_internal_grpc_failure_of_a_leg_moves_the_request(sent):
    """INTERNAL from a decode leg (gRPC failing inside the worker or its connection, as a stream
    to a worker restarted on the same port does) moves the request like UNAVAILABLE, before or
    after its first tokens: the client gets every token, from the other worker."""
    if sent:  # two tokens, then the stream fails
        first = FakeStream(sent, fail=True)
        first.fail_code = grpc.StatusCode.INTERNAL
    else:  # failed at once; a second try (on either worker) answers
        first = FakeStream(3, fail=False, refuse=[grpc.StatusCode.INTERNAL])
    orch = FakeOrchestrator([first, FakeStream(3, fail=False)], max_migrations=1)
    out, error = asyncio.run(_run(orch, 1))
    assert error is None and len(out[0]) == 1 + sent + 3
    assert sum(len(w.stream.sent) for w in orch.decode) == 2


def test_every_decode_worker_refusing_names_their_reasons():
    """FAILED_PRECONDITION is a refusal: each worker is tried once, then the request fails with
    every reason (they name the flag to change), not "no healthy decode worker"."""
    streams = [FakeStream(1, fail=False, refuse=[grpc.StatusCode.FAILED_PRECONDITION] * 3)
               for _ in range(2)]
    orch = FakeOrchestrator(streams, max_migrations=3)
    _, error = asyncio.run(_run(orch, 1))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "d0: fake FAILED_PRECONDITION" in error.message
    assert "d1: fake FAILED_PRECONDITION" in error.message
    assert [len(s.sent) for s in streams] == [1, 1]


def test_no_decode_worker_left_fails_before_prefilling_again():
    orch = FakeOrchestrator([FakeStream(1, fail=True)], max_migrations=3)
    _, error = asyncio.run(_run(orch, 1))
    assert error.code == grpc.StatusCode.UNAVAILABLE and "no healthy decode" in error.message
    assert orch.prefills == 1


class HandsBack(FakeStream):
    """A decode worker that refuses its first request before claiming the lease, and hands the
    lease back (RequestUpdate.lease_returned): as it begins to drain (`draining`), or for a
    reason of its own (FAILED_PRECONDITION)."""

    def __init__(self, draining: bool) -> None:
        super().__init__(2, fail=False)
        self.draining = draining

    async def request(self, msg, md=None, timeout=None, on_sent=None):
        self.sent.append(msg.decode)
        if on_sent is not None:
            on_sent()
        code = (grpc.StatusCode.UNAVAILABLE if self.draining
                else grpc.StatusCode.FAILED_PRECONDITION)
        raise Refused(code, "refused", draining=self.draining, lease_returned=True)
        yield  # an async generator, as a stream's request is


@pytest.mark.parametrize("draining", [True, False])
def test_a_lease_handed_back_with_a_refusal_goes_to_the_next_decode_worker(draining):
    """A decode worker that turns a request away before claiming its lease hands the lease
    back: the next decode worker gets the same lease (no second prefill, nothing released).
    Refused as it begins to drain: the worker is heard draining (no new request) and the
    refusal is no failure (no retry counted)."""
    orch = FakeOrchestrator([HandsBack(draining), FakeStream(3, fail=False)], max_migrations=1)
    params = SamplingParams(max_tokens=100)
    legs = DecodeLegs(orch, "r", RouteRequest([1, 2, 3]), params, params_to_proto(params),
                      None, None)

    async def main() -> list[int]:
        return [t async for u in legs.run() for s in u.samples for t in s.token_ids]

    assert len(asyncio.run(main())) == 1 + 3
    d0, d1 = orch.decode
    assert [r.kv.lease_id for r in d0.stream.sent + d1.stream.sent] == ["lease1", "lease1"]
    assert orch.prefills == 1 and orch.released == []
    assert legs.retries == (0 if draining else 1)
    assert d0.leaving == draining and d0.healthy


class FakeProbe:
    """A worker's poll stub (blocking, as the poller's thread calls it): answers `answer`."""

    def __init__(self) -> None:
        self.answer: worker_pb2.Load | grpc.StatusCode = worker_pb2.Load(instance_id="a")
        self.GetLoad = self  # stub.GetLoad.future(...)

    def future(self, request, timeout=None):
        return self

    def result(self):
        if isinstance(self.answer, grpc.StatusCode):
            raise _rpc_error(self.answer)
        return self.answer


class FakeDataChannel:
    """The router's aio channel to a worker: in `state`; channel_ready() waits for READY."""

    def __init__(self, state=grpc.ChannelConnectivity.READY) -> None:
        self.state = state
        self.waited = asyncio.Event()  # someone waits for it to connect
        self.connected = asyncio.Event()

    def get_state(self, try_to_connect=False):
        return self.state

    async def channel_ready(self):
        self.waited.set()
        await self.connected.wait()

    def connect(self) -> None:
        self.state = grpc.ChannelConnectivity.READY
        self.connected.set()

    async def close(self) -> None:
        pass


def test_a_worker_answering_polls_is_up_only_once_the_routers_channel_to_it_connects():
    """A worker restarted on the same port answers polls (their own channel) while the
    router's data channel may still sit out gRPC's reconnect backoff, failing every call at
    once: it is up, and requests go there, only when that channel has connected."""
    async def main():
        ws = WorkerSet(["p0"], ["d0"], [], worker_timeout_s=60.0, metrics=FaultMetrics())
        p, d = ws.workers
        real = [w.channel for w in ws.workers]  # their stubs' (calls fail: nothing there)
        for w in ws.workers:
            w.probe, w.stream = FakeProbe(), FakeWorkerStream()
        p.channel = FakeDataChannel()
        d.channel = FakeDataChannel(grpc.ChannelConnectivity.TRANSIENT_FAILURE)
        polled = asyncio.ensure_future(ws.poll_once())
        await d.channel.waited.wait()
        assert p.healthy and not d.healthy and not ws.ready()
        d.channel.connect()
        await polled  # waits for the connection (bounded by worker_timeout_s)
        assert d.healthy and ws.ready()
        # Refused (it stops), then answering again with its channel still in backoff: the
        # wait for the channel gives up after worker_timeout_s, and the next poll tries again.
        d.probe.answer = grpc.StatusCode.UNAVAILABLE
        await ws.poll_once()
        assert not d.healthy
        d.probe.answer = worker_pb2.Load(instance_id="b")
        d.channel = FakeDataChannel(grpc.ChannelConnectivity.TRANSIENT_FAILURE)
        ws.worker_timeout_s = 0.0
        await ws.poll_once()
        assert not d.healthy and not ws.ready()
        d.channel.connect()
        await ws.poll_once()
        assert d.healthy and ws.ready()
        await ws.close()
        for ch in real:
            await ch.close()

    asyncio.run(main())


class FakeWorkerStream:
    def __init__(self) -> None:
        self.abandoned: list[str] = []

    def abandon(self, reason: str) -> None:
        self.abandoned.append(reason)

    async def close(self) -> None:
        pass


def test_a_worker_whose_polls_time_out_is_lost_one_that_refuses_is_not():
    async def main():
        ws = WorkerSet([], [], ["d0"], worker_timeout_s=0.0, metrics=FaultMetrics())
        w = ws.workers[0]
        real, w.channel = w.channel, FakeDataChannel()
        w.probe, w.stream = FakeProbe(), FakeWorkerStream()
        changes: list[bool] = []

        async def on_health():
            changes.append(ws.ready())

        ws.on_health = on_health
        await ws.poll_once()
        assert w.healthy and w.instance_id == "a"
        w.probe.answer = grpc.StatusCode.UNAVAILABLE  # refused: draining, or dead
        await ws.poll_once()
        assert not w.healthy and not w.lost.is_set() and not w.stream.abandoned
        w.probe.answer = grpc.StatusCode.DEADLINE_EXCEEDED  # no answer at all: hung
        await ws.poll_once()
        assert w.lost.is_set() and len(w.stream.abandoned) == 1
        await ws.poll_once()
        assert len(w.stream.abandoned) == 1  # once per loss
        w.probe.answer = worker_pb2.Load(instance_id="b")  # back, a new process
        await ws.poll_once()
        assert w.healthy and not w.lost.is_set()
        assert ws.metrics.restarts.labels("d0")._value.get() == 1
        assert ws.metrics.lost.labels("d0")._value.get() == 1
        await asyncio.sleep(0)
        assert changes == [True, False, True]
        await real.close()

    asyncio.run(main())


def test_a_worker_heard_draining_stays_so_whatever_a_late_poll_said_until_it_restarts():
    """Its Stream call said it drains; a poll it answered before that is applied after (a round
    of polls is applied whole, when its slowest answer is in): it still takes no new request,
    and a call it then refuses as it stops is no failure. Its next process is routed to."""
    async def main():
        ws = WorkerSet([], ["d0", "d1"], [], worker_timeout_s=60.0, metrics=FaultMetrics())
        real = [w.channel for w in ws.workers]
        for w in ws.workers:
            w.channel, w.probe, w.stream = FakeDataChannel(), FakeProbe(), FakeWorkerStream()
        await ws.poll_once()
        d0, d1 = ws.workers
        assert ws.by_role("decode") == [d0, d1]
        d0.heard_draining()  # StreamResponse.closing
        assert ws.by_role("decode") == [d1]
        d0.probe.answer = worker_pb2.Load(instance_id="a")  # answered before it began to drain
        await ws.poll_once()
        assert ws.by_role("decode") == [d1] and d0.leaving
        ws.mark_down(d0)  # a new call refused by its stopping server
        assert d0.healthy
        d0.probe.answer = worker_pb2.Load(instance_id="b")  # restarted
        await ws.poll_once()
        assert ws.by_role("decode") == [d0, d1] and not d0.leaving
        await ws.close()
        for ch in real:
            await ch.close()

    asyncio.run(main())


class FakeCall:
    def __init__(self) -> None:
        self.result: asyncio.Future = asyncio.get_running_loop().create_future()
        self.cancelled = False

    def __await__(self):
        return self.result.__await__()

    def cancel(self) -> None:
        self.cancelled = True
        self.result.cancel()


def test_a_unary_call_gives_up_when_its_worker_is_lost():
    async def main():
        w = Worker("p0", "prefill", None, None, None)
        call = FakeCall()
        task = asyncio.ensure_future(unless_lost(w, call))
        await asyncio.sleep(0)
        w.lost.set()
        with pytest.raises(StreamBroken) as e:
            await task
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and call.cancelled
        w.lost = asyncio.Event()
        call = FakeCall()
        call.result.set_result("answer")
        assert await unless_lost(w, call) == "answer" and not call.cancelled

    asyncio.run(main())


@pytest.mark.parametrize("refusal", ["failed", "draining", "cancelled"])
def test_a_prefix_lent_to_a_prefill_worker_that_fails_is_released_unless_claimed(refusal):
    """The prefill worker a request went to with a lent prefix fails UNAVAILABLE: the router
    releases the prefix (if still unclaimed, as every release of its: that worker may have died
    before its claim) and tries the other worker with a prefix lent afresh. A worker that
    refused because it drains (the status says so) is draining, not failed: out of routing,
    not down. CANCELLED from the worker (what gRPC core answers a call that reached a server
    as it stopped, before any handler took it) is a failure of that worker, not of the request."""
    from tandem.router_svc.orchestrator import Orchestrator
    from tandem.router_svc.remote_prefix import LentPrefix
    from tandem.runtime.lifecycle import DRAINING_METADATA

    class Stub:
        def __init__(self, answer) -> None:
            self.answer = answer

        def Prefill(self, req, timeout=None, metadata=None):  # noqa: N802
            call = FakeCall()
            if isinstance(self.answer, grpc.aio.AioRpcError):
                call.result.set_exception(self.answer)
            else:
                call.result.set_result(self.answer)
            return call

    async def main():
        ws = WorkerSet([], [], [], metrics=FaultMetrics())
        error = grpc.aio.AioRpcError(
            grpc.StatusCode.CANCELLED if refusal == "cancelled" else grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(*([DRAINING_METADATA] if refusal == "draining" else [])), "no")
        dead = Worker("p0", "prefill", None, Stub(error), None, healthy=True)
        alive = Worker("p1", "prefill", None, Stub(worker_pb2.PrefillResponse(
            first_token_ids=[7], kv=worker_pb2.KVLocation(lease_id="lease"))), None,
            healthy=True)
        ws.workers = [dead, alive]
        orch = Orchestrator(ws)
        lender = Worker("far", "prefill", None, None, None, healthy=True)
        lent, released = [], []

        async def lend_prefix(route, dest, cache_salt, prompt_logprobs, ctx):
            lent.append(f"prefix{len(lent)}")
            return LentPrefix(lender, worker_pb2.KVLocation(lease_id=lent[-1], num_tokens=16))

        orch.lend_prefix = lend_prefix
        orch.release_later = lambda p, lease_id, ctx=None: released.append((p.address, lease_id))
        order = iter([dead, alive])
        ws.pick_prefill = lambda route, tried=frozenset(): next(order)
        params = SamplingParams(max_tokens=4)
        p, resp = await orch.prefill("r", RouteRequest([1, 2, 3]), params_to_proto(params),
                                     None, None)
        assert p is alive and resp.kv.lease_id == "lease"
        assert (dead.healthy, dead.leaving) == ((True, True) if refusal == "draining"
                                                else (False, False))
        assert ws.by_role("prefill") == [alive]
        assert lent == ["prefix0", "prefix1"]
        assert released == [("far", "prefix0")]  # prefix1 went with the answered call

    asyncio.run(main())


def _traced_run(orch: FakeOrchestrator) -> tuple[Exception | None, list[str]]:
    """_run with the request's span recorded: the error, and the names of its events."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    span = provider.get_tracer("test").start_span("request")
    params = SamplingParams(max_tokens=100)

    async def run() -> Exception | None:
        legs = DecodeLegs(orch, "r", RouteRequest([1, 2, 3]), params,
                          params_to_proto(params), None, trace.set_span_in_context(span))
        try:
            async for _ in legs.run():
                pass
        except RouterError as e:
            return e
        return None

    error = asyncio.run(run())
    span.end()
    (finished,) = exporter.get_finished_spans()
    return error, [e.name for e in finished.events]


def test_a_move_is_counted_only_once_it_happened():
    """The only decode worker fails mid-stream: nowhere to move, the request fails, and no
    migration is counted (neither the counter nor the span's "migrated" event); with a second
    decode worker, one move, counted once, its event naming where it went."""
    alone = FakeOrchestrator([FakeStream(3, fail=True)], max_migrations=3)
    error, events = _traced_run(alone)
    assert error.code == grpc.StatusCode.UNAVAILABLE and "no healthy decode" in error.message
    assert alone.workers.metrics.migrations._value.get() == 0 and "migrated" not in events

    pair = FakeOrchestrator([FakeStream(3, fail=True), FakeStream(2, fail=False)],
                            max_migrations=3)
    error, events = _traced_run(pair)
    assert error is None
    assert pair.workers.metrics.migrations._value.get() == 1 and events.count("migrated") == 1


class _UnsentFirst(FakeStream):
    """A decode worker whose first request never leaves the router (refused before it is on
    its way: UNAVAILABLE), the next ones run."""

    async def request(self, msg, md=None, timeout=None, on_sent=None):
        if not self.sent:
            self.sent.append(msg.decode)
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE)
            yield
        async for u in super().request(msg, md, timeout, on_sent):
            yield u


def test_a_lent_prefix_goes_with_the_leg_and_back_if_its_request_never_left():
    """With no prefill worker up the decode worker prefills the prompt, carrying the prefix a
    worker of another host lent (prefix_kv). The leg whose request never left has its lease
    released by the router; once a request is sent its lease is the decode worker's."""
    from tandem.router_svc.decode_legs import Fallback
    from tandem.router_svc.remote_prefix import LentPrefix

    orch = FakeOrchestrator([_UnsentFirst(2, fail=False)], max_migrations=2)
    lender = Worker("far", "prefill", None, None, None, healthy=True)
    lent = []

    async def no_prefill(*args, **kw):
        return Fallback("no_prefill")

    async def lend_prefix(route, dest, cache_salt, prompt_logprobs, ctx):
        lent.append(f"prefix{len(lent)}")
        return LentPrefix(lender, worker_pb2.KVLocation(address="far", lease_id=lent[-1],
                                                        num_tokens=16))

    orch.prefill, orch.lend_prefix = no_prefill, lend_prefix
    out, err = asyncio.run(_run(orch, 1))
    assert err is None and out == [[101, 102]]
    sent = orch.decode[0].stream.sent
    assert [r.prefix_kv.lease_id for r in sent] == ["prefix0", "prefix1"]
    assert not any(r.HasField("kv") for r in sent)
    assert orch.released == ["prefix0"]  # never left the router; prefix1 is the worker's
