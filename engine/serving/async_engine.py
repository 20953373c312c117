"""The engine on its own thread, for asyncio services.

    asyncio loop (gRPC, HTTP)                     engine thread
    ─────────────────────────                     ─────────────
    add / abort / release  ── commands queue ──▶  run commands between steps
    per-request sinks      ◀── one callback ────  step(): outputs of all requests
                                per step

Every engine mutation happens on the engine thread, so the engine needs no locks. A request
runs as one awaitable: each step's outputs of it go straight to its sink (a plain function, on
the loop, in step order), so a step costs one loop callback however many requests it advanced,
and no task wakes per request per token. The awaitable returns when all its samples have
finished; cancelled (client gone, deadline) or failed (its sink raised), the request is aborted,
which frees its blocks on the next turn of the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.errors import InvalidArgument
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, RemoteKV, SeqOutput

T = TypeVar("T")
log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how often an idle engine thread looks at lease deadlines

# Takes one request's outputs of one engine step, on the event loop; raising fails the request.
OutputSink = Callable[[list[SeqOutput]], None]


@dataclass
class EngineSnapshot:
    """Load figures, read on the engine thread after each step (cheap to read anywhere)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_leases: int = 0


@dataclass(eq=False)
class _Request:
    sink: OutputSink
    num_samples: int
    done: asyncio.Future[None]
    finished: set[int] = field(default_factory=set)  # sample indices that ended


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
        self._requests: dict[str, _Request] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self.snapshot = EngineSnapshot(num_blocks=engine.block_pool.num_blocks,
                                       num_free_blocks=engine.block_pool.num_free)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        _keep_freed_memory()
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
                       params: SamplingParams, sink: OutputSink) -> None:
        """Run one request; `sink` gets its outputs, a list per engine step, until every sample
        finishes."""
        add = lambda: self.engine.add_request(request_id, prompt_token_ids, params)  # noqa: E731
        await self._run_request(request_id, params.n, add, sink)

    async def decode(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     remote: RemoteKV, sink: OutputSink) -> None:
        """Decode role: as generate, for a request whose prompt KV is on a prefill worker."""
        add = lambda: self.engine.add_remote_request(  # noqa: E731
            request_id, prompt_token_ids, params, remote)
        await self._run_request(request_id, params.n, add, sink)

    async def prefill(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams) -> SeqOutput:
        """Prefill role: the single output that carries the handoff."""
        add = lambda: self.engine.add_request(request_id, prompt_token_ids, params)  # noqa: E731
        outs: list[SeqOutput] = []
        try:
            await self._run_request(request_id, 1, add, outs.extend)
        except BaseException:
            # The handoff came as its caller was leaving: nobody will hand its blocks on, so
            # release them now rather than at the lease's expiry.
            self._release_handoffs(outs)
            raise
        return outs[-1]

    async def _run_request(self, request_id: str, num_samples: int,
                           add: Callable[[], None], sink: OutputSink) -> None:
        if request_id in self._requests:
            raise InvalidArgument("request_id", f"{request_id!r} is already in use")
        req = self._requests[request_id] = _Request(sink, num_samples, self.loop.create_future())
        try:
            await self.call(add)
            await req.done
        finally:
            del self._requests[request_id]
            if len(req.finished) < num_samples:
                self.post(lambda: self._abort(request_id))

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda: self._abort(request_id))

    async def release(self, lease_id: str) -> bool:
        return await self.call(lambda: self.engine.release(lease_id))

    def num_requests(self) -> int:
        """Requests the event loop is waiting on."""
        return len(self._requests)

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        _name_native_thread("engine")
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
            req = self._requests.get(rid)
            if req is None or req.done.done():  # its caller left, an abort is on its way
                self._release_handoffs(outs)
                continue
            try:
                req.sink(outs)
            except Exception as e:  # noqa: BLE001 - fails this request alone
                req.done.set_exception(e)
                continue
            for o in outs:
                if o.finish_reason is not None:
                    # A handoff or an error ends every sample of the request at once.
                    if o.handoff is not None or o.error is not None:
                        req.finished.update(range(req.num_samples))
                    req.finished.add(o.sample_index)
            if len(req.finished) >= req.num_samples:
                req.done.set_result(None)

    def _release_handoffs(self, outs: list[SeqOutput]) -> None:
        for o in outs:
            if o.handoff is not None:
                lease = o.handoff.lease_id
                self.post(lambda lease=lease: self.engine.release(lease))


def _keep_freed_memory() -> None:
    """glibc: keep freed memory in the process (up to 512 MiB of it; blocks under 32 MiB from
    the heap, not from mmap). Every step allocates and frees the same temporaries on the engine
    thread; with glibc's defaults its arena hands them back to the OS and the next step faults
    the pages in again (a CPU decode worker: 227k page faults in one 64-request benchmark run
    and a step twice as long; 1k-12k faults with these settings). Process-wide; elsewhere than
    glibc, nothing."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: fixed (glibc's maximum), not adjusted on the fly
    mallopt(-1, 512 << 20)  # M_TRIM_THRESHOLD


def _name_native_thread(name: str) -> None:
    """The calling thread shows as `name` in top -H, ps -L and /proc (Linux; elsewhere, and
    where libc lacks prctl, nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
