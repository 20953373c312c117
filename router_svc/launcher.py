"""`tandem up`: the whole stack as local processes.

    tandem up                                  # tandem-demo, 1 prefill + 1 decode, CPU or GPUs
    tandem up --model DIR --prefill-workers 2 --decode-workers 2      # one GPU per worker
    tandem up --both-workers 2                 # colocated workers (the baseline)

Starts the workers, waits until each is healthy, starts the router in front of them, prints the
endpoints, and on Ctrl-C (or SIGTERM) drains and stops them all: router first, so no new
request reaches a worker that is stopping. If any process dies, everything stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

STARTUP_TIMEOUT_S = 900  # a large checkpoint can take minutes to load


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    ready_file: Path
    address: str = ""
    http_port: int = 0


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="start router + prefill + decode workers locally")
    p.add_argument("--model", default="tandem-demo", help="checkpoint directory, name or hub id")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--both-workers", type=int, default=0,
                   help="colocated workers; with --prefill-workers 0 --decode-workers 0 the "
                        "stack is colocated")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: one GPU per worker when there are enough GPUs, else the CPU")
    p.add_argument("--gpus", default=None,
                   help="comma-separated GPU indices to assign, one per worker (default: all)")
    p.add_argument("--host", default="127.0.0.1", help="router address (workers stay local)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--api-key", default=None, help="require this bearer token on HTTP")
    p.add_argument("--log-dir", default=None, help="also keep each process's log here")
    p.add_argument("--grace", type=float, default=30.0, help="seconds to drain on stop")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra flag for every worker, e.g. --worker-arg=--num-blocks=512 "
                        "(repeatable)")
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra flag for the router (repeatable)")
    for flag, kw in (("--dtype", {}), ("--load-format", {}), ("--max-model-len", {}),
                     ("--num-blocks", {}), ("--block-size", {}), ("--max-num-seqs", {}),
                     ("--max-num-batched-tokens", {}), ("--memory-fraction", {})):
        p.add_argument(flag, default=None, help="passed to every worker", **kw)
    p.set_defaults(func=run)


def _devices(args: argparse.Namespace, n: int) -> list[str]:
    """One device per worker: a GPU each when asked for (or, with auto, when enough exist)."""
    if args.device == "cpu":
        return ["cpu"] * n
    import torch  # noqa: PLC0415 - only to count GPUs

    gpus = ([int(g) for g in args.gpus.split(",")] if args.gpus
            else list(range(torch.cuda.device_count())))
    if args.device == "auto" and len(gpus) < n:
        return ["cpu"] * n
    if len(gpus) < n:
        raise SystemExit(f"tandem up: {n} workers need {n} GPUs, found {len(gpus)} "
                         "(each worker sizes its KV pool from its GPU's free memory)")
    return [f"cuda:{g}" for g in gpus[:n]]


def _pump(child: Child, log: Path | None) -> None:
    """Each child's output, line by line, prefixed with its name."""
    sink = open(log, "a") if log else None  # noqa: SIM115 - closed below
    try:
        for line in child.popen.stdout:
            sys.stdout.write(f"[{child.name}] {line}")
            sys.stdout.flush()
            if sink:
                sink.write(line)
    finally:
        if sink:
            sink.close()


