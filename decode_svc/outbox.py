"""The output side of a worker's Stream call: what a request's steps, end or failure become on
the wire. New tokens go out in columns (TokenColumns: a few list appends per request and step,
their logprobs as one more column when the request asked for them); ends and failures as
RequestUpdates, read after the columns."""

from __future__ import annotations

import asyncio

import grpc

from tandem.engine.sequence import SeqOutput
from tandem.engine.serving.async_engine import OutputSink
from tandem.runtime.convert import logprobs_to_proto
from tandem.runtime.request_trace import Progress
from tandem.runtime.worker import WorkerError, status_of
from tandem.v1 import worker_pb2


class Outbox:
    """What one Stream call has yet to send: new tokens as columns (plain lists until the
    write, so a request's step costs a few appends) and updates (ends, failures). The call
    writes everything gathered since its last write as one message."""

    def __init__(self) -> None:
        self._ready = asyncio.Event()
        self.closing = False  # end the call once its requests are done
        self._drain_note = False  # the router is yet to hear that this worker drains
        self._clear()

    def _clear(self) -> None:
        self._request_id: list[str] = []
        self._sample_index: list[int] = []
        self._num_tokens: list[int] = []
        self._token_ids: list[int] = []
        self._finish_reason: list[str] = []
        self._num_prompt_tokens: list[int] = []
        self._num_cached_tokens: list[int] = []
        self._with_logprobs: list[bool] = []
        self._logprobs: list = []  # common_pb2.TokenLogprobs, one per token of those entries
        self._prompt_logprobs: list[worker_pb2.PromptLogprobs] = []
        self._updates: list[worker_pb2.RequestUpdate] = []

    def tokens(self, outs: list[SeqOutput], with_logprobs: bool = False) -> None:
        for o in outs:
            self._request_id.append(o.request_id)
            self._sample_index.append(o.sample_index)
            self._num_tokens.append(len(o.new_token_ids))
            self._token_ids += o.new_token_ids
            self._finish_reason.append(o.finish_reason.value if o.finish_reason else "")
            self._num_prompt_tokens.append(o.num_prompt_tokens)
            self._num_cached_tokens.append(o.num_cached_tokens)
            self._with_logprobs.append(with_logprobs)
            if with_logprobs:
                self._logprobs += [logprobs_to_proto(lp) for lp in o.new_logprobs]
            if o.prompt_logprobs is not None:
                self._prompt_logprobs.append(worker_pb2.PromptLogprobs(
                    request_id=o.request_id,
                    logprobs=[logprobs_to_proto(lp) for lp in o.prompt_logprobs]))
        self._ready.set()

    def update(self, update: worker_pb2.RequestUpdate) -> None:
        self._updates.append(update)
        self._ready.set()

    def empty(self) -> bool:
        return not self._request_id and not self._updates and not self._drain_note

    def close(self) -> None:
        """The router closed its side: end the call once its requests are done."""
        self.closing = True
        self._ready.set()

    def drain(self) -> None:
        """Tell the router this worker drains (StreamResponse.closing): it sends no new request
        here and closes its side once its requests here have ended."""
        self._drain_note = True
        self._ready.set()

    async def take(self) -> worker_pb2.StreamResponse | None:
        """Wait until there is news: everything gathered as one message, or None if only
        `closing` changed."""
        await self._ready.wait()
        self._ready.clear()
        if self.empty():
            return None
        msg = worker_pb2.StreamResponse(updates=self._updates,
                                        prompt_logprobs=self._prompt_logprobs,
                                        closing=self._drain_note)
        cols = msg.tokens
        cols.request_id.extend(self._request_id)
        cols.sample_index.extend(self._sample_index)
        cols.num_tokens.extend(self._num_tokens)
        cols.token_ids.extend(self._token_ids)
        cols.finish_reason.extend(self._finish_reason)
        cols.num_prompt_tokens.extend(self._num_prompt_tokens)
        cols.num_cached_tokens.extend(self._num_cached_tokens)
        cols.with_logprobs.extend(self._with_logprobs)
        cols.logprobs.extend(self._logprobs)
        self._clear()
        self._drain_note = False  # said once
        return msg


def failure_message(request_id: str, exc: BaseException) -> worker_pb2.RequestUpdate:
    """A request's last update when it failed: the gRPC status that reports `exc` (and, for a
    refusal, whether the worker drains and whether the request's lease is the router's again)."""
    code, message = status_of(exc)
    refused = exc if isinstance(exc, WorkerError) else None
    return worker_pb2.RequestUpdate(request_id=request_id, done=True,
                                    error_code=code.value[0], error_message=message,
                                    draining=refused is not None and refused.draining,
                                    lease_returned=refused is not None and refused.lease_returned)


def relay(outbox: Outbox, with_logprobs: bool, progress: Progress) -> OutputSink:
    """A request's sink: each step's outputs into the call's outbox, and into the request's
    progress for its span (tokens so far, the finished samples). An engine-side failure (a KV
    pull that failed) fails the request."""
    def sink(outs: list[SeqOutput]) -> None:
        for o in outs:
            if o.error is not None:
                raise WorkerError(grpc.StatusCode.UNAVAILABLE, o.error)
            progress.seen(o)
        outbox.tokens(outs, with_logprobs)
    return sink
