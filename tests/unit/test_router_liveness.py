"""A worker's liveness is judged by the worker, not by the router's own lag: with the router's
event loop held for longer than a poll's timeout, again and again (a burst of requests does
that), a worker that answers stays up and nothing is failed over; a worker that really hangs
(SIGSTOP) is still lost, one that is gone (killed: its port refuses) taken out, and either is
back once it answers again."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.router_svc.workers import FaultMetrics, WorkerSet

FAKE_WORKER = Path(__file__).resolve().parents[1] / "fake_worker.py"


@pytest.fixture
def fake_worker():
    p = subprocess.Popen([sys.executable, str(FAKE_WORKER)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline())
        yield p, f"127.0.0.1:{port}"
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait()


def hold_the_loop(seconds: float) -> None:
    """Keep the event loop's thread busy, as a request's parsing and routing does (the CPU, not
    a sleep: the poller's thread has to win the GIL from it)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


async def burst(requests: int = 150, steps: int = 6, step_s: float = 0.01) -> None:
    """A burst as the loop sees it: `requests` handlers each taking `step_s` of CPU per turn
    of the loop, so that one turn takes requests x step_s (1.5 s: longer than a poll's
    timeout), `steps` turns in a row. Any call the loop sends meanwhile has its answer read
    only a turn later."""
    async def handler() -> None:
        for _ in range(steps):
            hold_the_loop(step_s)
            await asyncio.sleep(0)

    await asyncio.gather(*(handler() for _ in range(requests)))


async def until(ws: WorkerSet, cond) -> None:
    while not cond():
        await ws.next_round()


def test_a_held_event_loop_fails_no_worker_that_answers(fake_worker):
    proc, address = fake_worker

    async def main() -> None:
        ws = WorkerSet([], [address], [], poll_interval_s=0.1, worker_timeout_s=1.0,
                       metrics=FaultMetrics())
        await ws.start()
        w = ws.workers[0]
        lost = ws.metrics.lost.labels(address)
        changes: list[bool] = []

        async def on_health() -> None:
            changes.append(ws.all_healthy())

        ws.on_health = on_health
        try:
            await until(ws, lambda: w.healthy)
            await burst()  # 9 s with the loop's turns 1.5 s long
            for _ in range(2):  # rounds of polls made after the burst
                await ws.next_round()
            assert w.healthy and not w.lost.is_set()
            assert lost._value.get() == 0
            assert False not in changes  # never taken out meanwhile

            proc.send_signal(signal.SIGSTOP)  # hung: its polls go unanswered
            await w.lost.wait()
            assert not w.healthy and lost._value.get() == 1
            proc.send_signal(signal.SIGCONT)
            await until(ws, lambda: w.healthy)
            assert not w.lost.is_set()

            proc.kill()  # gone: its port refuses, which is an answer, not silence
            await until(ws, lambda: not w.healthy)
            assert not w.lost.is_set() and lost._value.get() == 1
        finally:
            await ws.close()

    asyncio.run(main())
