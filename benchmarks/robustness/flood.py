"""Floods below the limit: `tandem up --model tandem-demo --decode-workers 2` on this machine's
CPU, then --requests requests sent at once (HTTP, streamed HTTP and gRPC in turn, --max-tokens
each), --floods times, with --burners CPU-bound processes beside the stack (`while 1: pass`).
Loopback only; bounded in count (--floods x --requests) and time (--max-duration).

    python benchmarks/robustness/flood.py --floods 20 --requests 1000 --burners 2 --out flood.json
    python benchmarks/robustness/flood.py --floods 5 --code /path/to/other/checkout     # a baseline

The requests of a flood are sent by --clients processes (each its share, all released at once
by one barrier), so that the client's own event loop does not pace the burst.

A request ends OK (its whole answer, [DONE] on a stream), or refused for load: HTTP 429 with a
Retry-After header, gRPC RESOURCE_EXHAUSTED with a RetryInfo; anything else is a failure. The
router's counters tell whether a worker was failed over meanwhile (tandem:worker_lost: no poll
answered for --worker-timeout; tandem:request_migrations: a stream moved after its worker
failed), its log whether a worker was taken out ("is down", "failed a call"), and its loop lag
histogram how long its event loop stalled (the longest stall's bucket). Exit code 1 when any request failed or any worker was
failed over.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "protos", ROOT):
    sys.path.insert(0, str(_p))

import grpc  # noqa: E402
import httpx  # noqa: E402
from google.rpc import error_details_pb2, status_pb2  # noqa: E402

from benchmarks.robustness.soak_report import metric_total  # noqa: E402
from tandem.cli.launcher import free_port  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.runtime.convert import params_to_proto  # noqa: E402
from tandem.v1 import api_pb2, api_pb2_grpc  # noqa: E402

KINDS = ("http", "http-stream", "grpc")
# Router log lines that say a worker was taken out of routing or failed over.
TAKEN_OUT = re.compile(r"is down|failed a call: taken out|has answered no poll|failing over")
BANNER = re.compile(r"OpenAI HTTP: http://[^:]+:(\d+)/v1.*?gRPC:\s+[^:]+:(\d+)", re.S)


class Stack:
    """`tandem up` as a user starts it, on free loopback ports, logging to a directory."""

    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.out = log_dir / "up.out"
        code = Path(args.code).resolve() if args.code else ROOT
        cmd = [sys.executable, "-m", "tandem.cli.main", "up", "--model", args.model,
               "--decode-workers", str(args.decode_workers), "--http-port", str(free_port()),
               "--grpc-port", str(free_port()), "--log-dir", str(log_dir), "--device", "cpu",
               *args.up_arg]
        with open(self.out, "w") as f:
            # -m tandem.cli.main from `code`: that checkout's modules come first on sys.path.
            self.proc = subprocess.Popen(cmd, cwd=code, stdout=f, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1",
                                              "PYTHONPATH": str(code)},
                                         start_new_session=True)
        deadline = time.monotonic() + args.startup_timeout
        while (m := BANNER.search(self.out.read_text())) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tandem up did not start:\n{self.out.read_text()[-3000:]}")
            time.sleep(0.2)
        self.http = f"http://127.0.0.1:{m.group(1)}"
        self.grpc = f"127.0.0.1:{m.group(2)}"

    def router_log(self) -> str:
        path = self.log_dir / "router.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _retry_info(e: grpc.aio.AioRpcError) -> bool:
    """Does the error carry a google.rpc.RetryInfo (the gRPC side of Retry-After)?"""
    for key, value in e.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            st = status_pb2.Status.FromString(value)
            return any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in st.details)
    return False


async def one(kind: str, i: int, http: httpx.AsyncClient, stub, max_tokens: int) -> str:
    """One request's outcome: ok, 429 (refused for load, with its retry hint), or a failure's
    description."""
    prompt = f"Request {i}: tell me about the number {i * 7919 % 10007}."
    try:
        if kind == "grpc":
            call = stub.Generate(api_pb2.GenerateRequest(text=prompt, params=params_to_proto(
                SamplingParams(max_tokens=max_tokens, ignore_eos=True))))
            finished = 0
            async for chunk in call:
                finished += bool(chunk.finish_reason)
            return "ok" if finished == 1 else "grpc: no finish_reason"
        body = {"model": "tandem-demo", "max_tokens": max_tokens, "ignore_eos": True}
        if kind == "http":
            r = await http.post("/v1/completions", json={**body, "prompt": prompt})
            if r.status_code == 200:
                return "ok" if r.json()["choices"][0]["finish_reason"] else "http: unfinished"
            return _http_refusal(r.status_code, r.headers, r.text)
        chat = {**body, "stream": True, "messages": [{"role": "user", "content": prompt}]}
        async with http.stream("POST", "/v1/chat/completions", json=chat) as r:
            if r.status_code != 200:
                return _http_refusal(r.status_code, r.headers, (await r.aread()).decode())
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        if events[-1:] == ["data: [DONE]"] and not any('"error"' in e for e in events):
            return "ok"
        return f"http-stream: {events[-1][:200] if events else 'no events'}"
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _retry_info(e):
            return "429"
        return f"grpc {e.code().name}: {e.details()}"
    except (httpx.HTTPError, OSError) as e:
        return f"{kind} {type(e).__name__}: {e}"


def _http_refusal(status: int, headers, text: str) -> str:
    if status == 429 and headers.get("retry-after"):
        return "429"
    return f"http {status}: {text[:200]}"


async def _share(http_url: str, grpc_addr: str, ids: range, kinds: tuple[str, ...],
                 max_tokens: int, timeout: float) -> list[str]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=http_url, limits=limits, timeout=timeout) as http, \
            grpc.aio.insecure_channel(grpc_addr) as ch:
        stub = api_pb2_grpc.TandemStub(ch)
        results = await asyncio.gather(*(
            asyncio.wait_for(one(kinds[i % len(kinds)], i, http, stub, max_tokens), timeout)
            for i in ids), return_exceptions=True)
    return [r if isinstance(r, str) else f"client {type(r).__name__}" for r in results]


def _client(http_url: str, grpc_addr: str, ids: range, kinds: tuple[str, ...],
            max_tokens: int, timeout: float, barrier, out) -> None:
    barrier.wait()
    out.put(asyncio.run(_share(http_url, grpc_addr, ids, kinds, max_tokens, timeout)))


def flood(stack: Stack, n: int, clients: int, kinds: tuple[str, ...], max_tokens: int,
          timeout: float) -> Counter:
    """n requests of `kinds` (in turn), from `clients` processes released together; their
    outcomes."""
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(clients), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(stack.http, stack.grpc, range(k, n, clients),
                                               kinds, max_tokens, timeout, barrier, out))
             for k in range(clients)]
    for p in procs:
        p.start()
    outcomes: Counter = Counter()
    for _ in procs:
        outcomes.update(out.get())
    for p in procs:
        p.join()
    return outcomes


def _lag_buckets(text: str) -> dict[float, float]:
    """le -> cumulative count of tandem:router_loop_lag_seconds."""
    return {float(le): float(v) for le, v in re.findall(
        r'^tandem:router_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)}


def router_counters(stack: Stack) -> dict:
    text = httpx.get(f"{stack.http}/metrics", timeout=30).text
    return {"worker_lost": metric_total(text, "worker_lost"),
            "request_migrations": metric_total(text, "request_migrations"),
            "worker_restarts": metric_total(text, "worker_restarts"),
            "lag": _lag_buckets(text)}


def longest_stall(before: dict[float, float], after: dict[float, float]) -> str:
    """The bucket of the longest loop stall between two scrapes ("<=0.25" s, ">10" s), or
    "n/a" when the router has no such histogram (a checkout before it)."""
    if not after:
        return "n/a"
    new = {le: after[le] - before.get(le, 0.0) for le in after}
    total = new.get(float("inf"), 0.0)
    bounds = sorted(le for le in new if le != float("inf"))
    for le in bounds:
        if new[le] >= total:
            return f"<={le:g}"
    return f">{bounds[-1]:g}" if bounds else "n/a"


def burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--floods", type=int, default=20)
    p.add_argument("--requests", type=int, default=1000, help="sent at once, per flood")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--burners", type=int, default=2, help="CPU-bound processes beside the stack")
    p.add_argument("--clients", type=int, default=3,
                   help="client processes sending each flood's requests, released together")
    p.add_argument("--mix", choices=["mixed", "in-turn"], default="mixed",
                   help="mixed: every flood HTTP, streamed HTTP and gRPC requests in turn; "
                        "in-turn: flood k all of one kind, the kinds in turn")
    p.add_argument("--code", default=None,
                   help="run tandem up from this checkout instead (a baseline to compare)")
    p.add_argument("--model", default="tandem-demo")
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--up-arg", action="append", default=[],
                   help="extra flag for tandem up (repeatable), e.g. --up-arg=--num-blocks=512")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--max-duration", type=float, default=3600.0,
                   help="stop starting floods after this many seconds")
    p.add_argument("--out", default=None, help="write the results here (JSON)")
    a = p.parse_args(argv)
    if a.floods < 1 or a.requests < 1 or a.clients < 1:
        p.error("--floods, --requests and --clients must be >= 1")
    t0 = time.monotonic()
    hot = burners(a.burners)
    rows: list[dict] = []
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-flood-") as tmp:
            stack = Stack(a, Path(tmp))
            try:
                for k in range(a.floods):
                    if time.monotonic() - t0 > a.max_duration:
                        break
                    before = router_counters(stack)
                    taken_before = len(TAKEN_OUT.findall(stack.router_log()))
                    start = time.monotonic()
                    kinds = KINDS if a.mix == "mixed" else (KINDS[k % len(KINDS)],)
                    outcomes = flood(stack, a.requests, a.clients, kinds, a.max_tokens,
                                     a.request_timeout)
                    after = router_counters(stack)
                    row = {"flood": k + 1, "kinds": "+".join(kinds), "seconds": round(time.monotonic() - start, 1),
                           "ok": outcomes.pop("ok", 0), "refused_429": outcomes.pop("429", 0),
                           "failed": dict(outcomes),
                           "workers_taken_out": len(TAKEN_OUT.findall(stack.router_log()))
                           - taken_before,
                           "longest_loop_stall_s": longest_stall(before["lag"], after["lag"]),
                           **{k2: after[k2] - before[k2] for k2 in
                              ("worker_lost", "request_migrations", "worker_restarts")}}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                stack.stop()
    finally:
        for b in hot:
            b.kill()
            b.wait()
    failed = sum(sum(r["failed"].values()) for r in rows)
    failovers = sum(r["worker_lost"] + r["request_migrations"] + r["workers_taken_out"]
                    for r in rows)
    summary = {"code": a.code or "this checkout", "cores": len(os.sched_getaffinity(0)),
               "burners": a.burners, "clients": a.clients, "mix": a.mix,
               "floods": len(rows), "requests_each": a.requests, "max_tokens": a.max_tokens,
               "ok": sum(r["ok"] for r in rows), "refused_429": sum(r["refused_429"] for r in rows),
               "failed": failed, "failovers": failovers,
               "seconds_max": max((r["seconds"] for r in rows), default=None),
               "elapsed_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(summary), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "floods": rows}, indent=1))
    return 0 if failed == 0 and failovers == 0 and rows else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
