"""One request across the workers.

Disaggregated:
    Prefill(req) on a prefill worker ──▶ first token(s) + where the prompt's KV is (a lease)
    decode(req, kv, first tokens) on a decode worker ──▶ stream of tokens
Colocated: generate(req) on a `both` worker ──▶ stream of tokens.
Streamed legs ride the worker's multiplexed Stream call (router_svc/worker_stream.py).

A leg that fails with UNAVAILABLE (or FAILED_PRECONDITION) before its first token is retried on
another worker: a prefill or colocated leg as it was; a decode leg after a fresh prefill, since
its lease went with it (the decode request carries the first tokens the client already has).
After a leg's first token the request fails. Leaving early (client gone, deadline, stop
string, error) cancels the open leg, and a lease that no decode worker released is released
here. Once a decode request is sent, the lease belongs to the decode worker: it releases after
its copy, or when the request ends before the copy (a cancel follows its request on the same
call, so the worker sees every request it is asked to cancel). Expiry covers a decode worker
that died and a request lost with a broken Stream call.

A request id in flight is refused for a second request (INVALID_ARGUMENT) before anything is
taken for it: no prefill, no lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import grpc
from opentelemetry.context import Context

from engine.sampling_params import SamplingParams
from engine.serving.telemetry import trace_metadata
from router_svc.worker_stream import Metadata, SampleUpdate, Update
from router_svc.workers import Worker, WorkerSet
from tandem.convert import logprobs_from_proto, params_to_proto
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)


class RouterError(Exception):
    """A request failed at the router; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def _until_done(call: AsyncIterator[Update], num_samples: int,
                      done: set[int] | None = None) -> AsyncIterator[Update]:
    """A worker stream's updates. The one that finishes the last sample is held until the
    stream's end has been read, so a consumer that stops there never cancels a call that was
    completing (the worker would see a cancel instead of its own clean end)."""
    done = set(done or ())
    held: Update | None = None
    async for update in call:
        if held is not None:
            yield held
            held = None
        done.update(s.index for s in update.samples if s.finish_reason is not None)
        if len(done) >= num_samples:
            held = update
        else:
            yield update
    if held is not None:
        yield held


@dataclass(eq=False)
class _Lease:
    """A prefill lease the router holds: released here unless a decode request carrying it
    went out to a decode worker (`handed_over`), which then releases it."""

    worker: Worker
    lease_id: str
    handed_over: bool = False

    def hand_over(self) -> None:
        self.handed_over = True


def _retryable(e: grpc.aio.AioRpcError) -> bool:
    return e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)


def _as_router_error(e: grpc.aio.AioRpcError, leg: str) -> RouterError:
    code = e.code()
    if code == grpc.StatusCode.CANCELLED:
        code = grpc.StatusCode.UNAVAILABLE
    return RouterError(code, f"{leg}: {e.details()}")