class Stack:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="tandem-up-"))
        self.log_dir = Path(args.log_dir) if args.log_dir else None
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []

    def spawn(self, name: str, argv: list[str]) -> Child:
        ready = self.tmp / f"{name}.ready"
        popen = subprocess.Popen(
            [sys.executable, "-m", "router_svc.cli", *argv, "--ready-file", str(ready)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            # Interactive by default: readable log lines unless JSON was asked for.
            env={"TANDEM_LOG_FORMAT": "console", **os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True)
        child = Child(name, popen, ready)
        self.children.append(child)
        threading.Thread(target=_pump, args=(child, self.log_dir and self.log_dir /
                                             f"{name}.log"), daemon=True).start()
        return child

    def wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for c in children:
            while not c.ready_file.exists():
                if c.popen.poll() is not None:
                    raise RuntimeError(f"{c.name} exited with {c.popen.returncode} while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{c.name} did not become ready in {STARTUP_TIMEOUT_S}s")
                time.sleep(0.1)
            ports = c.ready_file.read_text().split()
            c.address = f"127.0.0.1:{ports[0]}"
            c.http_port = int(ports[1]) if len(ports) > 1 else 0

    def worker_args(self) -> list[str]:
        a = self.args
        out = ["--model", a.model, "--host", "127.0.0.1", "--port", "0", "--grace",
               str(a.grace)]
        for flag in ("dtype", "load_format", "max_model_len", "num_blocks", "block_size",
                     "max_num_seqs", "max_num_batched_tokens", "memory_fraction"):
            value = getattr(a, flag)
            if value is not None:
                out += [f"--{flag.replace('_', '-')}", str(value)]
        return out + a.worker_arg

    def start(self) -> Child:
        a = self.args
        roles = (["prefill"] * a.prefill_workers + ["decode"] * a.decode_workers
                 + ["both"] * a.both_workers)
        if not roles:
            raise SystemExit("tandem up: no workers requested")
        if (a.prefill_workers > 0) != (a.decode_workers > 0):
            raise SystemExit("tandem up: prefill workers need decode workers and vice versa")
        devices = _devices(a, len(roles))
        counts: dict[str, int] = {}
        workers: list[tuple[str, Child]] = []
        for role, device in zip(roles, devices):
            i = counts[role] = counts.get(role, -1) + 1
            cmd = ["worker", "--role", role, "--device", device, *self.worker_args()]
            workers.append((role, self.spawn(f"{role}{i}", cmd)))
        self.wait_ready([c for _, c in workers])
        router_cmd = ["router", "--model", a.model, "--host", a.host, "--grpc-port",
                      str(a.grpc_port), "--http-port", str(a.http_port), "--grace", str(a.grace)]
        if a.api_key:
            router_cmd += ["--api-key", a.api_key]
        if a.dtype:
            router_cmd += ["--dtype", a.dtype]
        if a.max_model_len:
            router_cmd += ["--max-model-len", str(a.max_model_len)]
        flags = {"prefill": "--prefill", "decode": "--decode", "both": "--workers"}
        for role, c in workers:
            router_cmd += [flags[role], c.address]
        router = self.spawn("router", router_cmd + a.router_arg)
        self.wait_ready([router])
        return router

    def any_exited(self) -> Child | None:
        return next((c for c in self.children if c.popen.poll() is not None), None)

    def stop(self) -> int:
        """Router first (it drains its streams), then the workers; exit code 0 when all did."""
        rc = 0
        ordered = sorted(self.children, key=lambda c: c.name != "router")
        for group in (ordered[:1], ordered[1:]):
            for c in group:
                if c.popen.poll() is None:
                    c.popen.send_signal(signal.SIGTERM)
            for c in group:
                try:
                    code = c.popen.wait(self.args.grace + 15)
                except subprocess.TimeoutExpired:
                    c.popen.kill()
                    code = c.popen.wait()
                rc = rc or code
        return rc


def run(args: argparse.Namespace) -> int:
    stack = Stack(args)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        router = stack.start()
    except (RuntimeError, SystemExit) as e:
        print(f"tandem up: {e}", file=sys.stderr)
        stack.stop()
        return 1
    host = args.host if args.host != "0.0.0.0" else "127.0.0.1"
    print(f"\nTandem is up ({args.model}; {len(stack.children) - 1} workers).\n"
          f"  OpenAI HTTP: http://{host}:{router.http_port}/v1\n"
          f"  gRPC:        {host}:{args.grpc_port if args.grpc_port else router.address}\n"
          "Ctrl-C stops everything.\n", flush=True)
    while not stopping.wait(0.5):
        dead = stack.any_exited()
        if dead is not None:
            print(f"tandem up: {dead.name} exited with {dead.popen.returncode}; stopping",
                  file=sys.stderr)
            stack.stop()
            return 1
    print("tandem up: stopping (draining in-flight requests)", flush=True)
    return stack.stop()
