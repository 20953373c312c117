"""What the fault probes (soak.py, chaos.py) share: their stack's flags, a supervised CPU stack
(router, prefill and decode workers, restarted when they exit; on the CPU or sharing a GPU), faults injected into one
worker, waiting until the router routes to every worker again, and every pool read back once
idle. Each probe keeps its own load and its own judgement of the requests."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import httpx

from tandem.cli.launcher import LocalStack
from tandem.cli.supervisor import RestartPolicy, Supervisor
from tandem.v1 import worker_pb2, worker_pb2_grpc


def add_stack_flags(p: argparse.ArgumentParser, *, concurrency: int, shapes: int,
                    min_faults: int, fault_interval: float) -> None:
    """The flags of the stack, the load's bounds and the faults' pacing."""
    add_worker_flags(p)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-duration", type=float, default=None,
                   help="hard bound on the load's seconds while --min-faults are awaited "
                        "(default: 3 x --duration)")
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--min-faults", type=int, default=min_faults,
                   help="go on past --duration until this many faults happened")
    p.add_argument("--concurrency", type=int, default=concurrency, help="requests in flight")
    p.add_argument("--shapes", type=int, default=shapes, help="distinct prompts + parameters")
    p.add_argument("--first-fault", type=float, default=3.0, help="seconds into the load")
    p.add_argument("--fault-interval", type=float, default=fault_interval,
                   help="seconds between a fault's recovery and the next")
    p.add_argument("--hang", type=float, default=4.0, help="seconds a worker stays SIGSTOPped")
    p.add_argument("--lease-ttl", type=float, default=5.0, help="prefill workers' --lease-ttl")
    p.add_argument("--worker-timeout", type=float, default=2.0, help="router --worker-timeout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    """The workers: model, how many of each role, where they run and their KV pools."""
    p.add_argument("--model", default="tandem-demo")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--device", default="cpu",
                   help="every worker's device (cpu, or one GPU they share: cuda:0)")
    p.add_argument("--num-blocks", type=int, default=512, help="each worker's KV blocks")
    p.add_argument("--max-num-batched-tokens", type=int, default=128,
                   help="each worker's token budget a step")


def run_supervised(a: argparse.Namespace, prog: str, grace: float,
                   probe: Callable[[LocalStack], Coroutine[Any, Any, dict]]) -> dict:
    """Start the stack the flags describe under a supervisor, run `probe` on it, stop it.
    The probe's result, with the restarts, exit codes, flags, cores and log directory."""
    a.max_duration = a.max_duration or 3 * a.duration
    roles = ["prefill"] * a.prefill_workers + ["decode"] * a.decode_workers
    # float32 everywhere: a request moved or replayed elsewhere must give the same tokens.
    stack = LocalStack(a.model, roles, [a.device] * len(roles),
                       worker_args=["--num-blocks", str(a.num_blocks), "--dtype", "float32",
                                    "--max-num-batched-tokens", str(a.max_num_batched_tokens)],
                       role_args={"prefill": ["--lease-ttl", str(a.lease_ttl)]},
                       router_args=["--grpc-port", "0", "--http-port", "0", "--dtype",
                                    "float32", "--worker-timeout", str(a.worker_timeout)],
                       log_dir=a.log_dir, grace=grace)
    try:
        stack.start()
        supervisor = Supervisor(stack, RestartPolicy(max_restarts=10, window_s=60),
                                say=lambda m: print(f"{prog}: supervisor: {m}", flush=True)
                                ).start()
        r = asyncio.run(probe(stack))
        r["restarts"] = {k: v for k, v in supervisor.restarts.items() if v}
        r["supervisor_failed"] = supervisor.failed
    finally:
        codes = stack.stop()
    r.update(exit_codes=codes, args={k: str(v) for k, v in vars(a).items()},
             cores=len(os.sched_getaffinity(0)), log_dir=str(stack.log_dir))
    return r


async def inject(stack: LocalStack, kind: str, name: str, hang_s: float,
                 stopped: Callable[[str | None], None] = lambda _: None) -> dict:
    """One fault on worker `name`: kill (SIGKILL), hang (SIGSTOP for hang_s, then SIGCONT;
    `stopped` is told the worker's name for that time, then None) or drain (its Drain RPC, as
    `tandem drain` calls it). After a kill or a drain, returns once the supervisor's restart
    of the worker is up (the router may not have noticed yet). What a drain answered, if any."""
    proc = stack.procs[name]
    pid = proc.popen.pid
    info: dict = {}
    if kind == "hang":
        stopped(name)
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(hang_s)
        finally:
            os.kill(pid, signal.SIGCONT)
            stopped(None)
        return info
    if kind == "kill":
        os.kill(pid, signal.SIGKILL)
    else:
        async with grpc.aio.insecure_channel(proc.address) as ch:
            r = await worker_pb2_grpc.WorkerStub(ch).Drain(worker_pb2.DrainRequest(),
                                                           timeout=120)
        info = {"moved": r.moved, "finished": r.finished, "left": r.left}
    while stack.procs[name] is proc or not stack.procs[name].ready_file.exists():
        await asyncio.sleep(0.2)
    return info


async def whole(http: httpx.AsyncClient, prog: str, timeout: float = 300.0) -> None:
    """Until the router routes to every worker (its /workers)."""
    deadline = time.monotonic() + timeout
    while not (await http.get("/workers")).json()["all_up"]:
        if time.monotonic() > deadline:
            raise SystemExit(f"{prog}: the stack did not come back")
        await asyncio.sleep(0.2)


async def pools(stack: LocalStack, timeout: float) -> dict[str, dict]:
    """Every worker's pool once idle (or as it is when `timeout` runs out): blocks in use,
    leases, running and waiting requests. A worker the last fault killed may still be
    restarting: its GetLoad waits for it to be back on its address."""
    deadline = time.monotonic() + timeout
    out = {}
    for name in [p.name for p in stack.workers()]:
        # A worker the last fault stopped may be restarting: its next Proc has no address
        # until it is ready (on the same ports).
        while not stack.read_ready(p := stack.procs[name]):
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} did not come back within {timeout:.0f} s")
            await asyncio.sleep(0.2)
        async with grpc.aio.insecure_channel(p.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            while True:
                ld = await stub.GetLoad(worker_pb2.GetLoadRequest(), wait_for_ready=True,
                                        timeout=max(10.0, deadline - time.monotonic()))
                used = ld.num_blocks - ld.num_free_blocks
                idle = not (used or ld.num_leases or ld.num_running or ld.num_waiting)
                if idle or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
        out[p.name] = {"blocks_in_use": used, "leases": ld.num_leases,
                       "running": ld.num_running, "waiting": ld.num_waiting}
    return out
