"""The decode side of one disaggregated request, across decode workers.

    Prefill(prompt) ──first tokens + lease──▶ leg 1: decode worker A ──tokens──▶ client
                                                  ✗ A dies, hangs or drops the request
    Prefill(prompt) again (its blocks most likely cached) ──lease──▶ leg 2: decode worker B,
        carrying each sample's tokens so far (DecodeRequest.resume) ──tokens──▶ client

Worker B computes the KV of the tokens so far after the pulled prompt (as a preempted sequence
resumes by recompute) and samples on at the same sample index and output positions, so greedy
and seeded samples continue exactly as on A: the client sees a pause. One prefill of the prompt
serves every sample (they fork on B as they did on A); the alternative, a prefill per sample of
prompt + its outputs, would take n leases and a sampling position the prefill role does not
have.

With no prefill worker to take the prompt (router_svc/orchestrator.py, Fallback), a leg carries
no lease: its decode worker prefills the prompt itself and its stream brings the first tokens.
A request that moves with no prefill worker up carries every sample's tokens so far the same
way, and its new decode worker prefills the prompt, records those tokens and computes their KV
(engine Replay), then samples on.

This object owns the request's state across legs: every sample's output so far, which samples
ended, how often it moved, and the current lease, which it releases unless a decode request
carried it away: the decode worker releases it then. When the router's call to that worker
breaks before the leg's first update (the worker died or hung, perhaps before it claimed the
lease), the router releases it too, if still unclaimed: a worker that claimed it may live and
be copying the blocks.

A decode worker that drains (Drain, SIGTERM) asks for each of its requests to be moved
(Update.move) and decodes on meanwhile: the leg ends there and the request moves the same way,
not counted against the bounds below, when another decode worker is up; else it finishes there.
A request that reaches a decode worker as it begins to drain is refused with its lease handed
back unclaimed (RequestUpdate.draining, lease_returned): it goes to another decode worker with
the same lease, not prefilled again, and the refusal is no failure either.

Bounds: a leg that fails after it sent tokens moves the request (UNAVAILABLE: its worker died,
hung or lost the lease's KV; INTERNAL: gRPC failed inside the worker or its connection) at most
`max_migrations` times, then the request fails UNAVAILABLE saying so; a leg that fails before
its first token (UNAVAILABLE, INTERNAL, or
FAILED_PRECONDITION: a worker that refuses decode requests, never tried again for this request;
ABORTED: a lease that ran too short to pull, retried with a fresh one on any decode worker) is
retried likewise, at most once per decode worker beyond the moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from tandem.engine.config import cdiv
from tandem.router_svc.live_migration import Handed, LiveMove
from tandem.router_svc.rebalance import Candidate, Rebalancer
from tandem.router_svc.remote_prefix import LentPrefix
from tandem.router_svc.routing import RouteRequest
from tandem.router_svc.routing.policy import DISAGGREGATED, LOCAL
from tandem.router_svc.worker_stream import (
    Refused,
    SampleUpdate,
    StreamBroken,
    Update,
    until_done,
)
from tandem.router_svc.workers import Worker, WorkerSet
from tandem.runtime.convert import logprobs_from_proto
from tandem.runtime.request_trace import client_call
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)


class RouterError(Exception):
    """A request failed at the router; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def as_router_error(e: grpc.aio.AioRpcError, leg: str) -> RouterError:
    code = e.code()
    if code == grpc.StatusCode.CANCELLED:
        code = grpc.StatusCode.UNAVAILABLE
    return RouterError(code, f"{leg}: {e.details()}")


class DrainMove(grpc.aio.AioRpcError):
    """The leg's decode worker drains and asked for the request to be moved, and another decode
    worker can take it: the leg ends here (its request cancelled on the worker) and the request
    moves as after a failure, without counting against --max-migrations."""

    def __init__(self, address: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                         f"worker {address} drains")


@dataclass(frozen=True)
class Fallback:
    """No prefill worker takes this prompt: its decode worker prefills it. `reason`:
    no_prefill (none is up) or saturated (every one past --prefill-saturation)."""

    reason: str


