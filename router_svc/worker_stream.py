"""One multiplexed Stream call per worker: all of the router's requests to that worker ride it.

    router                                           worker (decode or both)
    request A ─┐                                     ┌─ task A ─┐
    request B ─┼─ StreamRequest(generate|decode) ──▶ ├─ task B ─┼─ engine
    request C ─┘   StreamRequest(cancel)             └─ task C ─┘
         ▲                                                │
         └──── StreamResponse: every request's new tokens of one engine step, in one message
                               (in columns; ends, failures and tokens with logprobs as updates)

A per-request server stream would cost one gRPC message (and its wake-ups on both sides) per
request per step; here a step costs one. The call opens on a request's first use and reopens
after it ends (the worker restarted). A worker that drains never ends a call itself while this
side may still send on it (a request it never read would leave its lease pinned until expiry):
it says so (StreamResponse.closing); from then the call carries only cancels of its own
requests, new ones go on a new call, and this side closes it once those requests have ended.
Each request's iterator raises
grpc.aio.AioRpcError with the worker's status, as a per-request call would: the worker's own
failures, DEADLINE_EXCEEDED past the request's timeout, and StreamBroken (UNAVAILABLE) when the
call breaks or is abandoned (its worker stopped answering: `abandon`).
Leaving the iterator before the request's last update cancels the request on the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from tandem.engine.sampling_params import TokenLogprobs
from tandem.runtime.convert import logprobs_from_proto
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

_STATUS = {code.value[0]: code for code in grpc.StatusCode}
Metadata = tuple[tuple[str, str], ...] | None  # gRPC call metadata: the trace context


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class StreamBroken(grpc.aio.AioRpcError):
    """The call to the worker broke (or was given up on), not the request: the worker is gone
    or unreachable, as far as this router can tell."""


class Refused(grpc.aio.AioRpcError):
    """The worker turned the request away (its one update, RequestUpdate): `draining`, because
    it drains; `lease_returned`, before claiming the lease it was handed, which is this
    router's again."""

    def __init__(self, code: grpc.StatusCode, details: str, draining: bool,
                 lease_returned: bool) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
        self.draining = draining
        self.lease_returned = lease_returned


@dataclass
class SampleUpdate:
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    finish_reason: str | None  # stop | length | abort | None while it goes on


@dataclass
class Update:
    """One request's new tokens of one engine step."""
    samples: list[SampleUpdate]
    num_prompt_tokens: int
    num_cached_tokens: int
    # params.prompt_logprobs: prompt tokens 1.., with the request's first tokens
    prompt_logprobs: list[TokenLogprobs] | None = None
    # No tokens: the worker drains and asks for the request to be moved (RequestUpdate.move);
    # it decodes on until the request is cancelled there. `kv`: a lease on the request's KV
    # there, for the next decode worker to pull (live migration); None: token replay.
    move: bool = False
    kv: worker_pb2.KVLocation | None = None
    # With move: the answer to the router's lend (rebalance), not a drain's ask.
    rebalance: bool = False
    # With move: an operator asked to move this one request (the worker's Move), not a drain.
    operator: bool = False
    # No tokens: the KV a decode worker lent is pulled here; hand the request over (HandOver).
    ready: bool = False


def _by_request(resp: worker_pb2.StreamResponse) -> list[tuple[str, Update]]:
    """_tokens_by_request, each request's prompt logprobs on its first update."""
    out = _tokens_by_request(resp.tokens)
    for pl in resp.prompt_logprobs:
        first = next((u for rid, u in out if rid == pl.request_id), None)
        if first is not None:
            first.prompt_logprobs = list(logprobs_from_proto(pl.logprobs, len(pl.logprobs)))
    return out


def _tokens_by_request(cols: worker_pb2.TokenColumns) -> list[tuple[str, Update]]:
    """A message's token columns as one Update per request and step, in order (a request
    appears again when the message carries more than one of its steps: each step lists every
    sample it advanced, so a sample seen twice starts the next one)."""
    out: list[tuple[str, Update]] = []
    if not cols.request_id:
        return out
    current: dict[str, Update] = {}
    seen: dict[str, set[int]] = {}
    token_ids = list(cols.token_ids)
    pos = lp_pos = 0
    for rid, sample, n, reason, n_prompt, n_cached, with_lp in zip(
            cols.request_id, cols.sample_index, cols.num_tokens, cols.finish_reason,
            cols.num_prompt_tokens, cols.num_cached_tokens, cols.with_logprobs, strict=True):
        update = current.get(rid)
        if update is None or sample in seen[rid]:  # a later step of this request
            update = current[rid] = Update([], n_prompt, n_cached)
            seen[rid] = set()
            out.append((rid, update))
        seen[rid].add(sample)
        if with_lp:
            logprobs = list(logprobs_from_proto(cols.logprobs[lp_pos:lp_pos + n], n))
            lp_pos += n
        else:
            logprobs = [None] * n
        update.samples.append(SampleUpdate(sample, token_ids[pos:pos + n], logprobs,
                                           reason or None))
        pos += n
    return out


@dataclass(eq=False)
class _Call:
    """One Stream call: what this side sends on it (None closes its side) and the requests
    sent on it that have not ended."""

    outbox: asyncio.Queue[worker_pb2.StreamRequest | None]
    rids: set[str] = field(default_factory=set)
    reader: asyncio.Task | None = None
    closing: bool = False  # the worker drains: no new request here; closed once rids is empty
    ended: bool = False  # nothing goes out on it any more
    abandoned: str | None = None  # why abandon() ended it

    def close_when_idle(self) -> None:
        if self.closing and not self.rids:
            self.outbox.put_nowait(None)


