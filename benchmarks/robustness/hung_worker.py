"""How long the streams on a hung decode worker stall: a 1P+2D stack on the CPU (loopback), six
greedy streams spread over both decode workers, SIGSTOP of the one holding more; each stream is
read all along, and its longest pause after the stop (start of the pause to the next chunk, on
the surviving worker or after the router moved it) is measured. Run once per --worker-timeout
value; a huge value switches the router's poll-based detection off, leaving the channel's own
pings (GRPC_OPTIONS) to notice.

    python benchmarks/robustness/hung_worker.py --worker-timeout 5 2 100000 --runs 2
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "protos", ROOT):
    sys.path.insert(0, str(_p))

import grpc  # noqa: E402

from tandem.cli.launcher import LocalStack  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.runtime.convert import params_to_proto  # noqa: E402
from tandem.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402


async def _load(address: str) -> worker_pb2.Load:
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                            timeout=5)


async def measure(stack: LocalStack, streams: int, after: int) -> dict:
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    async with grpc.aio.insecure_channel(stack.router.address) as ch:
        stub = api_pb2_grpc.TandemStub(ch)
        calls = [stub.Generate(api_pb2.GenerateRequest(
            token_ids=api_pb2.TokenIds(ids=[i + 1] * 12), params=params))
            for i in range(streams)]
        times: list[list[float]] = [[] for _ in calls]
        errors: list[str] = []

        async def read(i: int, call) -> None:
            try:
                async for _ in call:
                    times[i].append(time.monotonic())
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    errors.append(e.code().name)
            except asyncio.CancelledError:  # our own cancel, at the end
                pass

        tasks = [asyncio.create_task(read(i, c)) for i, c in enumerate(calls)]
        while any(len(t) < 3 for t in times):
            await asyncio.sleep(0.05)
        while True:
            loads = {p.name: await _load(p.address) for p in stack.workers("decode")}
            victim = max(loads, key=lambda n: loads[n].num_running)
            if loads[victim].num_running:
                break
            await asyncio.sleep(0.05)
        pid = stack.procs[victim].popen.pid
        t0 = time.monotonic()
        stack.procs[victim].popen.send_signal(signal.SIGSTOP)
        try:
            seen = [len(t) for t in times]
            while any(len(t) < n + after for t, n in zip(times, seen)) and not errors:
                await asyncio.sleep(0.05)
        finally:
            stack.procs[victim].popen.send_signal(signal.SIGCONT)
        for c in calls:
            c.cancel()
        await asyncio.gather(*tasks)
    pauses = []
    for t, n in zip(times, seen):
        prev, pause = t0, (0.0, t0)
        for x in t[n:]:
            pause = max(pause, (x - prev, x))
            prev = x
        pauses.append(pause[1] - t0)  # when its longest pause after the stop ended
    return {"victim": victim, "pid": pid, "resumed_after_s": sorted(pauses),
            "errors": errors}


def main() -> int:
    p = argparse.ArgumentParser(prog="hung_worker.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tandem-demo")
    p.add_argument("--worker-timeout", type=float, nargs="+", default=[5.0],
                   help="router --worker-timeout values to measure")
    p.add_argument("--runs", type=int, default=1, help="fresh stacks per value")
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--after", type=int, default=30, help="chunks each stream must get after "
                                                          "the stop")
    a = p.parse_args()
    rows = []
    for value in a.worker_timeout:
        for _ in range(a.runs):
            stack = LocalStack(a.model, ["prefill", "decode", "decode"], ["cpu"] * 3,
                               worker_args=["--num-blocks", "256",
                                            "--max-num-batched-tokens", "64"],
                               router_args=["--grpc-port", "0", "--http-port", "-1",
                                            "--dtype", "float32", "--worker-timeout",
                                            str(value)],
                               log_dir=tempfile.mkdtemp(prefix="tandem-hung-"), grace=2.0)
            try:
                r = asyncio.run(measure(stack.start(), a.streams, a.after))
            finally:
                stack.stop()
            rows.append((value, r))
            print(f"--worker-timeout {value:g}: SIGSTOP {r['victim']}: streams resumed after "
                  f"{', '.join(f'{s:.2f}' for s in r['resumed_after_s'])} s; errors "
                  f"{r['errors'] or 'none'}", flush=True)
    print(f"\n{'--worker-timeout':>16} {'slowest stream resumed after (s)':>34}")
    for value, r in rows:
        print(f"{value:>16g} {max(r['resumed_after_s']):>34.2f}")
    return 1 if any(r["errors"] for _, r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