class LegHost(Protocol):
    """What a request's decode legs ask of the orchestrator that runs them
    (router_svc/orchestrator.py, which imports this module: the legs know it by this shape)."""

    workers: WorkerSet
    max_migrations: int
    tracer: trace.Tracer
    rebalancer: Rebalancer | None  # moves requests off nearly full decode workers, when on

    async def prefill(self, rid: str, route: RouteRequest, params, deadline: float | None,
                      ctx: Context | None, may_fall_back: bool = False
                      ) -> tuple[Worker, worker_pb2.PrefillResponse] | Fallback: ...

    def pick(self, w: Worker | None, role: str) -> Worker: ...

    def remaining(self, deadline: float | None) -> float | None: ...

    def release_later(self, p: Worker, lease_id: str, ctx: Context | None = None) -> None: ...

    async def lend_prefix(self, route: RouteRequest, dest: Worker, cache_salt: str,
                          prompt_logprobs: bool, ctx: Context | None
                          ) -> LentPrefix | None: ...


@dataclass(eq=False)
class _Lease:
    """A prefill lease this router holds (DecodeLegs._lease) until a decode request carries it
    away: then it is the decode worker's to release, and no longer this router's."""

    worker: Worker
    kv: worker_pb2.KVLocation
    # Loop time by which its time to live (as the prefill worker answered it) has surely run
    # out, counted from its answer's arrival; None when the answer gave none.
    expires: float | None = None

    def expired(self) -> bool:
        return self.expires is not None and asyncio.get_running_loop().time() >= self.expires


