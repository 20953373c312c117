"""The engine on its own thread, for asyncio services.

    asyncio loop (gRPC, HTTP)                     engine thread
    ─────────────────────────                     ─────────────
    add / abort / release  ── commands queue ──▶  run commands between steps
    per-request queues     ◀── one callback ────  step(): outputs of all requests
                                per step

Every engine mutation happens on the engine thread, so the engine needs no locks. A request's
stream ends when all its samples have finished; a consumer that stops early (client gone,
deadline) aborts the request, which frees its blocks on the next turn of the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, RemoteKV, SeqOutput

T = TypeVar("T")
log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how often an idle engine thread looks at lease deadlines


@dataclass
class EngineSnapshot:
    """Load figures, read on the engine thread after each step (cheap to read anywhere)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_leases: int = 0


class AsyncEngine:
    def __init__(self, engine: LLMEngine,
                 on_step: Callable[[LLMEngine, list[SeqOutput]], None] | None = None,
                 on_abort: Callable[[int], None] | None = None) -> None:
        self.engine = engine
        # Metrics hooks, called on the engine thread: after each step, and with the number of
        # unfinished sequences when a request is aborted (outputs of aborts are never made).
        self.on_step = on_step
        self.on_abort = on_abort
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue[list[SeqOutput]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self.snapshot = EngineSnapshot(num_blocks=engine.block_pool.num_blocks,
                                       num_free_blocks=engine.block_pool.num_free)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "AsyncEngine.start() first"
        return self._loop

    # -- calls onto the engine thread --------------------------------------------------------
    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread between steps; its result or exception comes back."""
        fut: asyncio.Future[T] = self.loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self.loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                self.loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.put(run)
        self._wake.set()
        return await fut

    def post(self, fn: Callable[[], Any]) -> None:
        """Fire-and-forget onto the engine thread."""
        self._commands.put(fn)
        self._wake.set()

    # -- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[list[SeqOutput]]:
        """Outputs of one request, a list per engine step, until every sample finishes."""
        add = lambda: self.engine.add_request(request_id, prompt_token_ids, params)  # noqa: E731
        async with aclosing(self._stream(request_id, params.n, add)) as stream:
            async for outs in stream:
                yield outs

    async def decode(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     remote: RemoteKV) -> AsyncIterator[list[SeqOutput]]:
        add = lambda: self.engine.add_remote_request(  # noqa: E731
            request_id, prompt_token_ids, params, remote)
        async with aclosing(self._stream(request_id, params.n, add)) as stream:
            async for outs in stream:
                yield outs

    async def prefill(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams) -> SeqOutput:
        """Prefill role: the single output that carries the handoff."""
        add = lambda: self.engine.add_request(request_id, prompt_token_ids, params)  # noqa: E731
        async with aclosing(self._stream(request_id, 1, add)) as stream:
            async for outs in stream:
                return outs[-1]
        raise RuntimeError("prefill produced no output")

    async def _stream(self, request_id: str, num_samples: int,
                      add: Callable[[], None]) -> AsyncIterator[list[SeqOutput]]:
        if request_id in self._streams:
            from engine.errors import InvalidArgument  # noqa: PLC0415

            raise InvalidArgument("request_id", f"{request_id!r} is already in use")
        q: asyncio.Queue[list[SeqOutput]] = asyncio.Queue()
        self._streams[request_id] = q
        finished: set[int] = set()
        try:
            await self.call(add)
            while len(finished) < num_samples:
                outs = await q.get()
                if not q.empty():  # the consumer lags: send what piled up as one message
                    while not q.empty():
                        outs = outs + q.get_nowait()
                    outs = _merge_by_sample(outs)
                for o in outs:
                    if o.finish_reason is not None:
                        # A handoff or an error ends every sample of the request at once.
                        if o.handoff is not None or o.error is not None:
                            finished.update(range(num_samples))
                        finished.add(o.sample_index)
                yield outs
        finally:
            del self._streams[request_id]
            if len(finished) < num_samples:
                self.post(lambda: self._abort(request_id))
            # A prefill that finished while its caller was leaving: nobody will hand its blocks
            # on, so release them now rather than at the lease's expiry.
            while not q.empty():
                for o in q.get_nowait():
                    if o.handoff is not None:
                        lease = o.handoff.lease_id
                        self.post(lambda lease=lease: self.engine.release(lease))

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda: self._abort(request_id))

    async def release(self, lease_id: str) -> bool:
        return await self.call(lambda: self.engine.release(lease_id))

    def num_streams(self) -> int:
        return len(self._streams)

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stop:
            self._wake.clear()
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            if engine.has_work():
                try:
                    outputs = engine.step()
                except Exception:
                    log.exception("engine step failed; failing its requests")
                    outputs = self._fail_all("internal error in the engine step")
                if outputs:
                    self._deliver(outputs)
            else:
                if len(engine.leases):
                    engine.expire_leases(time.monotonic())
                self._snap()
                self._wake.wait(IDLE_WAIT_S)
                continue
            self._snap()
            if self.on_step is not None:
                try:
                    self.on_step(engine, outputs)
                except Exception:
                    log.exception("on_step hook failed")

    def _abort(self, request_id: str) -> bool:
        seqs = self.engine.requests.get(request_id, ())
        unfinished = sum(1 for s in seqs if not s.is_finished)
        aborted = self.engine.abort(request_id)
        if aborted and unfinished and self.on_abort is not None:
            self.on_abort(unfinished)
        return aborted

    def _fail_all(self, message: str) -> list[SeqOutput]:
        outputs = []
        for rid, seqs in list(self.engine.requests.items()):
            self.engine.abort(rid)
            for s in seqs:
                outputs.append(SeqOutput(rid, s.sample_index, [], [], FinishReason.ERROR,
                                         s.num_prompt_tokens, s.num_cached_tokens,
                                         s.num_output_tokens, error=message))
        return outputs

    def _snap(self) -> None:
        e = self.engine
        self.snapshot = EngineSnapshot(e.num_running(), e.num_waiting(), e.block_pool.num_free,
                                       e.block_pool.num_blocks, len(e.leases))

    def _deliver(self, outputs: list[SeqOutput]) -> None:
        grouped: dict[str, list[SeqOutput]] = defaultdict(list)
        for o in outputs:
            grouped[o.request_id].append(o)
        self.loop.call_soon_threadsafe(self._dispatch, grouped)

    def _dispatch(self, grouped: dict[str, list[SeqOutput]]) -> None:
        for rid, outs in grouped.items():
            q = self._streams.get(rid)
            if q is not None:
                q.put_nowait(outs)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _merge_by_sample(outs: list[SeqOutput]) -> list[SeqOutput]:
    """Several steps' outputs of one request, one per sample: tokens concatenated in order, the
    rest (finish reason, counters, timings) from the latest step."""
    merged: dict[int, SeqOutput] = {}
    for o in outs:
        prev = merged.get(o.sample_index)
        merged[o.sample_index] = o if prev is None else dataclasses.replace(
            o, new_token_ids=prev.new_token_ids + o.new_token_ids,
            new_logprobs=prev.new_logprobs + o.new_logprobs)
    return list(merged.values())
