"""Several router processes behind one pair of ports (`tandem router --api-processes N`).

One router process is one event loop on one core, and every token costs it work (a gRPC or SSE
message per token per stream, detokenization): at ~10k tokens/s it is most of a core, and new
calls wait behind the tokens of the running ones (BENCHMARKS "Router API processes": on an H200,
1,000 requests at once, TTFT p50 5.2 s through one process against 3.9 s offline and through
four). With N > 1 the first process (the primary) starts N - 1 more, each a whole router over the
same workers, and every one listens on the same gRPC and HTTP ports with SO_REUSEPORT: the
kernel spreads connections over them. What each process does alone:

- its own requests, start to end (routing, migration, rebalance of what it streams);
- its own view of the workers (each polls them and follows their KV events);
- `--max-requests` counts its own requests.

What stays with the primary: the planner (one set of role changes), the ready file (written once
every process serves) and the lifetime of the others: they stop with it (SIGTERM drains them
alongside it) and it stops, exit code 1, if one of them dies. /metrics answers from any
process with every process's series, each labelled api_process="K": each process also serves
its own on a loopback port written to a directory they share, read at scrape time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tandem.runtime.lifeline import lifeline_env

log = logging.getLogger(__name__)
# httpx logs every request at INFO: here that is each scrape's reads of the other processes.
logging.getLogger("httpx").setLevel(logging.WARNING)

READY_TIMEOUT_S = 300.0  # a router starts in seconds; its tokenizer may take longer to load
SCRAPE_TIMEOUT_S = 2.0


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (0: a free port) that other sockets with SO_REUSEPORT
    may bind too; not listening yet."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, port))
    return s


def _replace_flags(argv: Sequence[str], values: dict[str, str | None]) -> list[str]:
    """argv without the flags named in `values` (as `--flag V` or `--flag=V`), then each one
    set to its value (None: left out)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in values:
            skip = "=" not in arg
            continue
        out.append(arg)
    for flag, value in values.items():
        if value is not None:
            out += [flag, value]
    return out


class ApiProcesses:
    """The primary's view of the other processes: started, waited for, stopped."""

    def __init__(self, argv: Sequence[str], count: int, grpc_port: int, http_port: int,
                 shared_dir: Path) -> None:
        self.argv, self.count = list(argv), count
        self.grpc_port, self.http_port = grpc_port, http_port
        self.shared_dir = shared_dir
        self.procs: list[asyncio.subprocess.Process] = []
        self._stopping = False

    def child_argv(self, index: int) -> list[str]:
        return _replace_flags(self.argv, {
            "--grpc-port": str(self.grpc_port), "--http-port": str(self.http_port),
            "--api-processes": "1", "--api-process-index": str(index),
            "--api-shared-dir": str(self.shared_dir),
            "--ready-file": str(self.shared_dir / f"{index}.ready")})

    async def start(self) -> None:
        """Start processes 1..N-1 and wait until each serves (or fail naming the one that
        exited)."""
        # Files the primary reads its cluster credentials from as /dev/fd/N (a launcher's
        # anonymous memory files) are open in the others too.
        fds = tuple(sorted({int(m) for a in self.argv for m in re.findall(r"^/dev/fd/(\d+)$", a)}))
        env = {**os.environ, **lifeline_env()}
        for k in range(1, self.count):
            self.procs.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tandem.cli.main", *self.child_argv(k), env=env,
                pass_fds=fds))
        deadline = time.monotonic() + READY_TIMEOUT_S
        for k, p in enumerate(self.procs, start=1):
            ready = self.shared_dir / f"{k}.ready"
            while not ready.exists():
                if p.returncode is not None:
                    raise RuntimeError(f"router API process {k} exited with {p.returncode} "
                                       "while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"router API process {k} did not start in "
                                       f"{READY_TIMEOUT_S:.0f}s")
                await asyncio.sleep(0.05)

    async def wait_any_exit(self) -> tuple[int, int]:
        """Returns (index, exit code) of the first process to exit."""
        waits = {asyncio.ensure_future(p.wait()): k for k, p in enumerate(self.procs, start=1)}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        first = next(iter(done))
        return waits[first], first.result()

    async def stop(self) -> None:
        """SIGTERM every process still running (each drains as the primary does); wait for them."""
        self._stopping = True
        for p in self.procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        codes = [await p.wait() for p in self.procs]
        if any(codes):
            log.warning("router API processes exited with %s", codes)

    @property
    def stopping(self) -> bool:
        return self._stopping


def make_shared_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="tandem-router-"))


def remove_shared_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# -- metrics of every process ---------------------------------------------------------------------
def publish_metrics_port(shared_dir: Path, index: int, port: int) -> None:
    tmp = shared_dir / f"{index}.metrics.tmp"
    tmp.write_text(str(port))
    os.replace(tmp, shared_dir / f"{index}.metrics")


async def gather_expositions(shared_dir: Path, own_index: int, own: bytes) -> dict[int, str]:
    """Each process's metrics text by index: this one's as given, the others' read from their
    loopback ports (one that does not answer in time is left out, and said so in the log)."""
    texts = {own_index: own.decode()}
    ports = {}
    for f in shared_dir.glob("*.metrics"):
        k = int(f.name.split(".", 1)[0])
        if k != own_index:
            with contextlib.suppress(OSError, ValueError):
                ports[k] = int(f.read_text())
    if not ports:
        return texts
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
        async def one(k: int, port: int) -> None:
            try:
                r = await client.get(f"http://127.0.0.1:{port}/metrics")
                r.raise_for_status()
                texts[k] = r.text
            except httpx.HTTPError as e:
                log.warning("metrics of router API process %d unread: %s", k, e)

        await asyncio.gather(*(one(k, p) for k, p in sorted(ports.items())))
    return texts


def merge_expositions(texts: dict[int, str]) -> bytes:
    """One exposition of several processes' texts: every sample labelled api_process="K",
    each metric family once."""
    families: dict[str, Metric] = {}
    for k, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                  fam.unit)
            for s in fam.samples:
                out.samples.append(Sample(s.name, {**s.labels, "api_process": str(k)},
                                          s.value, s.timestamp, s.exemplar))

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)
