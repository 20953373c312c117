"""The decode worker (role `decode`) and the colocated worker (role `both`).

Decode: a handed-off request is checked (every id and length), claims its prefill lease with
the lease's token (the prefill worker answers with the lease's block ids: nothing a caller names
is read; decode_svc/handoff.py), and waits until this worker has blocks for its prompt; the
engine then pulls the prompt's KV from the prefill worker's pool in one copy, this servicer
releases the prefill side's lease, and the request decodes with continuous batching. The first
token came with the handoff and is not recomputed. Both: prefill and decode here (the baseline).

Requests arrive on the router's Stream call (one per router, many requests). Each step's
outputs of a request go into the call's outbox right where the engine hands them over (its
sink), as a few list appends; what piled up between two writes (one engine step's, usually)
leaves as one message, its tokens in columns. A request's task only starts it, waits for its end
and reports how it ended.

A prefill worker's pool is mapped once per pair (runtime/kv_peers.py): Register returns its
descriptor, refused when the layouts differ (the error names the field) or when the pool is
already mapped for another address (a peer presenting another's pool), and the engine core maps
it. Pulls happen on the
core; it says when it is done with each lease (lease_done), and this servicer sends the Release.
Until then it renews the lease (decode_svc/lease_renewal.py), however long the request waits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
import time
from collections.abc import Coroutine
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from tandem.decode_svc.handoff import CORE, WORKER, HeldLease, claim, decode_args
from tandem.decode_svc.lease_renewal import LeaseRenewal
from tandem.decode_svc.outbox import Outbox, failure_message, relay
from tandem.engine.sequence import RemoteKV, Replay
from tandem.engine.serving.core_messages import LeaseDone
from tandem.errors import InvalidArgument
from tandem.kvtransfer import transports
from tandem.kvtransfer.lease import Claim
from tandem.runtime.convert import params_from_proto
from tandem.runtime.kv_peers import PeerPools
from tandem.runtime.lease_rpcs import LeaseRPCs
from tandem.runtime.role_switch import RoleOptions
from tandem.runtime.telemetry import span_name
from tandem.runtime.worker import (
    DRAIN_POLL_S,
    WorkerError,
    WorkerServicer,
    add_worker_args,
    checked,
    main_worker,
)
from tandem.runtime.worker_inputs import (
    bounded_id,
    check_prompt,
    check_request_id,
    check_stream_request,
    check_trace_context,
)
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)


def _request_id(msg: worker_pb2.StreamRequest) -> str:
    """The id a Stream message names (cut to the length an id may have), "" if none."""
    kind = msg.WhichOneof("kind")
    rid = (getattr(msg, kind) if kind in ("cancel", "lend")
           else getattr(msg, kind).request_id if kind else "")
    return bounded_id(rid)


def _trace_parent(msg: worker_pb2.StreamRequest) -> otel_context.Context | None:
    """The caller's trace context, unless it is too large to read (then the refusal that says
    so starts a trace of its own)."""
    try:
        check_trace_context(msg.trace_context)
    except InvalidArgument:
        return None
    return propagate.extract(dict(msg.trace_context))


class DecodeServicer(WorkerServicer):
    def __init__(self, engine, worker_id: str, address: str, role: str) -> None:
        super().__init__(engine, worker_id)
        self.role = role
        self.address = address
        # The peers' pools the engine core maps (prefill workers, decode workers lending a
        # moving sequence, lenders of a cached prefix), the channels to them, the releases.
        self.pools = PeerPools(self)
        # Every lease this worker holds, by token, from its request's arrival to its release.
        self._held: dict[str, HeldLease] = {}
        self.limits = engine.info.limits
        self._background: set[asyncio.Task] = set()
        # The open Stream calls: each one's outbox and its requests' tasks, by request id.
        self._sessions: dict[Outbox, dict[str, asyncio.Task]] = {}
        self._draining = asyncio.Event()
        self._moving: set[str] = set()  # requests a drain asked their router to move
        self._move_asked: set[str] = set()  # requests an operator asked to move (Move), once
        self._settled = asyncio.Event()  # draining, and no request left on any call
        # Live migration: the leases this worker lends on its running requests (Register,
        # ClaimLease, Release, RenewLeases from the decode worker they move to), and which
        # request each one's token is for until it ends here.
        self.leases = LeaseRPCs(engine, worker_id, self.instance_id)
        self._lent: dict[str, str] = {}  # request id -> its lent lease's token
        # Keeps the held leases alive at their prefill workers while their requests wait
        # (started with the first claim, once the process's telemetry is in place).
        self._renewing: asyncio.Task | None = None

    # -- RPCs --------------------------------------------------------------------------------
    async def Stream(self, request_iterator, context):  # noqa: N802 - gRPC method name
        """All of one router's requests on one call. Each request's tokens go to the call's
        outbox as the engine hands them over; what piled up between two writes (one engine
        step's, usually) goes out as one message. The call ends when the router closes its side
        and its requests are done; the router leaving cancels them all. A draining worker asks
        the router to close its side (StreamResponse.closing) and never ends the call first:
        a message in flight toward a call the server had ended would go unread (a decode
        request's lease left pinned until it expires), and gRPC's client would report INTERNAL
        for the write instead of this worker's answer."""
        out = Outbox()
        tasks: dict[str, asyncio.Task] = {}

        async def serve(rid: str, run: Coroutine[Any, Any, None]) -> None:
            try:
                await run
                out.update(worker_pb2.RequestUpdate(request_id=rid, done=True))
                if rid in self._moving:  # its router had nowhere to move it
                    self.drain_tally.finished += 1
            except Exception as e:  # reported to the router as a status
                failed = failure_message(rid, e)
                if failed.error_code == grpc.StatusCode.INTERNAL.value[0]:
                    log.exception("request %s failed", rid)
                out.update(failed)
            finally:
                tasks.pop(rid, None)
                self._unlend(rid)
                self._settle()

        def start(msg: worker_pb2.StreamRequest) -> None:
            try:
                check_stream_request(msg)  # before any work its sizes would drive
            except InvalidArgument as e:
                raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            kind = msg.WhichOneof("kind")
            if kind == "handover":
                self._hand_over(msg.handover, tasks)
                return
            if kind == "lend":
                self._lend_for_rebalance(msg.lend, tasks, out)
                return
            if kind == "cancel":
                task = tasks.get(msg.cancel)
                if task is not None:
                    if msg.cancel in self._moving:  # its router moved it elsewhere
                        self.drain_tally.moved += 1
                    task.cancel()
                return
            req = getattr(msg, kind)
            rid = req.request_id
            # The router handed a decode request's lease over: from here this worker releases
            # it, even when it refuses the request (a token it already holds excepted), unless
            # it refuses because it drains: then the lease, never claimed, is the router's again
            # for another decode worker (RequestUpdate.lease_returned).
            lease = self._hold(req.kv) if kind == "decode" and req.HasField("kv") else None
            try:
                self._admit(kind, rid, tasks)
            except WorkerError as e:
                if lease is not None and e.draining:
                    del self._held[lease.lease_id]
                    e.lease_returned = True
                elif lease is not None:
                    self._end(lease)
                if kind == "decode":  # a prefix lent for it goes back
                    self.pools.let_go(req.prefix_kv)
                raise
            # In the request's trace, as the router sent it: its worker span continues there.
            ctx = contextvars.copy_context()
            ctx.run(otel_context.attach, propagate.extract(dict(msg.trace_context)))
            if kind == "decode" and lease is None:  # no prefill worker could take it
                run = self._prefill_here(req, out)
            elif lease is None:
                run = self._generate(req, out)
            else:
                lease.context = ctx
                run = self._decode(req, lease, out)
            task = tasks[rid] = asyncio.get_running_loop().create_task(serve(rid, run),
                                                                      context=ctx)
            if lease is not None:
                # However the task ends (even cancelled before it ran, which skips its code):
                # a request never handed to the engine has a lease nobody else will release.
                task.add_done_callback(lambda _, lease=lease: self._end(lease))

        async def read() -> None:
            async for msg in request_iterator:
                try:
                    start(msg)
                except WorkerError as e:  # refused: its only update says why
                    rid = _request_id(msg)
                    self.telemetry.refused(span_name(self.role), rid, e, _trace_parent(msg))
                    out.update(failure_message(rid, e))
            # The router closed its side: end once what it sent is done.
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            out.close()

        reader = asyncio.create_task(read())
        self._sessions[out] = tasks
        if self._draining.is_set():  # opened while this worker drains: new requests elsewhere
            out.drain()
        try:
            while True:
                msg = await out.take()
                if msg is not None:
                    yield msg
                if out.closing and not tasks and out.empty():  # what came during the write
                    return                                        # goes out first
        finally:
            self._sessions.pop(out, None)
            reader.cancel()
            for task in list(tasks.values()):
                task.cancel()
            self._settle()

    def _admit(self, kind: str, rid: str, tasks: dict[str, asyncio.Task]) -> None:
        if self._draining.is_set():
            raise WorkerError(grpc.StatusCode.UNAVAILABLE,
                              f"worker {self.worker_id} is shutting down", draining=True)
        if kind != ("generate" if self.role == "both" else "decode"):
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"worker {self.worker_id} has role {self.role}, not for {kind}")
        if rid in tasks:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, f"request_id {rid!r} is in use")

    async def drain(self) -> None:
        """Refuse new requests on open Stream calls and ask each router to close its side;
        each call ends once its router has and its requests are done (or the server's graceful
        stop cuts it at the end of the grace period)."""
        self._start_draining()

    def _start_draining(self) -> None:
        if self._draining.is_set():
            return
        self._draining.set()
        for out in self._sessions:
            out.drain()

    async def evacuate(self) -> None:
        """Draining with the server up: new requests are refused (UNAVAILABLE: the router
        sends them elsewhere). A decode worker asks each router to move every request it runs
        here (RequestUpdate.move) and decodes each on until its router cancels it here (moved)
        or it finishes (its router had nowhere to move it); a colocated worker's requests
        finish here. Returns once no request is left."""
        self._start_draining()
        if self.role == "decode":
            for out, tasks in list(self._sessions.items()):
                for rid in list(tasks):
                    self._moving.add(rid)
                    # Its KV lent for the next decode worker to pull (live migration), when
                    # it has any to lend; else it moves by token replay.
                    out.update(worker_pb2.RequestUpdate(request_id=rid, move=True,
                                                        kv=await self._lend(rid)))
        self._settle()
        await self._settled.wait()
        # Leases lent are released by the decode workers that pulled them (or expire).
        while (await self.engine.refresh()).num_leases:
            await asyncio.sleep(DRAIN_POLL_S)

    def still_held(self) -> int:
        return (sum(len(tasks) for tasks in self._sessions.values())
                + self.engine.snapshot.num_leases)

    def _settle(self) -> None:
        if self._draining.is_set() and not any(self._sessions.values()):
            self._settled.set()

    async def _generate(self, request: worker_pb2.GenerateOnWorkerRequest, out: Outbox) -> None:
        params = params_from_proto(request.params)
        with self.telemetry.request_span(span_name(self.role), request.request_id,
                                         SpanKind.SERVER) as record:
            check_prompt("prompt_token_ids", request.prompt_token_ids, self.limits)
            prompt = list(request.prompt_token_ids)
            self.limits.check(prompt, params, ids_field="prompt_token_ids")
            record.num_samples = params.n  # once checked: the span's end lists each sample
            await self.engine.generate(request.request_id, prompt, params,
                                       relay(out, params.logprobs is not None, record.progress))

    async def _prefill_here(self, request: worker_pb2.DecodeRequest, out: Outbox) -> None:
        """A decode request without a lease: the router found no prefill worker to take its
        prompt, so this worker prefills it in chunks and samples its first tokens itself."""
        with self.telemetry.request_span(span_name(self.role), request.request_id,
                                         SpanKind.SERVER) as record:
            args = decode_args(request, self.limits)
            record.num_samples = args.params.n
            record.span.set_attribute("tandem.prefill.fallback", True)
            # Moved here mid-stream: the tokens its client has are recorded, not sampled.
            replay = Replay(args.first_token_ids, args.first_logprobs,
                            args.resume_token_ids) if args.first_token_ids else None
            prefix = await self._lent_prefix(request, args, replay is None)
            await self.engine.generate(request.request_id, args.prompt, args.params,
                                       relay(out, args.params.logprobs is not None,
                                             record.progress), replay, prefix)

    async def _lent_prefix(self, request: worker_pb2.DecodeRequest, args, usable: bool
                           ) -> RemoteKV | None:
        """The prompt prefix another worker lent for this request (prefix_kv), claimed: what
        the engine pulls instead of computing it; None without one, or when it cannot be used
        (a request that resumes, or asks for prompt logprobs, computes its prompt whole: its
        lease is released at once)."""
        if not request.HasField("prefix_kv"):
            return None
        if not usable or args.params.prompt_logprobs is not None:
            self.pools.let_go(request.prefix_kv)
            return None
        return await self.pools.claim_prefix(request.prefix_kv, args.prompt,
                                             args.params.cache_salt)

    async def _decode(self, request: worker_pb2.DecodeRequest, lease: HeldLease,
                      out: Outbox) -> None:
        with self.telemetry.request_span(span_name(self.role), request.request_id,
                                         SpanKind.SERVER) as record:
            # The KV-transfer span is a child of this one, the Release call joins its trace.
            lease.context = contextvars.copy_context()
            args = decode_args(request, self.limits)  # before anything is claimed or allocated
            # Counted once checked: the span's end lists each sample (n = 2**32 - 1 would be
            # a list of four billion).
            record.num_samples = args.params.n
            lease.role = request.kv.role or "prefill"
            if lease.role == "decode":  # live migration: the router hands it over once pulled
                lease.on_pulled = lambda: out.update(worker_pb2.RequestUpdate(
                    request_id=request.request_id, ready=True))
                record.span.set_attribute("tandem.migration.source", lease.address)
            try:
                await self.pools.peer(lease.address, request.kv.instance_id, lease.role)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # Pools that cannot pair (the reason names the flag): for the operator to
                    # fix, not for the router to retry elsewhere as if this worker were down.
                    raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"{lease.role} worker {lease.address} refused this "
                                      f"decode worker's KV pool: {e.details()}") from None
                raise WorkerError(grpc.StatusCode.UNAVAILABLE,
                                  f"{lease.role} worker {lease.address}: {e.details()}"
                                  ) from None
            remote = await claim(await self.pools.connected_stub(lease.address), lease, args,
                                 request.kv.instance_id)
            lease.owner = CORE  # from here the core ends it (LeaseDone), exactly once
            if self._renewing is None:
                renewal = LeaseRenewal(self._held, self.pools.stub, self.engine.leases_renewed,
                                       self.telemetry.metrics)
                self._renewing = asyncio.get_running_loop().create_task(renewal.run())
            await self.engine.decode(request.request_id, args.prompt, args.params, remote,
                                     relay(out, args.params.logprobs is not None,
                                           record.progress))

    # -- leases ------------------------------------------------------------------------------
    def _hold(self, kv: worker_pb2.KVLocation) -> HeldLease:
        """The lease a decode request carries, held from now until its one release. Refused
        without one, or with a token this worker already holds (a replay: never released on
        the second holder's behalf)."""
        if not kv.address or not kv.lease_id:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT,
                              "kv: a decode request needs the prefill worker's address and "
                              "the lease's token")
        if kv.lease_id in self._held:
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              "kv.lease_id: this lease is held by another request")
        lease = self._held[kv.lease_id] = HeldLease(kv.address, kv.lease_id)
        return lease

    def _end(self, lease: HeldLease) -> None:
        """The request ended, or was refused, before the engine core took its lease: release
        it, unless the prefill worker refused our claim (then it was never ours)."""
        if lease.owner == CORE or self._held.pop(lease.lease_id, None) is not lease:
            return
        if lease.owner == WORKER:
            self.pools.spawn_release(lease.address, lease.lease_id, lease.context)

    def lease_done(self, done: LeaseDone) -> None:
        """The engine core is done with a lease: record its pull, then release it."""
        lease = self._held.pop(done.lease_id, None)
        context = lease.context if lease is not None else None
        if done.pulled:
            self.telemetry.kv_transfer(context, done)
        if (done.pulled and done.error is None and lease is not None
                and lease.on_pulled is not None):
            self.telemetry.metrics.live_migrations.inc()
            self.telemetry.metrics.migrated_blocks.inc(done.num_blocks)
            lease.on_pulled()
        self.pools.spawn_release(done.address, done.lease_id, context)

    # -- live migration, source side ---------------------------------------------------------
    async def _lend(self, rid: str) -> worker_pb2.KVLocation | None:
        """A lease on request rid's KV for the decode worker it moves to, or None (it has none
        to lend here: token replay)."""
        self._unlend(rid)  # an earlier lease on it nobody claimed (a move that failed)
        lent = await self.engine.lend(rid)
        if lent is None:
            return None
        self._lent[rid] = lent.lease_id
        self.leases.offer(lent.lease_id, Claim(lent.block_ids, lent.num_tokens, lent.digest,
                                               lent.deadline))
        return worker_pb2.KVLocation(
            worker_id=self.worker_id, address=self.address, num_tokens=lent.num_tokens,
            lease_id=lent.lease_id, instance_id=self.instance_id, role="decode",
            lease_ttl_ms=int(max(lent.deadline - time.monotonic(), 0) * 1000))

    def _lend_for_rebalance(self, rid: str, tasks: dict[str, asyncio.Task],
                            out: Outbox) -> None:
        """The router asks to move request rid off this worker (rebalance): answer with a lease
        on its KV (RequestUpdate.move + rebalance; no kv: it cannot be lent now, and stays).
        Ignored for a request not (or no longer) here, or while draining (the drain's own ask
        goes out for every request)."""
        if self.role != "decode" or rid not in tasks or self._draining.is_set():
            return

        async def answer() -> None:
            kv = await self._lend(rid)
            if rid in tasks:  # else it ended meanwhile: _unlend ran, or runs at its end
                out.update(worker_pb2.RequestUpdate(request_id=rid, move=True, rebalance=True,
                                                    kv=kv))
            else:
                self._unlend(rid)

        task = asyncio.get_running_loop().create_task(answer())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def Move(self, request, context):  # noqa: N802 - gRPC method name
        """An operator asks to move one running request elsewhere (live migration), without
        draining: its KV is lent and its router asked (RequestUpdate.move + operator); answered
        once the request left this worker (moved: its router cancelled it here) or ended."""
        rid = request.request_id
        await checked(context, check_request_id, rid)
        if self.role != "decode" or self._draining.is_set():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.worker_id} "
                                + ("drains" if self.role == "decode" else "runs no decode"))
        out, task = next(((o, tasks[rid]) for o, tasks in self._sessions.items()
                          if rid in tasks), (None, None))
        if out is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request_id: no request {rid!r} runs on this worker")
        if rid in self._move_asked:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"request_id: a move of {rid!r} is already asked")
        self._move_asked.add(rid)
        try:
            t0 = time.monotonic()
            kv = await self._lend(rid)
            if kv is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"request_id: {rid!r} has no KV to lend now (waiting, "
                                    "prefilling, preempted, or a sample already finished): "
                                    "try again later")
            if task.done():  # ended while its KV was lent
                self._unlend(rid)
            else:
                out.update(worker_pb2.RequestUpdate(request_id=rid, move=True, operator=True,
                                                    kv=kv))
                await asyncio.wait([task])  # never cancels it: shielded by wait
            return worker_pb2.MoveResponse(moved=task.cancelled(),
                                           seconds=time.monotonic() - t0,
                                           num_tokens=kv.num_tokens)
        finally:
            self._move_asked.discard(rid)

    def _unlend(self, rid: str) -> None:
        """Request rid ended here: a lease lent on it that nobody claimed (its router had
        nowhere to move it) is released now rather than at its expiry."""
        lease_id = self._lent.pop(rid, None)
        if lease_id is not None and self.leases.claims.unclaimed(lease_id):
            self.leases.claims.forget(lease_id)
            task = asyncio.get_running_loop().create_task(self.engine.release(lease_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _hand_over(self, msg: worker_pb2.HandOver, tasks: dict[str, asyncio.Task]) -> None:
        """Live migration, destination: the router switched request msg.request_id here; its
        tokens made on the source since it was sent. Checked, then its engine decodes on. An
        unknown request (ended meanwhile) is ignored."""
        if msg.request_id not in tasks:
            return
        tokens = tuple(tuple(sample.token_ids) for sample in msg.tokens)
        try:
            for sample in tokens:
                if len(sample) > self.limits.max_model_len:
                    raise InvalidArgument("handover.tokens", f"{len(sample)} tokens")
                self.limits.check_ids("handover.tokens", sample)
        except InvalidArgument as e:
            tasks[msg.request_id].cancel()  # its one update says why
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        self.engine.hand_over(msg.request_id, tokens)

    async def on_stop(self) -> None:
        if self._renewing is not None:
            self._renewing.cancel()
            await asyncio.gather(self._renewing, return_exceptions=True)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.pools.close()


def role_options(role: str, transport: str | None = None) -> RoleOptions:
    """The decode or colocated (both) role; `transport`: how peers map its pool (None: the
    device's default)."""
    def make(engine, worker_id, address):
        return DecodeServicer(engine, worker_id, address, role)

    return RoleOptions(role, make, transport=transport)


def run(args: argparse.Namespace) -> int:
    # How peers reach a decode worker's pool: the decode worker a running request moves to,
    # and a worker of another host it lends a cached prefix (nixl across hosts).
    return main_worker(args, role_options(args.role, getattr(args, "transport", None)))


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="run a decode worker")
    p.set_defaults(role="decode")
    add_worker_args(p)
    p.add_argument("--transport", choices=transports.names(), default=None,
                   help="how other workers reach this pool (a request moved live, a prefix "
                        f"lent from its host tier): {transports.describe()}")
    p.set_defaults(func=run)
