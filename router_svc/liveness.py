"""Worker liveness, judged apart from the router's event loop.

The router's event loop carries every request: parsing, routing, streaming tokens back. A burst
of requests can hold it for seconds, and a gRPC aio call in flight meanwhile fails
DEADLINE_EXCEEDED even though its answer came in time (grpc.aio reads its answers on the loop).
Polls made on that loop would then blame every worker at once for the router's own lag.
So the polls run here instead: one thread, blocking gRPC calls on channels of their own (own
connections too: a poll never queues behind a busy Stream call), a clock of their own.

    router's event loop                          poller thread
    ───────────────────                          ─────────────
    requests, streams, routing                   every poll_interval_s: GetLoad to each
      ▲                                          worker at once (futures), timeout_s each
      └──── results (call_soon_threadsafe) ◀──── which answered, refused, or stayed silent

A worker is silent while its polls time out. Its silence is counted on the poller's own time
less the time the poller itself was held up (a round that ended later than its calls'
deadlines allow, a sleep that overslept: the whole process was starved or stopped, not the
worker). It is lost once silent for `worker_timeout_s`. A refusal (UNAVAILABLE: nothing
listens, the connection was reset, a draining worker) is an answer, not silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.runtime.lifecycle import GRPC_OPTIONS
from tandem.runtime.security import ClusterTls
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

# A round's calls end by their deadline; a round that took this much longer was delayed by
# this process (starved of CPU, stopped), not by its workers.
STALL_SLACK_S = 0.25


def probe_channel(address: str, tls: ClusterTls | None, peer_role: str) -> grpc.Channel:
    """A blocking channel for polls: its own connection (a local subchannel pool), so that a
    poll is never queued behind the Stream call's traffic on the router's aio channel. With
    cluster TLS, only a certificate of the worker's role (`peer_role`) is accepted."""
    options = [*GRPC_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(),
                               options=[*options, *tls.channel_options(peer_role)])


@dataclass(frozen=True)
class PollResult:
    """One worker's answer to one poll. `load` when it answered; else `code`, and `lost`
    when its silence has reached worker_timeout_s (then `silent_s` says how long)."""

    key: Any  # whatever the caller polls by (the router's Worker)
    load: worker_pb2.Load | None
    code: grpc.StatusCode | None = None
    lost: bool = False
    silent_s: float = 0.0


@dataclass(frozen=True)
class Target:
    key: Any
    stub: Any  # a blocking worker_pb2_grpc.WorkerStub (its GetLoad has .future)


class Poller:
    """Polls targets from a thread of its own; `deliver(results)` is called (in that thread)
    after each round. `targets()` is called at the start of each round."""

    def __init__(self, timeout_s: float, worker_timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.worker_timeout_s = worker_timeout_s
        self._silent: dict[int, float] = {}  # id(key) -> seconds silent, on the poller's time
        self._last_end: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self, targets: Sequence[Target]) -> list[PollResult]:
        """One round: every target polled at once; their results once all have ended."""
        start = time.monotonic()
        calls = []
        for t in targets:
            try:
                calls.append((t, t.stub.GetLoad.future(worker_pb2.GetLoadRequest(),
                                                       timeout=self.timeout_s)))
            except ValueError:  # its channel was closed meanwhile (the worker was removed)
                continue
        answers: list[tuple[Target, worker_pb2.Load | None, grpc.StatusCode | None]] = []
        for t, call in calls:
            try:
                answers.append((t, call.result(), None))
            except grpc.RpcError as e:
                answers.append((t, None, e.code()))
            except grpc.FutureCancelledError:  # its channel closed mid-call (worker removed)
                continue
        end = time.monotonic()
        # Time this round counts toward a silent worker's silence: since the last round's end,
        # less what the poller itself was held up (past the calls' deadlines, or between rounds
        # longer than a round and a pause would take).
        held_up = max(0.0, end - start - self.timeout_s - STALL_SLACK_S)
        since = end - (self._last_end if self._last_end is not None else start)
        self._last_end = end
        counted = max(0.0, since - held_up)
        return [self._judge(t, load, code, counted) for t, load, code in answers]

    def _judge(self, t: Target, load: worker_pb2.Load | None, code: grpc.StatusCode | None,
               counted: float) -> PollResult:
        k = id(t.key)
        if code != grpc.StatusCode.DEADLINE_EXCEEDED:  # an answer, or a refusal
            self._silent[k] = 0.0
            return PollResult(t.key, load, code)
        silent = self._silent[k] = self._silent.get(k, 0.0) + counted
        return PollResult(t.key, None, code, lost=silent >= self.worker_timeout_s,
                          silent_s=silent)

    def forget(self, key: Any) -> None:
        self._silent.pop(id(key), None)

    # -- the thread ---------------------------------------------------------------------------
    def start(self, interval_s: float, targets: Callable[[], Sequence[Target]],
              deliver: Callable[[list[PollResult]], None]) -> None:
        def run() -> None:
            while not self._stop.is_set():
                try:
                    results = self.poll(targets())
                except Exception:  # never let the router stop polling silently
                    log.exception("worker polls failed; polling on")
                    results = []
                with contextlib.suppress(RuntimeError):  # the loop closed: we are stopping
                    deliver(results)
                before = time.monotonic()
                if self._stop.wait(interval_s):
                    return
                # Oversleeping (the process starved or stopped) is no worker's silence either.
                overslept = time.monotonic() - before - interval_s
                if overslept > STALL_SLACK_S and self._last_end is not None:
                    self._last_end += overslept

        self._thread = threading.Thread(target=run, name="worker-poller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (after its current round: at most timeout_s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None



class LoopLag:
    """How late the router's event loop runs what is due: a task that sleeps `interval_s` and
    observes how much longer that took (tandem:router_loop_lag_seconds). The figure to watch
    under a burst: every request, stream and health answer waits that long."""

    def __init__(self, histogram: Any, interval_s: float = 0.1) -> None:
        self.histogram = histogram
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="loop-lag")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.interval_s)
            self.histogram.observe(max(0.0, loop.time() - t - self.interval_s))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
