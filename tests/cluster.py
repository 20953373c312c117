"""Real service processes on 127.0.0.1 for integration tests: workers and a router, each its own
OS process started with the `tandem` CLI, ports picked by the OS and reported via ready files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tandem.v1 import api_pb2_grpc, worker_pb2, worker_pb2_grpc

STARTUP_TIMEOUT_S = 120


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    ready_file: Path
    log: Path
    address: str = ""
    http_port: int = 0
    metrics_port: int = 0  # workers started with metrics=True

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def json_logs(self) -> list[dict]:
        """The JSON log lines the process wrote to stdout (other lines are skipped)."""
        out = []
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
        return out

    @property
    def metrics_url(self) -> str:
        """Where the process serves Prometheus metrics: a worker's --metrics-port, the
        router's HTTP port."""
        return f"http://127.0.0.1:{self.metrics_port or self.http_port}/metrics"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "router_svc.cli", *args]


@dataclass
class Cluster:
    tmp: Path
    model: str
    prefill: int = 1
    decode: int = 1
    both: int = 0
    worker_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    metrics: bool = False  # give each worker a free --metrics-port
    procs: dict[str, Proc] = field(default_factory=dict)

    def _spawn(self, name: str, args: list[str]) -> Proc:
        ready = self.tmp / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log = self.tmp / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        metrics_port = free_port() if self.metrics and name != "router" else 0
        if metrics_port:
            args = [*args, "--metrics-port", str(metrics_port)]
        with open(log, "w") as f:
            popen = subprocess.Popen(_cmd(*args, "--ready-file", str(ready)), stdout=f,
                                     stderr=subprocess.STDOUT, env=env)
        proc = Proc(name, popen, ready, log, metrics_port=metrics_port)
        self.procs[name] = proc
        return proc

    def _wait_ready(self, procs: list[Proc]) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for p in procs:
            while not p.ready_file.exists():
                if p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited ({p.popen.returncode}):\n{p.log_text()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{p.name} did not start:\n{p.log_text()}")
                time.sleep(0.05)
            ports = p.ready_file.read_text().split()
            p.address = f"127.0.0.1:{ports[0]}"
            if len(ports) > 1:
                p.http_port = int(ports[1])

    def start(self) -> Cluster:
        workers = []
        common = ["--model", self.model, "--port", "0", "--grace", "5", *self.worker_args]
        for i in range(self.prefill):
            workers.append(self._spawn(f"prefill{i}", ["prefill", *common, *self.prefill_args]))
        for i in range(self.decode):
            workers.append(self._spawn(f"decode{i}", ["decode", *common, *self.decode_args]))
        for i in range(self.both):
            workers.append(self._spawn(f"both{i}", ["worker", "--role", "both", *common]))
        self._wait_ready(workers)
        args = ["router", "--model", self.model, "--grpc-port", "0", "--http-port", "0",
                "--grace", "5", "--dtype", "float32", *self.router_args]
        for p in workers:
            flag = {"prefill": "--prefill", "decode": "--decode", "both": "--workers"}
            args += [flag[p.name.rstrip("0123456789")], p.address]
        self._wait_ready([self._spawn("router", args)])
        return self

    @property
    def router(self) -> Proc:
        return self.procs["router"]

    def workers(self, role: str | None = None) -> list[Proc]:
        return [p for n, p in self.procs.items()
                if n != "router" and (role is None or n.startswith(role))]

    def api(self, channel: grpc.aio.Channel) -> api_pb2_grpc.TandemStub:
        return api_pb2_grpc.TandemStub(channel)

    async def load(self, proc: Proc) -> worker_pb2.Load:
        async with grpc.aio.insecure_channel(proc.address) as ch:
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

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        for p in self.procs.values():
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        codes = {}
        for name, p in self.procs.items():
            try:
                codes[name] = p.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                codes[name] = None
        return codes
