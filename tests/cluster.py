"""Real service processes on 127.0.0.1 for integration tests: the project's LocalStack (the
process manager behind `tandem up`) with what tests need on top: worker load, waiting for idle
pools, killing a process, reading JSON logs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Generic, TypeVar

import grpc

from tandem.cli.launcher import LocalStack, Proc, free_port
from tandem.v1 import api_pb2_grpc, worker_pb2, worker_pb2_grpc

__all__ = ["HOLD_BLOCKS", "HOLD_TOKENS", "HOLD_WORKER_ARGS", "WORKER_ARGS", "Cluster",
           "ClusterProc", "Handed", "Proc", "booting", "free_port", "serve", "stop_cleanly"]

# The tiny models' workers: a 256-block pool, 64-token steps (a long prompt prefills in chunks).
WORKER_ARGS = ["--num-blocks", "256", "--max-num-batched-tokens", "64"]
# A request that does not end on its own while a test runs: the long-context tiny llama
# (conftest's tiny_llama_long, 32K positions) takes minutes of CPU steps for this many tokens,
# and workers started with HOLD_WORKER_ARGS have the pool for them (a model's context is bounded
# by its pools too). A test that cancels, aborts or holds a request mid-stream sends one: a
# request of hundreds of tokens has ended before its cancel landed on a busy machine.
HOLD_TOKENS = 30000
HOLD_BLOCKS = 2048
HOLD_WORKER_ARGS = ["--num-blocks", str(HOLD_BLOCKS), "--max-num-batched-tokens", "64"]


class ClusterProc(Proc):
    def json_logs(self) -> list[dict]:
        """The JSON log lines the process wrote to stdout (other lines are skipped)."""
        out = []
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
        return out


class Cluster(LocalStack):
    """prefill + decode (+ colocated) workers on the CPU and a router, ports picked by the OS."""

    proc_class = ClusterProc

    def __init__(self, tmp: Path, model: str, prefill: int = 1, decode: int = 1, both: int = 0,
                 worker_args: Sequence[str] = (), prefill_args: Sequence[str] = (),
                 decode_args: Sequence[str] = (), router_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, metrics: bool = False,
                 cluster_ca: bool = False, elastic: bool = False) -> None:
        roles = ["prefill"] * prefill + ["decode"] * decode + ["both"] * both
        super().__init__(
            model, roles, ["cpu"] * len(roles), worker_args=worker_args,
            role_args={"prefill": prefill_args, "decode": decode_args},
            router_args=["--grpc-port", "0", "--http-port", "0", *router_args],
            log_dir=tmp, env=env, metrics=metrics, cluster_ca=cluster_ca, elastic=elastic)

    def start(self) -> Cluster:
        super().start()
        return self

    def api(self, channel: grpc.aio.Channel) -> api_pb2_grpc.TandemStub:
        return api_pb2_grpc.TandemStub(channel)

    def generate(self, prompts: Sequence[list[int]], params) -> list[list[int]]:
        """Each token-id prompt through the router's gRPC API at once: the tokens of each."""
        from tandem.runtime.convert import params_to_proto
        from tandem.v1 import api_pb2

        async def main() -> list[list[int]]:
            async with grpc.aio.insecure_channel(self.router.address) as ch:
                stub = self.api(ch)

                async def one(p: list[int]) -> list[int]:
                    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=p),
                                                  params=params_to_proto(params))
                    return [t async for c in stub.Generate(req) for t in c.token_ids]

                return list(await asyncio.gather(*(one(p) for p in prompts)))

        return asyncio.run(main())

    async def streams_under_way(self, channel: grpc.aio.Channel, prompts: Sequence[list[int]],
                                params, reads: int = 3) -> list:
        """One Generate call per token-id prompt through the router, each `reads` chunks in:
        requests decoding when the caller then kills or stops something."""
        from tandem.runtime.convert import params_to_proto
        from tandem.v1 import api_pb2

        stub = self.api(channel)
        calls = [stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=p),
                                                       params=params_to_proto(params)))
                 for p in prompts]
        for call in calls:
            for _ in range(reads):
                await call.read()
        return calls

    async def load(self, proc: Proc) -> worker_pb2.Load:
        async with self.worker_channel(proc) as ch:
            return await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                                timeout=5)

    async def wait_idle(self, timeout: float = 20.0, procs: list[Proc] | None = None) -> None:
        """Every worker's pool back to its idle count: no request, no lease, all blocks free."""
        deadline = time.monotonic() + timeout
        for p in procs or self.workers():
            if p.popen.poll() is not None:
                continue
            while True:
                load = await self.load(p)
                idle = (load.num_running == 0 and load.num_waiting == 0 and load.num_leases == 0
                        and load.num_free_blocks == load.num_blocks)
                if idle:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"{p.name} not idle: {load}")
                await asyncio.sleep(0.05)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.procs[name].popen.send_signal(sig)

    def engine_core(self, name: str) -> int:
        """The pid of worker `name`'s engine core, from /proc (Linux): its one child started by
        multiprocessing's spawn (the other is multiprocessing's resource tracker)."""
        pid = self.procs[name].popen.pid
        kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        (core,) = [k for k in kids
                   if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
        return core

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        return super().stop(timeout)


def serve(cluster: Cluster) -> Iterator[Cluster]:
    """Body of a module's cluster fixture (`yield from serve(Cluster(...))`): the stack started,
    and at the end stopped, every process exiting 0."""
    cluster.start()
    yield cluster
    stop_cleanly(cluster)


@contextlib.contextmanager
def booting(cluster: Cluster) -> Iterator[Callable[[], Cluster]]:
    """The stack starting on a thread of its own, for a module whose first tests do not need it
    (its processes boot on the cores those leave idle): yields a call that waits for the start
    and returns the stack, raising what the start raised; stops the stack on exit."""
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(cluster.start)
        try:
            yield started.result
        finally:
            with contextlib.suppress(Exception):  # a failed start was raised to its waiter
                started.result()
            cluster.stop()


def stop_cleanly(cluster: LocalStack) -> None:
    """Stop the stack, every process exiting 0."""
    codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes


S = TypeVar("S")


class Handed(Generic[S]):
    """A module's stack, started on first use, for its tests that leave it as they found it
    (`get`), which one test that kills or stops part of it may then take as its last user
    (`take`): that test stops it; a test after it gets a fresh stack. No test sees what another
    broke, whatever order they run in, and the stack that gets broken did not cost a start of
    its own. `close` (the module fixture's end) stops a stack nobody took."""

    def __init__(self, start: Callable[[], S], stop: Callable[[S], None]) -> None:
        self._start, self._stop = start, stop
        self._current: S | None = None

    def get(self) -> S:
        if self._current is None:
            self._current = self._start()
        return self._current

    def take(self) -> S:
        stack, self._current = self.get(), None
        return stack

    def close(self) -> None:
        if self._current is not None:
            stack, self._current = self._current, None
            self._stop(stack)