class DecodeLegs:
    def __init__(self, orch: LegHost, rid: str, route: RouteRequest, params,
                 wire_params, deadline: float | None, ctx: Context | None) -> None:
        self.orch = orch
        self.rid = rid
        self.route = route  # the request as the routing policy sees it, for every pick
        self.prompt = route.prompt
        self.params = params
        self.wire_params = wire_params
        self.deadline = deadline  # loop time
        self.ctx = ctx  # the request's trace context: each call's CLIENT span is its child
        self.outputs: list[list[int]] = []  # per sample, every token the client has
        self.done: set[int] = set()  # samples that ended
        self.moves = 0  # legs that failed after sending tokens
        self.retries = 0  # legs that failed before
        self.drain_moves = 0  # legs ended because their worker drains (not counted above)
        self.live_moves = 0  # of those, moved by pulling their KV (router_svc/live_migration.py)
        self.rebalances = 0  # moved live off a nearly full decode worker (router_svc/rebalance.py)
        self._live_n = 0  # live migrations started: each destination request's id suffix
        # The current leg: its worker, its request id there, tokens it has sent; and a
        # rebalance move asked of it (its destination and why) until it ends.
        self._on: Worker | None = None
        self._leg_rid = ""
        self._leg_tokens = 0
        self._asked: tuple[Worker, str] | None = None
        # _leg_tokens when the rebalancer last looked at this request: a candidate only if it
        # made tokens since (decoding there now, not waiting or preempted: it has KV to lend).
        self._looked_at = 0
        # Decode workers that turned a leg of this request away before its first token
        # (UNAVAILABLE: shutting down, or gone): tried last.
        self._avoid: set[str] = set()
        self._lease: _Lease | None = None
        self._leg_lease: _Lease | None = None  # the lease the current leg carried, if any
        # A prefix another worker lent for the current leg's prefill on its decode worker,
        # this router's until its request is sent (router_svc/remote_prefix.py).
        self._prefix: LentPrefix | None = None
        self._first: worker_pb2.PrefillResponse | None = None
        # A move under way: the failed worker, its error, the tokens so far (counted once the
        # next leg is sent).
        self._moving: tuple[Worker, grpc.aio.AioRpcError, int] | None = None
        self._placing = True  # the first prefill asks the routing policy where the request runs
        # Placed wholly on a decode worker (RoutingPolicy.place): that worker, for the first leg.
        self._local: Worker | None = None
        self._local_first = False  # the first leg prefills on its decode worker by placement
        self._local_leg = False  # ... and has not been sent yet

    async def run(self) -> AsyncIterator[Update]:
        """The first tokens (from the prefill), then every decode leg's until all samples
        finish."""
        try:
            self.outputs = [[] for _ in range(self.params.n)]
            if await self._prefill():
                resp = self._first
                want_lp = self.params.logprobs is not None
                lps = logprobs_from_proto(resp.first_logprobs, self.params.n)
                self.outputs = [[t] for t in resp.first_token_ids]
                self.done = {i for i, r in enumerate(resp.finish_reasons) if r}
                yield Update([SampleUpdate(i, [tok], [lps[i]] if want_lp else [None],
                                           resp.finish_reasons[i] or None)
                              for i, tok in enumerate(resp.first_token_ids)],
                             len(self.prompt), resp.num_cached_tokens,
                             list(logprobs_from_proto(resp.prompt_logprobs,
                                                      len(resp.prompt_logprobs)))
                             if self.params.prompt_logprobs is not None else None)
                if len(self.done) == self.params.n:
                    return
            refused: dict[str, str] = {}  # workers that refused this request, and why
            handed: LiveMove | None = None  # a live migration's destination, its call open
            while True:
                if handed is not None:
                    d = handed.dst
                    try:
                        async for update in self._handed_leg(handed):
                            yield update
                        return
                    except Handed as h:  # its new worker drains too: moved live again
                        handed = h.move
                        continue
                    except grpc.aio.AioRpcError as e:
                        handed = None
                        self._failed(d, e, True, refused)
                        continue
                d = self._pick(refused)
                if d is None and refused:
                    # Every decode worker refused it (a KV pool the prefill worker's does not
                    # match, say): their reasons, which name the flag to change, not "none".
                    raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, "no decode worker "
                                      "took the request: " + "; ".join(
                                          f"{a}: {why}" for a, why in refused.items()))
                d = self.orch.pick(d, "decode")
                if self._lease is None:  # the last leg took it (or had none): a fresh one
                    await self._prefill()
                sent = False
                try:
                    async for update in self._leg(d):
                        sent = True
                        yield update
                    return
                except Handed as h:
                    handed = h.move
                except grpc.aio.AioRpcError as e:
                    self._failed(d, e, sent, refused)
        finally:
            lease = self._lease
            if lease is not None:  # never handed over: still ours
                self.orch.release_later(lease.worker, lease.kv.lease_id, self.ctx)

    def _pick(self, refused: dict[str, str]) -> Worker | None:
        """The next leg's decode worker: never one that refused the request, one that turned
        it away only when no other is up."""
        local, self._local = self._local, None
        if local is not None and local in self.orch.workers.by_role("decode") \
                and local.address not in refused:
            return local
        pick = self.orch.workers.pick_decode
        return (pick(self.route, "decode", set(refused) | self._avoid)
                or pick(self.route, "decode", set(refused)))

    def _can_move_from(self, d: Worker) -> bool:
        """d drains and asks for this request to be moved: whether another decode worker can
        take it (else d finishes it). d takes no new request from here on."""
        d.heard_draining()  # as its next poll will say
        return self.orch.workers.pick_decode(self.route, "decode", {d.address}) is not None

    async def _prefill(self) -> bool:
        """A lease for the next leg from a prefill worker (the first prefill's answer kept for
        its first tokens), or False: that leg's decode worker prefills the prompt itself (and,
        for a request that moves, records the tokens its client has)."""
        if self._placed_local():
            return False
        got = await self.orch.prefill(self.rid, self.route, self.wire_params, self.deadline,
                                      self.ctx, may_fall_back=True)
        if isinstance(got, Fallback):
            self.orch.workers.metrics.prefill_fallbacks.labels(got.reason).inc()
            span = trace.get_current_span(self.ctx)
            span.set_attribute("tandem.prefill.fallback", got.reason)
            span.add_event("prefill_fallback", {"tandem.reason": got.reason})
            return False
        p, resp = got
        if self._first is None and not any(self.outputs):  # the first tokens' prefill
            self._first = resp
        ttl = resp.kv.lease_ttl_ms / 1000
        self._lease = _Lease(p, resp.kv, asyncio.get_running_loop().time() + ttl if ttl else None)
        return True

    def _placed_local(self) -> bool:
        """Whether the routing policy places this request wholly on its decode worker (asked
        once, for the first prefill; a request that moves or retries prefills as it would
        without placement). The decision and what it weighed go on the request's span and
        tandem:placements."""
        if not self._placing:  # run() asks again before the first leg: the same answer
            local, self._local_leg = self._local_leg, False
            return local
        self._placing = False
        placed = self.orch.workers.place(self.route)
        if placed is None:
            return False
        p = placed.placement
        self.orch.workers.metrics.placements.labels(p.where, p.reason).inc()
        trace.get_current_span(self.ctx).set_attributes(p.attributes())
        if p.local:
            self._local = placed.decode
            self._local_first = self._local_leg = True
        return p.local

    def decode_request(self, request_id: str) -> worker_pb2.DecodeRequest:
        """A decode request for the next leg, with the tokens the client has (no lease)."""
        first = self._first
        req = worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=self.prompt,
                                       params=self.wire_params)
        if all(self.outputs):  # each sample's first token as the client has it (a fallback
            # leg's came from its decode worker); logprobs as the first prefill answered them
            req.first_token_ids.extend(out[0] for out in self.outputs)
            if first is not None:
                req.first_logprobs.extend(first.first_logprobs)
            if any(len(out) > 1 for out in self.outputs):
                req.resume.extend(worker_pb2.SampleTokens(token_ids=out[1:])
                                  for out in self.outputs)
        return req

    async def _leg(self, d: Worker) -> AsyncIterator[Update]:
        """One decode request on worker d; the lease goes with it (none: d prefills)."""
        lease = self._leg_lease = self._lease
        legs = self.moves + self.retries
        placed_local = legs == 0 and self._local_first
        # A leg of its own on the worker: a worker that hung holds the last one until it
        # hears the cancel, and may be the one this leg goes to.
        req = self.decode_request(self.rid if legs == 0 else f"{self.rid}.{legs}")
        if lease is not None:
            req.kv.CopyFrom(lease.kv)
        elif not any(self.outputs):  # d prefills a fresh prompt: its prefix, if lent
            self._prefix = await self.orch.lend_prefix(
                self.route, d, self.params.cache_salt, self.params.prompt_logprobs is not None,
                self.ctx)
            if self._prefix is not None:
                req.prefix_kv.CopyFrom(self._prefix.kv)

        handed: list[tuple[Worker, str]] = []  # what the request took to d: d's to release

        def sent() -> None:
            """The request is on its way: the lease is the decode worker's to release. Until
            then (a request refused here, say) it stays this router's. A request moving from
            a failed worker has moved now."""
            if lease is not None and self._lease is lease:
                self._lease = None
                handed.append((lease.worker, lease.kv.lease_id))
            if self._prefix is not None:  # a lent prefix too
                handed.append((self._prefix.lender, self._prefix.kv.lease_id))
            self._prefix = None
            if self._moving is not None:
                src, error, made = self._moving
                self._moving = None
                self.orch.workers.metrics.migrations.inc()
                self._event("migrated", src, error, made, to=d.address)

        with self._unsent_prefix_released(), \
                client_call("/tandem.v1.Worker/Stream", d.address, self.ctx,
                         self.orch.tracer,
                         name="decode_leg", **{"tandem.worker.role": "decode",
                                               "tandem.leg": legs,
                                               "tandem.request_id": req.request_id,
                                               "tandem.prefill.fallback":
                                                   lease is None and not placed_local,
                                               "tandem.placement":
                                                   LOCAL if lease is None else DISAGGREGATED}
                         ) as traced:
            call = d.stream.request(worker_pb2.StreamRequest(decode=req), traced.metadata,
                                    self.orch.remaining(self.deadline), on_sent=sent)
            d.in_flight += 1
            # Without a lease d prefills the prompt itself: work ahead of the next request
            # placed there until the first update comes (router_svc/routing/placement.py).
            backlog = len(self.prompt) if lease is None else 0
            d.local_prefill_tokens += backlog
            try:
                async with aclosing(call):
                    async for update in self._read(d, until_done(call, self.params.n,
                                                                 self.done), traced,
                                                   req.request_id):
                        d.local_prefill_tokens -= backlog
                        backlog = 0
                        handed.clear()  # d pulled what it took (and released it)
                        yield update
            except StreamBroken:
                # d is gone (or hung) before its first update: what the request took there
                # would pin blocks until its lease expires, if d never claimed it. Released
                # unless claimed (release_later): a d that claimed it may live and be copying
                # the blocks (it cancels the request, its router having left, and releases it).
                for lender, lease_id in handed:
                    self.orch.release_later(lender, lease_id, self.ctx)
                raise
            finally:
                d.in_flight -= 1
                d.local_prefill_tokens -= backlog

    @contextlib.contextmanager
    def _unsent_prefix_released(self) -> Iterator[None]:
        """A prefix lent for the leg (`_prefix`) whose request never left is this router's
        to release; once sent it is the decode worker's."""
        try:
            yield
        finally:
            lent, self._prefix = self._prefix, None
            if lent is not None:
                self.orch.release_later(lent.lender, lent.kv.lease_id, self.ctx)

    async def _handed_leg(self, move: LiveMove) -> AsyncIterator[Update]:
        """The leg on a live migration's destination, whose call is open (it said ready and
        got its HandOver)."""
        try:
            async with aclosing(move.updates):
                async for update in self._read(move.dst, move.updates, move.traced,
                                               move.request_id):
                    move.first_update()
                    yield update
        finally:
            with contextlib.suppress(BaseException):
                await move.call.aclose()
            move.close()

    async def _read(self, d: Worker, updates: AsyncIterator[Update], traced, leg_rid: str
                    ) -> AsyncIterator[Update]:
        """A leg's updates, each sample's tokens recorded as the client gets them."""
        first = self._first
        self._on, self._leg_rid, self._leg_tokens, self._looked_at = d, leg_rid, 0, 0
        rebalancer = self._rebalancer
        if rebalancer is not None:
            rebalancer.track(d, self)
        try:
            async for update in self._read_leg(d, updates, traced, first):
                yield update
        finally:
            self._on = None
            if rebalancer is not None:
                rebalancer.untrack(d, self)
            self._rebalanced("ended")  # a move asked and not done: the leg ended first

    async def _read_leg(self, d: Worker, updates: AsyncIterator[Update], traced, first
                        ) -> AsyncIterator[Update]:
        async for update in self._moves(d, updates):
            self._leg_tokens += sum(len(s.token_ids) for s in update.samples)
            for s in update.samples:
                self.outputs[s.index] += s.token_ids
                if s.finish_reason is not None:
                    self.done.add(s.index)
            if first is not None:  # the prefill side's
                update.num_cached_tokens = first.num_cached_tokens
            traced.complete = len(self.done) >= self.params.n
            yield update

    async def _moves(self, d: Worker, updates: AsyncIterator[Update]) -> AsyncIterator[Update]:
        """d's updates, until d drains and asks for the request to move. With a lease on its
        KV (Update.kv), a live migration starts (router_svc/live_migration.py) and d's tokens
        stream on until the destination has pulled the KV; then Handed ends this leg, and the
        request goes on there. Without one, or if the destination fails first, DrainMove (token
        replay). With no other decode worker up, d finishes the request."""
        move: LiveMove | None = None
        nxt: asyncio.Future | None = None
        handed = False
        try:
            while True:
                if nxt is None:
                    nxt = asyncio.ensure_future(anext(updates))
                waits = {nxt} if move is None else {nxt, move.ready}
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if nxt in done:  # d's update first: the client has it before any switch
                    got, nxt = nxt, None
                    try:
                        update = got.result()
                    except StopAsyncIteration:
                        return
                    if not update.move:
                        yield update
                    elif update.rebalance:  # the answer to ask_move
                        if move is None:
                            move = self._rebalance_move(d, update.kv)
                    elif update.operator:  # an operator asked d to move this one (Move)
                        if move is None:
                            move = self._live_move(d, update.kv, "operator")
                    elif move is None and self._can_move_from(d):
                        move = self._live_move(d, update.kv)
                        if move is None:
                            raise DrainMove(d.address)
                    continue
                if not move.ready.result() and move.cause != "drain":
                    log.warning("%s move of %s to %s failed (%s): it stays on %s", move.cause,
                                self.rid, move.dst.address, move.error, d.address)
                    cause = move.cause
                    await move.abandon()
                    move = None
                    if cause == "rebalance":
                        self._rebalanced("failed")
                    continue
                if not move.ready.result():  # the destination failed before its pull ended
                    log.warning("live migration of %s to %s failed (%s): token replay instead",
                                self.rid, move.dst.address, move.error)
                    self.orch.workers.metrics.live_migrations.labels("replayed").inc()
                    raise DrainMove(d.address)
                if not move.hand_over():
                    raise DrainMove(d.address)
                handed = True
                if move.cause == "rebalance":
                    self.rebalances += 1
                    self._rebalanced("moved")
                elif move.cause == "drain":
                    self.drain_moves += 1
                self.live_moves += 1
                raise Handed(move)
        finally:
            if nxt is not None:  # d's updates left unread: its request is cancelled there
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt
            if move is not None and not handed:
                await move.abandon()

    def _live_move(self, d: Worker, kv: worker_pb2.KVLocation | None, cause: str = "drain"
                   ) -> LiveMove | None:
        """A live migration from d to another decode worker, started; None when d lent no
        KV or no other decode worker is up (`cause`: drain, or operator: d's Move)."""
        if kv is None:
            return None
        dst = self.orch.workers.pick_decode(self.route, "decode", {d.address} | self._avoid)
        if dst is None:
            return None
        self._live_n += 1
        return LiveMove(self, d, dst, kv, f"{self.rid}.live{self._live_n}", cause=cause)

    # -- rebalance (router_svc/rebalance.py) -----------------------------------------------------
    def rebalance_candidate(self, block_size: int) -> Candidate | None:
        """This request as a rebalance would move it (asked once a round): None unless it is
        decoding on its leg's worker (tokens came from there since the last look) and no move is
        asked of it already."""
        looked, self._looked_at = self._looked_at, self._leg_tokens
        if self._on is None or self._asked is not None or self._leg_tokens == looked:
            return None
        made = [len(out) for out in self.outputs]
        blocks = cdiv(len(self.prompt) + max(made, default=0), block_size)
        max_tokens = self.params.max_tokens or 0
        remaining = sum(max(max_tokens - m, 0) for i, m in enumerate(made)
                        if i not in self.done)
        return Candidate(blocks, remaining)

    def ask_move(self, dst: Worker, reason: str) -> bool:
        """Ask the leg's worker to lend this request's KV for `dst` (StreamRequest.lend); the
        answer (RequestUpdate.move + rebalance) starts the live migration. False if the leg's
        call has ended."""
        if self._on is None or self._asked is not None:
            return False
        msg = worker_pb2.StreamRequest(lend=self._leg_rid)
        if not self._on.stream.send(self._leg_rid, msg):
            return False
        self._asked = (dst, reason)
        return True

    def _rebalance_move(self, d: Worker, kv: worker_pb2.KVLocation | None) -> LiveMove | None:
        """The live migration a rebalance asked for, started with the lease d lent; None when d
        lent nothing (the request stays) or the destination is no longer up."""
        if self._asked is None:  # a late answer to a move that ended
            return None
        dst, reason = self._asked
        if kv is None or not dst.healthy or dst.leaving:
            self._rebalanced("not_lent" if kv is None else "failed")
            return None
        self._live_n += 1
        return LiveMove(self, d, dst, kv, f"{self.rid}.live{self._live_n}",
                        cause="rebalance", reason=reason)

    def _rebalanced(self, outcome: str) -> None:
        """The rebalance move asked of this request ended so (nothing if none was asked)."""
        if self._asked is None:
            return
        self._asked = None
        if self._rebalancer is not None:
            self._rebalancer.done(self, outcome)

    @property
    def _rebalancer(self) -> Rebalancer | None:
        return getattr(self.orch, "rebalancer", None)  # a host without one never rebalances

    def _failed(self, d: Worker, e: grpc.aio.AioRpcError, sent: bool,
                refused: dict[str, str]) -> None:
        """After a leg failed: raise if the request cannot go on, else count the move."""
        code = e.code()
        if isinstance(e, DrainMove):  # planned: not a failure, not counted as one
            self.drain_moves += 1
            made = sum(len(out) for out in self.outputs)
            self._moving = (d, e, made) if sent else None
            log.info("decode worker %s drains: moving %s with its %d tokens", d.address,
                     self.rid, made)
            return
        if isinstance(e, Refused):
            leg = self._leg_lease
            if e.lease_returned and leg is not None and self._lease is None \
                    and not leg.expired():
                self._lease = leg  # the next leg takes it: no second prefill
            if e.draining:  # it began to drain as the request went out: planned, as a drain's
                d.heard_draining()  # move, not a failure, not counted as one
                log.info("decode worker %s drains: %s goes to another", d.address, self.rid)
                self._event("decode_retried", d, e, sum(len(out) for out in self.outputs))
                return
        if isinstance(e, StreamBroken):
            self.orch.workers.mark_down(d)
        # ABORTED: the leg's lease ran too short to pull (a busy worker, a short --lease-ttl);
        # any decode worker, this one too, may take the request with a fresh lease.
        # INTERNAL: the worker or the connection to it failed inside gRPC (a stream cut by a
        # worker restarting on the same port reads so), not the request's fault: moved like
        # UNAVAILABLE, within the same bounds.
        movable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL) or (
            code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED)
            and not sent)
        if not movable:
            raise as_router_error(e, f"decode worker {d.address}") from None
        # A lease whose time ran out before the decode worker claimed it (a busy worker, a
        # slow hop) is refused as any unknown token is: no refusal of that worker, which may
        # take the request with a fresh lease, as after ABORTED.
        expired = not sent and self._leg_lease is not None and self._leg_lease.expired()
        if code == grpc.StatusCode.FAILED_PRECONDITION and not expired:
            refused[d.address] = e.details()
        limit = self.orch.max_migrations
        if sent:
            self.moves += 1
            if self.moves > limit:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, (
                    f"decode worker {d.address}: {e.details()} (not moved again: moved "
                    f"{self.moves - 1} times, --max-migrations {limit})")) from None
            made = sum(len(out) for out in self.outputs)
            # Counted (tandem:request_migrations, the "migrated" event) once the next leg is
            # on its way: with no decode worker left to take it, nothing moved.
            self._moving = (d, e, made)
            log.warning("decode worker %s failed %s mid-stream (%s): moving it with its %d "
                        "tokens (move %d of at most %d)", d.address, self.rid, e.details(),
                        made, self.moves, limit)
        else:
            self.retries += 1
            if code == grpc.StatusCode.UNAVAILABLE:
                self._avoid.add(d.address)
            if self.retries > limit + len(self.orch.workers.by_role("decode", False)):
                raise as_router_error(e, f"decode worker {d.address}") from None
            log.warning("decode worker %s failed %s before its first token: %s for another",
                        d.address, self.rid,
                        "its lease" if self._lease is not None else "prefilling again")
            self._event("decode_retried", d, e, sum(len(out) for out in self.outputs))

    def _event(self, name: str, d: Worker, e: grpc.aio.AioRpcError, tokens: int,
               to: str | None = None) -> None:
        """On the request's span: a leg failed and the request goes on elsewhere (`to`: the
        decode worker it moved to)."""
        attrs = {"tandem.worker": d.address, "error.type": e.code().name,
                 "tandem.move.cause": "drain" if isinstance(e, DrainMove)
                 or (isinstance(e, Refused) and e.draining) else "failure",
                 "tandem.moves": self.moves, "tandem.retries": self.retries,
                 "tandem.tokens_so_far": tokens}
        if to is not None:
            attrs["tandem.worker.to"] = to
        trace.get_current_span(self.ctx).add_event(name, attrs)