class Orchestrator:
    def __init__(self, workers: WorkerSet) -> None:
        self.workers = workers
        self._background: set[asyncio.Task] = set()
        self._active: set[str] = set()  # request ids in flight

    async def run(self, request_id: str, prompt: list[int], params: SamplingParams,
                  timeout: float | None = None, trace_ctx: Context | None = None
                  ) -> AsyncIterator[Update]:
        """`trace_ctx`: the request's trace context, carried to the workers in each call's
        metadata."""
        if request_id in self._active:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"request_id {request_id!r} is in use")
        self._active.add(request_id)
        md = trace_metadata(trace_ctx)
        if self.workers.disaggregated:
            stream = self._disaggregated(request_id, prompt, params, timeout, md)
        else:
            stream = self._colocated(request_id, prompt, params, timeout, md)
        try:
            async with aclosing(stream):
                async for u in stream:
                    yield u
        finally:
            self._active.discard(request_id)

    # -- colocated ---------------------------------------------------------------------------
    async def _colocated(self, rid: str, prompt: list[int], params: SamplingParams,
                         timeout: float | None, md: Metadata) -> AsyncIterator[Update]:
        req = worker_pb2.GenerateOnWorkerRequest(request_id=rid, prompt_token_ids=prompt,
                                                 params=params_to_proto(params))
        tried: set[str] = set()
        while True:
            w = self._pick(self.workers.pick_decode("both", tried), "colocated")
            tried.add(w.address)
            call = w.stream.request(worker_pb2.StreamRequest(generate=req), md, timeout)
            sent = False
            w.in_flight += 1
            try:
                async with aclosing(call):
                    async for update in _until_done(call, params.n):
                        sent = True
                        yield update
                return
            except grpc.aio.AioRpcError as e:
                if not sent and _retryable(e):
                    self.workers.mark_down(w)
                    continue
                raise _as_router_error(e, f"worker {w.address}") from None
            finally:
                w.in_flight -= 1

    # -- disaggregated -----------------------------------------------------------------------
    async def _disaggregated(self, rid: str, prompt: list[int], params: SamplingParams,
                             timeout: float | None, md: Metadata) -> AsyncIterator[Update]:
        wire_params = params_to_proto(params)
        want_lp = params.logprobs is not None
        p, resp = await self._prefill(rid, prompt, wire_params, timeout, md)
        kv = resp.kv
        lease = _Lease(p, kv.lease_id)  # this router's until a decode request carries it
        try:
            first = Update([SampleUpdate(
                i, [tok], [logprobs_from_proto(resp.first_logprobs, params.n)[i]] if want_lp
                else [None], resp.finish_reasons[i] or None)
                for i, tok in enumerate(resp.first_token_ids)],
                len(prompt), resp.num_cached_tokens)
            yield first
            if all(resp.finish_reasons):
                return
            done = {i for i, r in enumerate(resp.finish_reasons) if r}
            tried: set[str] = set()
            while True:
                d = self._pick(self.workers.pick_decode("decode", tried), "decode")
                tried.add(d.address)
                call = d.stream.request(worker_pb2.StreamRequest(decode=worker_pb2.DecodeRequest(
                    request_id=rid, prompt_token_ids=prompt, params=wire_params, kv=kv,
                    first_token_ids=resp.first_token_ids, first_logprobs=resp.first_logprobs)),
                    md, timeout, on_sent=lease.hand_over)
                sent = False
                d.in_flight += 1
                try:
                    async with aclosing(call):
                        async for update in _until_done(call, params.n, done):
                            sent = True
                            update.num_cached_tokens = resp.num_cached_tokens  # prefill side's
                            yield update
                    return
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        self.workers.mark_down(d)
                    if sent or not _retryable(e):
                        raise _as_router_error(e, f"decode worker {d.address}") from None
                    log.warning("decode worker %s failed %s before its first token: prefilling "
                                "again for another", d.address, rid)
                finally:
                    d.in_flight -= 1
                # The lease went with the request: the refusing worker releases it (or it
                # expires). Another decode worker needs a lease of its own: a fresh prefill
                # (its prompt blocks are most likely still cached). The client has the first
                # tokens already: the decode request carries those, the new ones are dropped.
                p, again = await self._prefill(rid, prompt, wire_params, timeout, md)
                kv = again.kv
                lease = _Lease(p, kv.lease_id)
        finally:
            if not lease.handed_over:
                self._release_later(lease.worker, lease.lease_id, md)

    async def _prefill(self, rid: str, prompt: list[int], params, timeout: float | None,
                       md: Metadata) -> tuple[Worker, worker_pb2.PrefillResponse]:
        tried: set[str] = set()
        req = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=params)
        while True:
            p = self._pick(self.workers.pick_prefill(prompt, tried), "prefill")
            tried.add(p.address)
            p.in_flight += 1
            call = p.stub.Prefill(req, timeout=timeout, metadata=md)
            try:
                return p, await call
            except grpc.aio.AioRpcError as e:
                if _retryable(e):
                    self.workers.mark_down(p)
                    continue
                raise _as_router_error(e, f"prefill worker {p.address}") from None
            except asyncio.CancelledError:
                call.cancel()
                raise
            finally:
                p.in_flight -= 1

    def _pick(self, w: Worker | None, role: str) -> Worker:
        if w is None:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"no healthy {role} worker")
        return w

    def _release_later(self, p: Worker, lease_id: str, md: Metadata = None) -> None:
        async def release() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await p.stub.Release(worker_pb2.ReleaseRequest(lease_id=lease_id), timeout=10,
                                     metadata=md)

        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
