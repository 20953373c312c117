"""The engine as an asyncio service sees it: a process of its own (engine_core), driven from
the event loop.

    asyncio loop (gRPC, HTTP)                       engine core process
    ─────────────────────────                       ───────────────────
    generate / decode / prefill / abort / release ─── commands ──▶  between steps
    per-request sinks  ◀── one Step event per step (outputs of all requests), read when
                           the pipe is readable: no thread, no wake-up per request

A request runs as one awaitable: each step's outputs of it go straight to its sink (a plain
function, on the loop, in step order). The awaitable returns when all its samples have finished;
cancelled (client gone, deadline) or failed (its sink raised), the request is aborted, which
frees its blocks between the core's next two steps.

The core dying (killed, out of memory) fails every request and call in flight with EngineDead
and calls `on_death`: a worker without its engine stops serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Lent, RemoteKV, Replay, SeqOutput
from tandem.engine.serving.core_messages import (
    Abort,
    Aborted,
    Add,
    Call,
    Command,
    CoreInfo,
    CoreSpec,
    EngineSnapshot,
    Event,
    Failed,
    HandOver,
    KVEvents,
    LeaseDone,
    LeasesRenewed,
    Lend,
    LendPrefix,
    MapPool,
    Ready,
    Release,
    Renew,
    Reply,
    SnapshotChanged,
    Step,
    Stop,
    SwitchRole,
    TakeSnapshot,
    unpack_outputs,
)
from tandem.engine.serving.engine_core import run_core
from tandem.errors import InvalidArgument, TandemError

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # for the core to exit after "stop" before it is killed

# Takes one request's outputs of one engine step, on the event loop; raising fails the request.
OutputSink = Callable[[list[SeqOutput]], None]


class EngineDead(TandemError):
    """The engine core process exited; nothing it held survives."""


class RequestAborted(TandemError):
    """The request was dropped by `abort` (a worker's Abort call) before it finished."""


@dataclass(eq=False)
class _Request:
    sink: OutputSink
    num_samples: int
    done: asyncio.Future[None]
    finished: set[int] = field(default_factory=set)  # sample indices that ended


class AsyncEngine:
    def __init__(self, spec: CoreSpec, *,
                 on_step: Callable[[Any, list[SeqOutput], float], None] | None = None,
                 on_abort: Callable[[int], None] | None = None,
                 on_lease_done: Callable[[LeaseDone], None] | None = None,
                 on_death: Callable[[], None] | None = None) -> None:
        self.spec = spec
        # Hooks, on the loop: after each step (StepStats or None, those of its outputs that are
        # more than new tokens, every finished one among them, and the core's perf_counter at
        # its end: nothing per token), samples ended by an abort, a prefill lease the core is done
        # with (decode role), the core's death.
        self.on_step = on_step
        self.on_abort = on_abort
        self.on_lease_done = on_lease_done
        self.on_death = on_death
        # Prefix-cache changes (KVEvents), on the loop, in the core's order.
        self.on_kv_events: Callable[[KVEvents], None] | None = None
        self.info: CoreInfo | None = None
        self.snapshot = EngineSnapshot()
        self.dead = False
        self._requests: dict[str, _Request] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: Any = None
        self._commands: Any = None  # Connection, worker -> core
        self._events: Any = None  # Connection, core -> worker

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the core and wait until its model is loaded; its load errors raise here."""
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot live in a forked child
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        self._events, evt_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_core, args=(self.spec, cmd_recv, evt_send),
                                 name=f"{self.spec.role}-core", daemon=True)
        self._proc.start()
        cmd_recv.close()
        evt_send.close()
        first = await asyncio.to_thread(self._first_message)
        if not isinstance(first, Ready):
            self._proc.join(STOP_TIMEOUT_S)
            raise first.error
        info = self.info = first.info
        n = info.layout["num_blocks"]
        self.snapshot = EngineSnapshot(num_free_blocks=n, num_blocks=n,
                                       block_size=info.layout["block_size"])
        self._loop.add_reader(self._events.fileno(), self._on_readable)

    def _first_message(self) -> Ready | Failed:
        while not self._events.poll(0.5):
            if not self._proc.is_alive():
                return Failed(EngineDead(
                    f"the engine core exited while starting (exit code {self._proc.exitcode})"))
        try:
            return self._events.recv()
        except EOFError:
            return Failed(EngineDead("the engine core exited while starting"))

    async def shutdown(self) -> None:
        if self._proc is None:
            return
        if not self.dead:
            self._loop.remove_reader(self._events.fileno())
            self._send(Call(Stop()))
        proc = self._proc
        await asyncio.to_thread(proc.join, STOP_TIMEOUT_S)
        if proc.is_alive():
            log.warning("the engine core did not stop within %.0f s; killing it", STOP_TIMEOUT_S)
            proc.kill()
            await asyncio.to_thread(proc.join)
        self._commands.close()
        self._events.close()
        self._proc = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "await AsyncEngine.start() first"
        return self._loop

    # -- commands ----------------------------------------------------------------------------
    async def call(self, command: Command) -> Any:
        """Run `command` on the core between steps; its result or exception comes back."""
        if self.dead:
            raise EngineDead("the engine core has exited")
        call_id = next(self._ids)
        fut = self._calls[call_id] = self.loop.create_future()
        self._send(Call(command, call_id))
        return await fut

    def post(self, command: Command) -> None:
        """Fire-and-forget onto the core."""
        if not self.dead:
            self._send(Call(command))

    def _send(self, msg: Call) -> None:
        with contextlib.suppress(OSError):  # the core is gone; its pipe's EOF reports it
            self._commands.send(msg)

    # -- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, sink: OutputSink,
                       replay: Replay | None = None, prefix: RemoteKV | None = None) -> None:
        """Run one request; `sink` gets its outputs, a list per engine step, until every sample
        finishes. `replay`: the tokens its client has already (a request moved here), recorded
        once the prompt is computed, not output again. `prefix`: a lease on its prompt's
        leading blocks, lent by another worker (RemoteKV.prefix; its pool mapped), pulled
        rather than computed; it ends in one `on_lease_done`, as a decode request's lease."""
        await self._run_request(request_id, prompt_token_ids, params, prefix, sink, replay)

    async def decode(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     remote: RemoteKV, sink: OutputSink) -> None:
        """Decode role: as generate, for a request whose prompt KV is on a prefill worker (whose
        pool `map_pool` mapped). Its lease ends in exactly one `on_lease_done`: from the core,
        after the pull or when the request ends before it; from here, if it never reached the
        core (or the core died after it did, in which case the lease expires)."""
        await self._run_request(request_id, prompt_token_ids, params, remote, sink)

    async def prefill(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, prefix: RemoteKV | None = None) -> SeqOutput:
        """Prefill role: the single output that carries the handoff. `prefix`: as generate's."""
        outs: list[SeqOutput] = []
        try:
            await self._run_request(request_id, prompt_token_ids, params, prefix, outs.extend)
        except BaseException:
            # The handoff came as its caller was leaving: nobody will hand its blocks on, so
            # release them now rather than at the lease's expiry.
            self._release_handoffs(outs)
            raise
        return outs[-1]

    async def _run_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                           remote: RemoteKV | None, sink: OutputSink,
                           replay: Replay | None = None) -> None:
        if request_id in self._requests or self.dead:
            if remote is not None:  # never reaches the core: its lease is done here
                _hook(self.on_lease_done, LeaseDone(request_id, remote.address, remote.lease_id))
            if self.dead:
                raise EngineDead("the engine core has exited")
            raise InvalidArgument("request_id", f"{request_id!r} is already in use")
        req = self._requests[request_id] = _Request(sink, params.n, self.loop.create_future())
        try:
            await self.call(Add(request_id, prompt, params, remote, replay))
            await req.done
        finally:
            del self._requests[request_id]
            if len(req.finished) < params.n:
                self.post(Abort(request_id))

    async def abort(self, request_id: str) -> bool:
        """Drop a request: its blocks are freed between the core's next two steps and its
        awaitable raises RequestAborted (a stream that waits on it ends). False if the core
        did not hold it (unknown, finished, or refused)."""
        aborted = await self.call(Abort(request_id))
        # The core sends a step's outputs before a later reply: a request that finished first
        # is done by now; one that is not was dropped without a last output.
        req = self._requests.get(request_id)
        if aborted and req is not None and not req.done.done():
            req.done.set_exception(RequestAborted(f"request {request_id!r} was aborted"))
        return aborted

    async def release(self, lease_id: str) -> bool:
        return await self.call(Release(lease_id))

    async def renew(self, lease_ids: list[str]) -> list[float]:
        """Prefill role: the seconds each lease has left once renewed (0.0: not live)."""
        return await self.call(Renew(tuple(lease_ids)))

    def leases_renewed(self, deadlines: list[tuple[str, float]]) -> None:
        """Decode role: tell the core the leases' new deadlines (its pulls wait until then)."""
        self.post(LeasesRenewed(tuple(deadlines)))

    async def lend(self, request_id: str) -> Lent | None:
        """Decode role, live migration's source: a lease on a running request's KV (None: it
        has none to lend)."""
        return await self.call(Lend(request_id))

    async def lend_prefix(self, token_ids: list[int], cache_salt: str) -> Lent | None:
        """A lease on the longest prefix of these tokens this worker's pool or host tier
        holds, for a worker of another host to pull (None: none held)."""
        return await self.call(LendPrefix(tuple(token_ids), cache_salt))

    def hand_over(self, request_id: str, tokens: tuple[tuple[int, ...], ...]) -> None:
        """Decode role, live migration's destination: the request decodes on here, with the
        tokens the source made since it was sent (checked by the caller)."""
        self.post(HandOver(request_id, tokens, time.monotonic()))

    async def map_pool(self, address: str, descriptor: Any, instance_id: str = "") -> None:
        """Decode role: map a prefill worker's pool in the core (once per address and worker
        instance)."""
        await self.call(MapPool(address, descriptor, instance_id))

    async def switch_role(self, role: str, lease_ttl_s: float = 30.0,
                          lease_max_life_s: float | None = None, tls: Any = None) -> None:
        """Serve `role` (prefill or decode, from the other) from now on, keeping the model and
        the KV pool: only while the engine is idle, else this raises and nothing changed.
        The lease settings and `tls` (a SiteTls) are the new role's."""
        await self.call(SwitchRole(role, lease_ttl_s, lease_max_life_s, tls))
        self.spec = dataclasses.replace(self.spec, role=role, lease_ttl_s=lease_ttl_s,
                                        lease_max_life_s=lease_max_life_s, tls=tls)

    async def refresh(self) -> EngineSnapshot:
        """A snapshot taken now, between two steps."""
        self.snapshot = await self.call(TakeSnapshot())
        return self.snapshot

    def num_requests(self) -> int:
        """Requests the event loop is waiting on."""
        return len(self._requests)

    # -- events from the core ----------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            while self._events.poll():
                self._handle(self._events.recv())
        except (EOFError, OSError):
            self._died()

    def _handle(self, event: Event) -> None:
        match event:
            case Step(plain, whole, stats, end, snapshot, kv):
                self.snapshot = snapshot
                if kv is not None:
                    _hook(self.on_kv_events, kv)
                outputs = unpack_outputs(plain, whole)
                if outputs:
                    self._dispatch(outputs)
                _hook(self.on_step, stats, whole, end)
            case KVEvents():
                _hook(self.on_kv_events, event)
            case Reply(call_id, result, error):
                fut = self._calls.pop(call_id)
                if not fut.done():
                    if error is not None:
                        fut.set_exception(error)
                    else:
                        fut.set_result(result)
            case SnapshotChanged(snapshot):
                self.snapshot = snapshot
            case Aborted(num_samples):
                _hook(self.on_abort, num_samples)
            case LeaseDone():
                _hook(self.on_lease_done, event)
            case _:
                log.error("unknown message from the engine core: %r", type(event).__name__)

    def _dispatch(self, outputs: list[SeqOutput]) -> None:
        grouped: dict[str, list[SeqOutput]] = defaultdict(list)
        for o in outputs:
            grouped[o.request_id].append(o)
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
                self.post(Release(o.handoff.lease_id))

    def _died(self) -> None:
        if self.dead:
            return
        self.dead = True
        self.loop.remove_reader(self._events.fileno())
        self._proc.join(1.0)
        log.error("the engine core exited (exit code %s): failing %d requests",
                  self._proc.exitcode, len(self._requests))
        error = EngineDead(f"the engine core exited (exit code {self._proc.exitcode})")
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)
        self._calls.clear()
        for req in self._requests.values():
            if not req.done.done():
                req.done.set_exception(error)
        if self.on_death is not None:
            self.on_death()


def _hook(fn: Callable[..., None] | None, *args: Any) -> None:
    if fn is None:
        return
    try:
        fn(*args)
    except Exception:
        log.exception("engine hook %s failed", getattr(fn, "__name__", fn))

