"""One request across the workers.

Disaggregated:
    Prefill(req) on a prefill worker ──▶ first token(s) + where the prompt's KV is (a lease)
    decode(req, kv, first tokens) on a decode worker ──▶ stream of tokens
Colocated: generate(req) on a `both` worker ──▶ stream of tokens.
Streamed legs ride the worker's multiplexed Stream call (router_svc/worker_stream.py).

A prefill or colocated leg that fails with UNAVAILABLE (or FAILED_PRECONDITION) before its first
token is retried on another worker. A disaggregated request's decode legs are router_svc/
decode_legs.py's: one that fails is retried after a fresh prefill, and one that fails after it
sent tokens (its worker died or hung) moves to another decode worker with every sample's tokens
so far, at most --max-migrations times; a colocated leg that fails after its first token fails
the request. Leaving early (client gone, deadline, stop string, error) cancels the open leg, and
a lease that no decode worker took is released here. Once a decode request is sent, the lease
belongs to the decode worker: it releases after its copy, or when the request ends before the
copy (a cancel follows its request on the same call, so the worker sees every request it is
asked to cancel). Expiry covers a decode worker that died and a request lost with a broken
Stream call. The request's timeout is one deadline for all of its legs.

Prefill fallback: when no prefill worker is up (or every one has at least
--prefill-saturation requests ahead of a new one: this router's in flight and other routers'
waiting, Worker.queued), a disaggregated request's prompt goes to its decode worker, which
prefills it itself in chunks (a decode request without a lease); the request's span says so
(`tandem.prefill.fallback`: the reason) and tandem:prefill_fallbacks counts it.
--no-prefill-fallback turns this off (the request then fails UNAVAILABLE as with no decode
worker).

A request id in flight is refused for a second request (INVALID_ARGUMENT) before anything is
taken for it: no prefill, no lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from tandem.engine.sampling_params import SamplingParams
from tandem.router_svc.decode_legs import (
    DecodeLegs,
    Fallback,
    RouterError,
    as_router_error,
    until_done,
)
from tandem.router_svc.rebalance import RebalanceConfig, Rebalancer
from tandem.router_svc.remote_prefix import LentPrefix, PrefixLending
from tandem.router_svc.routing import RouteRequest
from tandem.router_svc.worker_stream import SampleUpdate, StreamBroken, Update
from tandem.router_svc.workers import Worker, WorkerSet, unless_lost
from tandem.runtime.convert import params_to_proto
from tandem.runtime.lifecycle import refused_draining
from tandem.runtime.request_trace import client_call
from tandem.v1 import worker_pb2

__all__ = ["Orchestrator", "RouterError", "SampleUpdate", "Update"]

log = logging.getLogger(__name__)


STREAM = "/tandem.v1.Worker/Stream"  # streamed legs: one request each on the worker's call


def _retryable(e: grpc.aio.AioRpcError) -> bool:
    """A worker's answer that sends the call to another worker. CANCELLED counts: the router's
    own cancels end its calls with asyncio.CancelledError, so a CANCELLED status comes from the
    worker's side, where gRPC core ends a call its stopping server never handed to a handler
    with CANCELLED (a Prefill arriving as a drained worker closes its server)."""
    return e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
                        grpc.StatusCode.CANCELLED)


class Orchestrator:
    def __init__(self, workers: WorkerSet, max_migrations: int = 3,
                 prefill_saturation: int = 0, rebalance: RebalanceConfig | None = None,
                 remote_prefix_blocks: int = 0) -> None:
        self.workers = workers
        self.max_migrations = max_migrations
        # Moves running requests off nearly full decode workers (--rebalance): started with
        # start(), off by default.
        self.rebalancer = (Rebalancer(workers, rebalance)
                           if rebalance is not None and rebalance.enabled else None)
        # Requests in flight or waiting on every prefill worker past which a prompt is
        # prefilled on its decode worker instead (0: only when no prefill worker is up).
        self.prefill_saturation = prefill_saturation
        self._background: set[asyncio.Task] = set()
        self._active: set[str] = set()  # request ids in flight
        # CLIENT spans of the calls to workers (the Frontend gives it its own).
        self.tracer: trace.Tracer = trace.get_tracer("tandem")
        # A prompt's prefix in a host tier its computing worker cannot read, lent to it by the
        # worker holding it (router_svc/remote_prefix.py; --remote-prefix-blocks, 0: off).
        self.lending = (PrefixLending(workers, remote_prefix_blocks, self.tracer)
                        if remote_prefix_blocks > 0 else None)

    async def run(self, request_id: str, prompt: list[int], params: SamplingParams,
                  timeout: float | None = None, trace_ctx: Context | None = None
                  ) -> AsyncIterator[Update]:
        """`trace_ctx`: the request's trace context, carried to the workers in each call's
        metadata."""
        if request_id in self._active:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"request_id {request_id!r} is in use")
        self._active.add(request_id)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            # Once per request: a long prompt's hashes are made off the loop.
            route = await self.workers.route_request(prompt, params.cache_salt, params.priority)
        except BaseException:
            self._active.discard(request_id)
            raise
        if self.workers.disaggregated:
            wire_params = params_to_proto(params)
            stream = DecodeLegs(self, request_id, route, params, wire_params, deadline,
                                trace_ctx).run()
        else:
            stream = self._colocated(request_id, route, params, deadline, trace_ctx)
        try:
            async with aclosing(stream):
                async for u in stream:
                    yield u
        finally:
            self._active.discard(request_id)

    # -- colocated ---------------------------------------------------------------------------
    async def _colocated(self, rid: str, route: RouteRequest, params: SamplingParams,
                         deadline: float | None, ctx: Context | None) -> AsyncIterator[Update]:
        req = worker_pb2.GenerateOnWorkerRequest(request_id=rid, prompt_token_ids=route.prompt,
                                                 params=params_to_proto(params))
        tried: set[str] = set()
        while True:
            w = self.pick(self.workers.pick_decode(route, "both", tried), "colocated")
            tried.add(w.address)
            sent = False
            ended: set[int] = set()
            w.in_flight += 1
            try:
                with client_call(STREAM, w.address, ctx, self.tracer, name="generate_leg",
                                 **{"tandem.worker.role": "both"}) as traced:
                    call = w.stream.request(worker_pb2.StreamRequest(generate=req),
                                            traced.metadata, self.remaining(deadline))
                    async with aclosing(call):
                        async for update in until_done(call, params.n):
                            if update.move:  # nowhere to move a colocated request: it ends there
                                continue
                            sent = True
                            ended.update(s.index for s in update.samples
                                         if s.finish_reason is not None)
                            traced.complete = len(ended) >= params.n
                            yield update
                return
            except grpc.aio.AioRpcError as e:
                if isinstance(e, StreamBroken) or (not sent and _retryable(e)):
                    self.workers.mark_down(w)
                if not sent and _retryable(e):
                    continue
                raise as_router_error(e, f"worker {w.address}") from None
            finally:
                w.in_flight -= 1

    # -- what the legs share -----------------------------------------------------------------
    def fallback(self, tried: set[str] = frozenset()) -> Fallback | None:
        """Whether a prompt goes to its decode worker rather than to a prefill worker (none
        up but those in `tried`, or all saturated); None when fallback is off."""
        if not self.workers.prefill_fallback:
            return None
        up = [w for w in self.workers.by_role("prefill") if w.address not in tried]
        if not up:
            return Fallback("no_prefill") if self.workers.by_role("decode") else None
        bound = self.prefill_saturation
        if bound and all(w.queued >= bound for w in up):
            return Fallback("saturated")
        return None

    async def prefill(self, rid: str, route: RouteRequest, params, deadline: float | None,
                      ctx: Context | None, may_fall_back: bool = False
                      ) -> tuple[Worker, worker_pb2.PrefillResponse] | Fallback:
        """A prefill on a healthy prefill worker: the first tokens and the lease, now this
        caller's. A worker that fails it (`_retryable`) or stops answering is taken out and
        another tried. `route`: the request as the routing policy sees it.
        `may_fall_back`: a Fallback instead when no prefill worker should take it (fallback)."""
        tried: set[str] = set()
        req = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=route.prompt,
                                        params=params)
        while True:
            if may_fall_back and (fb := self.fallback(tried)) is not None:
                return fb
            p = self.pick(self.workers.pick_prefill(route, tried), "prefill")
            tried.add(p.address)
            req.ClearField("prefix_kv")
            lent = await self.lend_prefix(route, p, params.cache_salt,
                                          params.HasField("prompt_logprobs"), ctx)
            if lent is not None:
                req.prefix_kv.CopyFrom(lent.kv)
            try:
                timeout = self.remaining(deadline)
            except RouterError:  # never sent: the lent prefix is still this router's
                if lent is not None:
                    self.release_later(lent.lender, lent.kv.lease_id, ctx)
                raise
            p.in_flight += 1
            try:  # once sent, a lent prefix is p's to release (or, unclaimed, ours again)
                with client_call("/tandem.v1.Worker/Prefill", p.address, ctx,
                                 self.tracer) as traced:
                    call = p.stub.Prefill(req, timeout=timeout, metadata=traced.metadata)
                    resp = await unless_lost(p, call)
                # The router vouches for where the KV is: the prefill worker of its own
                # membership it called, whatever address that worker's answer names. A decode
                # worker maps pools only where a router sends it.
                resp.kv.address = p.address
                return p, resp
            except grpc.aio.AioRpcError as e:
                if _retryable(e):
                    if refused_draining(e):  # not a failure: no new prompt there from now
                        p.heard_draining()
                    else:
                        self.workers.mark_down(p)
                    if lent is not None:  # p died or refused, perhaps before its claim
                        self.release_later(lent.lender, lent.kv.lease_id, ctx)
                    continue
                raise as_router_error(e, f"prefill worker {p.address}") from None
            finally:
                p.in_flight -= 1

    async def lend_prefix(self, route: RouteRequest, dest: Worker, cache_salt: str,
                          prompt_logprobs: bool, ctx: Context | None) -> LentPrefix | None:
        """A lease on the prompt's prefix from a worker whose host tier `dest` cannot read,
        for `dest` to pull instead of computing it (router_svc/remote_prefix.py); None when
        off, when none holds enough more than `dest`, or for prompt logprobs (computed at
        every position)."""
        if self.lending is None or prompt_logprobs:
            return None
        return await self.lending.lend(route, dest, cache_salt, ctx)

    def pick(self, w: Worker | None, role: str) -> Worker:
        if w is None:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"no healthy {role} worker")
        return w

    @staticmethod
    def remaining(deadline: float | None) -> float | None:
        """Seconds left before the request's deadline (None: no deadline)."""
        if deadline is None:
            return None
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        return left

    def release_later(self, p: Worker, lease_id: str, ctx: Context | None = None) -> None:
        """A Release to p, in the background, of a lease this router got: only while nobody has
        claimed it (if_unclaimed). The router never claims; a worker that did may be copying the
        blocks, and releases the lease itself (or it expires)."""
        async def release() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError), \
                    client_call("/tandem.v1.Worker/Release", p.address, ctx,
                                self.tracer) as traced:
                await p.stub.Release(worker_pb2.ReleaseRequest(lease_id=lease_id,
                                                               if_unclaimed=True),
                                     timeout=10, metadata=traced.metadata)

        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def start(self) -> None:
        """Background work that follows the workers' polls (rebalance, when on)."""
        if self.rebalancer is not None:
            self.rebalancer.start()

    async def close(self) -> None:
        if self.rebalancer is not None:
            await self.rebalancer.close()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
