"""A worker's Stream call that fails over leaves nothing behind: when the worker dies (its
connection reset) or is given up on (lost: `abandon`), every request on the call fails
StreamBroken, no task of the call is left pending, and nothing is logged at error level once
the call is collected (gRPC's task reading the request iterator used to wait on it for good,
then be destroyed pending: "Task was destroyed but it is pending", "aclose(): asynchronous
generator is already running")."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tandem.router_svc.worker_stream import StreamBroken, WorkerStream
from tandem.v1 import worker_pb2, worker_pb2_grpc

FAKE_WORKER = Path(__file__).resolve().parents[1] / "fake_worker.py"


@pytest.fixture
def fake_worker():
    p = subprocess.Popen([sys.executable, str(FAKE_WORKER)], stdout=subprocess.PIPE, text=True)
    try:
        yield p, f"127.0.0.1:{int(p.stdout.readline())}"
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait()


def generate(rid: str) -> worker_pb2.StreamRequest:
    return worker_pb2.StreamRequest(generate=worker_pb2.GenerateOnWorkerRequest(
        request_id=rid, prompt_token_ids=[1, 2, 3]))


def another_loops_grpc_event(ctx: dict) -> bool:
    """Whether a loop error is grpc.aio handing on a completion that belongs to an earlier
    test's event loop, closed since (grpc's process-wide poller delivers each completion to its
    call's loop; a cancelled call's last one can come after its loop closed, more so on busy
    cores): RuntimeError("Event loop is closed") from the poller's reader. Not this loop's: the
    test's loop runs. A service runs one loop for its life and never sees it."""
    exc = ctx.get("exception")
    return (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
            and "PollerCompletionQueue._handle_events" in repr(ctx.get("handle")))


@pytest.mark.parametrize("how", ["killed", "lost"])
def test_a_failed_over_stream_leaves_no_task_and_logs_no_error(fake_worker, caplog, how):
    proc, address = fake_worker
    loop_errors: list[str] = []

    async def main() -> None:
        def record(_loop, ctx: dict) -> None:
            if not another_loops_grpc_event(ctx):
                loop_errors.append(f"{ctx['message']}: {ctx.get('exception')!r}")

        asyncio.get_running_loop().set_exception_handler(record)
        async with grpc.aio.insecure_channel(address) as ch:
            ws = WorkerStream(worker_pb2_grpc.WorkerStub(ch), address)
            calls = [ws.request(generate(f"r{i}")) for i in range(3)]
            for c in calls:  # each request's first token: the call is up
                assert (await anext(c)).samples[0].token_ids == [7]
            if how == "killed":
                proc.kill()
            else:
                proc.send_signal(signal.SIGSTOP)
                ws.abandon("worker answered no poll")
            for c in calls:
                with pytest.raises(StreamBroken):
                    await anext(c)
                await c.aclose()
            await ws.close()
            del calls, ws
            # What the failure left running ends by itself (gRPC hears its cancelled call's
            # status); a task that waits for good is still pending when the bound runs out.
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if others:
                await asyncio.wait(others, timeout=30)
            assert [t for t in others if not t.done()] == []
            gc.collect()
            await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    gc.collect()
    assert loop_errors == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