class WorkerStream:
    def __init__(self, stub: worker_pb2_grpc.WorkerStub, address: str) -> None:
        self.stub = stub
        self.address = address
        self._call: _Call | None = None  # the call new requests go on
        self._calls: set[_Call] = set()  # every call still open (a closing one, the new one)
        self._inboxes: dict[str, asyncio.Queue] = {}
        # Told when the worker says it drains (StreamResponse.closing), before the next poll.
        self.on_closing: Callable[[], None] | None = None

    async def request(self, msg: worker_pb2.StreamRequest, metadata: Metadata = None,
                      timeout: float | None = None,
                      on_sent: Callable[[], None] | None = None) -> AsyncIterator[Update]:
        """Send a generate or decode request; its updates, one per engine step, until its
        samples finish. `on_sent` is called once the request is on its way to the worker (a
        request refused here never is: what it carries is still the caller's)."""
        rid = getattr(msg, msg.WhichOneof("kind")).request_id
        if rid in self._inboxes:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT, f"request_id {rid!r} is in use")
        if metadata:
            msg.trace_context.update(dict(metadata))
        inbox: asyncio.Queue = asyncio.Queue()
        self._inboxes[rid] = inbox
        call = self._open()
        call.rids.add(rid)
        call.outbox.put_nowait(msg)
        if on_sent is not None:
            on_sent()
        done = False
        try:
            async with asyncio.timeout(timeout):
                while True:
                    u = await inbox.get()
                    if isinstance(u, Update):
                        yield u
                        continue
                    if isinstance(u, grpc.aio.AioRpcError):
                        done = True  # the call broke: nothing left to cancel
                        raise u
                    if u.move and not u.done:
                        yield Update([], 0, 0, move=True,
                                     kv=u.kv if u.HasField("kv") else None,
                                     rebalance=u.rebalance, operator=u.operator)
                        continue
                    if u.ready and not u.done:
                        yield Update([], 0, 0, ready=True)
                        continue
                    if u.done:
                        done = True
                        if u.error_code:
                            code = _STATUS.get(u.error_code, grpc.StatusCode.UNKNOWN)
                            if u.draining or u.lease_returned:
                                raise Refused(code, u.error_message, u.draining,
                                              u.lease_returned)
                            raise _error(code, u.error_message)
                        return
        except TimeoutError:
            raise _error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
        finally:
            del self._inboxes[rid]
            call.rids.discard(rid)
            if not done and not call.ended:
                call.outbox.put_nowait(worker_pb2.StreamRequest(cancel=rid))
            call.close_when_idle()  # after its cancel

    def send(self, rid: str, msg: worker_pb2.StreamRequest) -> bool:
        """Another message for request rid (a HandOver) on the call it went out on; False
        when that call has ended (the request's iterator hears why)."""
        call = next((c for c in self._calls if rid in c.rids), None)
        if call is None or call.ended:
            return False
        call.outbox.put_nowait(msg)
        return True

    def _open(self) -> _Call:
        if self._call is None:
            call = self._call = _Call(asyncio.Queue())
            self._calls.add(call)
            call.reader = asyncio.create_task(self._read(call))
        return self._call

    async def _read(self, c: _Call) -> None:
        outbox = c.outbox

        async def requests() -> AsyncIterator[worker_pb2.StreamRequest]:
            while (msg := await outbox.get()) is not None:
                yield msg

        call = self.stub.Stream(requests())
        error: grpc.aio.AioRpcError = StreamBroken(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
            f"stream to {self.address} ended")
        try:
            async for resp in call:
                for rid, update in _by_request(resp):  # tokens first, then ends
                    inbox = self._inboxes.get(rid)
                    if inbox is not None:
                        inbox.put_nowait(update)
                for u in resp.updates:
                    inbox = self._inboxes.get(u.request_id)
                    if inbox is not None:
                        inbox.put_nowait(u)
                if resp.closing and not c.closing:  # the worker drains: new requests elsewhere
                    c.closing = True
                    if self._call is c:
                        self._call = None
                    c.close_when_idle()
                    if self.on_closing is not None:
                        self.on_closing()
        except grpc.aio.AioRpcError as e:
            error = StreamBroken(grpc.StatusCode.UNAVAILABLE
                                 if e.code() == grpc.StatusCode.CANCELLED else e.code(),
                                 grpc.aio.Metadata(), grpc.aio.Metadata(),
                                 e.details() or str(e.code()))
            log.warning("stream to worker %s broke: %s", self.address, e.code().name)
        except asyncio.CancelledError:
            if c.abandoned is None:
                raise
            error = StreamBroken(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                 grpc.aio.Metadata(), c.abandoned)
        finally:
            call.cancel()
            c.ended = True
            # End the request iterator too: gRPC's task that reads it would otherwise wait on
            # the outbox for good, and be destroyed pending (with the generator inside it,
            # "aclose(): asynchronous generator is already running") when collected.
            outbox.put_nowait(None)
            self._calls.discard(c)
            if self._call is c:
                self._call = None
            # Requests sent on this call that have not ended will hear nothing more.
            for rid in c.rids:
                inbox = self._inboxes.get(rid)
                if inbox is not None:
                    inbox.put_nowait(error)

    def abandon(self, reason: str) -> None:
        """Give up on the calls now (their worker stopped answering): every request on them
        fails with StreamBroken(UNAVAILABLE, reason); the next request opens a new call.
        Cancelling a call also tells the worker, should it come back, to drop what it had."""
        for c in list(self._calls):
            if c.reader is not None and not c.reader.done():
                c.abandoned = reason
                c.reader.cancel()

    async def close(self) -> None:
        self._call = None
        for c in list(self._calls):
            c.outbox.put_nowait(None)
            if c.reader is not None:
                c.reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await c.reader


async def until_done(call: AsyncIterator[Update], num_samples: int,
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
