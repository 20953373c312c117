"""Soak: a supervised stack (as `tandem up` runs it: router, prefill and decode workers on the
CPU, restarted when they exit) under a random mix of requests, while every so often a worker is
killed (SIGKILL) or hung (SIGSTOP, then SIGCONT a few seconds later). Loopback only; bounded in
time (--duration, at most --max-duration) and count (--max-requests).

    python benchmarks/robustness/soak.py --duration 600 --out soak.json
    python benchmarks/robustness/soak.py --duration 40 --min-faults 2        # the CI version's size

The mix: gRPC streams, HTTP streams (SSE) and plain HTTP completions; n = 1 and 2; greedy,
seeded and unseeded sampling; some cancelled by the client after a few chunks, some gRPC ones
with a deadline. Before any fault each request shape runs once per API: a greedy or seeded
request that later succeeds must give exactly that output (a stream moved between decode
workers included).

Outcomes: ok; cancelled (by the client, as planned); clear errors (UNAVAILABLE / HTTP 503 with
their message, RESOURCE_EXHAUSTED / 429, DEADLINE_EXCEEDED of a request that set a deadline);
unexplained: anything else, and any output that differs from its shape's. At the end, with every
worker resumed and back: blocks in use and leases on every pool (after lease expiry at most),
and the RSS of the router and each worker (with its engine core) at start and end. Exit code 1
when anything is unexplained or leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "protos", ROOT):
    sys.path.insert(0, str(_p))

import grpc  # noqa: E402
import httpx  # noqa: E402

from benchmarks.robustness import fault_stack  # noqa: E402
from benchmarks.robustness.soak_report import metric_total, report, rss  # noqa: E402
from tandem.cli.launcher import LocalStack  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.runtime.convert import params_to_proto  # noqa: E402
from tandem.v1 import api_pb2, api_pb2_grpc  # noqa: E402

KINDS = ("grpc", "http-stream", "http")
CLEAR_GRPC = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass(frozen=True)
class Shape:
    prompt: tuple[int, ...]
    n: int
    temperature: float
    seed: int | None
    max_tokens: int

    @property
    def exact(self) -> bool:
        """Greedy or seeded: every run gives the same output."""
        return self.temperature == 0 or self.seed is not None

    def params(self) -> SamplingParams:
        return SamplingParams(n=self.n, temperature=self.temperature, seed=self.seed,
                              max_tokens=self.max_tokens, ignore_eos=True)

    def body(self, stream: bool) -> dict:
        b = {"prompt": list(self.prompt), "n": self.n, "temperature": self.temperature,
             "max_tokens": self.max_tokens, "ignore_eos": True, "stream": stream}
        if self.seed is not None:
            b["seed"] = self.seed
        return b


def make_shapes(rng: random.Random, count: int) -> list[Shape]:
    sampling = [(0.0, None), (0.8, 1234), (1.0, None)]  # greedy, seeded, unseeded
    return [Shape(tuple(rng.randrange(1, 200) for _ in range(rng.randrange(4, 60))),
                  rng.choice((1, 1, 2)), *sampling[i % 3], rng.randrange(16, 96))
            for i in range(count)]


class Soak:
    def __init__(self, a: argparse.Namespace, stack: LocalStack) -> None:
        self.a = a
        self.stack = stack
        self.rng = random.Random(a.seed)
        self.shapes = make_shapes(self.rng, a.shapes)
        self.reference: dict[tuple[str, int], list] = {}
        self.outcomes: Counter[str] = Counter()
        self.clear: Counter[str] = Counter()
        self.unexplained: list[str] = []
        self.faults: list[dict] = []
        self.stopped: str | None = None  # a worker SIGSTOPped now

    # -- one request -------------------------------------------------------------------------
    async def request(self, kind: str, i: int, cancel_after: int | None,
                      deadline: float | None) -> tuple[str, str, list | None]:
        """(outcome, detail, output): ok, cancelled, clear or unexplained."""
        shape = self.shapes[i]
        try:
            if kind == "grpc":
                return await self._grpc(shape, cancel_after, deadline)
            return await self._http(shape, kind == "http-stream", cancel_after)
        except (httpx.HTTPError, OSError) as e:
            return "unexplained", f"{kind}: client error {type(e).__name__}: {e}", None

    async def _grpc(self, shape: Shape, cancel_after, deadline):
        req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=list(shape.prompt)),
                                      params=params_to_proto(shape.params()))
        call = self.stub.Generate(req, timeout=deadline)
        out: list[list[int]] = [[] for _ in range(shape.n)]
        chunks = 0
        try:
            async for chunk in call:
                out[chunk.index] += chunk.token_ids
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    call.cancel()
                    return "cancelled", "", None
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code in CLEAR_GRPC or (code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline):
                return "clear", f"{code.name}: {_brief(e.details())}", None
            return "unexplained", f"grpc {code.name}: {e.details()}", None
        return "ok", "", out

    async def _http(self, shape: Shape, stream: bool, cancel_after):
        body = shape.body(stream)
        texts = [""] * shape.n
        if not stream:
            r = await self.http.post("/v1/completions", json=body)
            if r.status_code in (429, 503):
                return "clear", f"HTTP {r.status_code}: {_brief(r.json()['error']['message'])}", None
            if r.status_code != 200:
                return "unexplained", f"HTTP {r.status_code}: {r.text[:300]}", None
            for c in r.json()["choices"]:
                texts[c["index"]] = c["text"]
            return "ok", "", texts
        async with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code in (429, 503):
                message = json.loads(await r.aread())["error"]["message"]
                return "clear", f"HTTP {r.status_code}: {_brief(message)}", None
            if r.status_code != 200:
                return "unexplained", f"HTTP {r.status_code}: {(await r.aread())[:300]!r}", None
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    err = event["error"]
                    if err.get("type") in ("service_unavailable", "rate_limit_error"):
                        return "clear", f"SSE {err['type']}: {_brief(err['message'])}", None
                    return "unexplained", f"SSE error {err}", None
                for c in event["choices"]:
                    texts[c["index"]] += c["text"]
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    return "cancelled", "", None  # leaving the block closes the response
        return "ok", "", texts

    def judge(self, kind: str, i: int, outcome: str, detail: str, out) -> str:
        if outcome == "ok" and self.shapes[i].exact:
            ref = self.reference.get(("grpc" if kind == "grpc" else "http", i))
            if ref is not None and out != ref:
                outcome, detail = "unexplained", f"{kind} shape {i}: output differs from its " \
                                                 f"reference"
        self.outcomes[outcome] += 1
        if outcome == "clear":
            self.clear[detail] += 1
        elif outcome == "unexplained":
            self.unexplained.append(detail)
        return outcome

    # -- phases ------------------------------------------------------------------------------
    async def references(self) -> None:
        """Each shape once per API, before any fault: what every later run must give."""
        async def one(group: str, kind: str, i: int) -> None:
            outcome, detail, out = await self.request(kind, i, None, None)
            if outcome != "ok":
                raise SystemExit(f"soak: reference run {kind} of shape {i} failed: {detail}")
            self.reference[(group, i)] = out

        await asyncio.gather(*(one(g, k, i) for i in range(len(self.shapes))
                               for g, k in (("grpc", "grpc"), ("http", "http"))))

    async def load(self, duration_s: float) -> int:
        """Requests, `concurrency` at a time, until the time or count runs out (and the
        faults asked for have happened); how many were sent."""
        a = self.a
        t_end = time.monotonic() + duration_s
        hard_end = time.monotonic() + max(a.max_duration, duration_s)
        sent = 0

        def more() -> bool:
            now = time.monotonic()
            enough_faults = len(self.faults) >= a.min_faults and not self.stopped
            return sent < a.max_requests and now < hard_end and (now < t_end or
                                                                 not enough_faults)

        async def client() -> None:
            nonlocal sent
            while more():
                sent += 1
                kind = self.rng.choice(KINDS)
                i = self.rng.randrange(len(self.shapes))
                cancel_after = self.rng.randrange(1, 6) if self.rng.random() < a.cancels \
                    else None
                deadline = self.rng.uniform(1.0, 4.0) if kind == "grpc" and \
                    self.rng.random() < a.deadlines else None
                outcome = self.judge(kind, i, *await self.request(kind, i, cancel_after,
                                                                  deadline))
                if outcome == "clear":  # as a client honouring Retry-After (1 s)
                    await asyncio.sleep(1.0)

        await asyncio.gather(*(client() for _ in range(a.concurrency)))
        return sent

    async def inject(self, t0: float) -> None:
        """Faults, alternating a hang and a kill, each on a random worker once the stack is
        whole again, --fault-interval apart (jittered)."""
        a = self.a
        kinds = ["hang", "kill"]
        await asyncio.sleep(a.first_fault)
        while True:
            kind = kinds[len(self.faults) % 2]
            name = self.rng.choice([p.name for p in self.stack.workers()])
            at = time.monotonic() - t0
            self.faults.append({"kind": kind, "worker": name, "at_s": round(at, 1)})
            print(f"soak: {at:7.1f} s  {kind} {name}", flush=True)
            await fault_stack.inject(self.stack, kind, name, a.hang,
                                     stopped=lambda n: setattr(self, "stopped", n))
            await fault_stack.whole(self.http, "soak")
            await asyncio.sleep(a.fault_interval * self.rng.uniform(0.7, 1.3))

    async def run(self) -> dict:
        a = self.a
        async with grpc.aio.insecure_channel(self.stack.router.address) as ch, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.stack.router.http_port}",
                                  timeout=a.client_timeout) as http:
            self.stub, self.http = api_pb2_grpc.TandemStub(ch), http
            await self.references()
            rss_start = rss(self.stack)
            t0 = time.monotonic()
            faults = asyncio.create_task(self.inject(t0))
            try:
                sent = await self.load(a.duration)
            finally:
                faults.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await faults
            elapsed = time.monotonic() - t0
            await fault_stack.whole(http, "soak")
            pools = await fault_stack.pools(self.stack, timeout=a.lease_ttl + 30)
            router_metrics = (await http.get("/metrics")).text
        return {"elapsed_s": round(elapsed, 1), "requests": sent,
                "outcomes": dict(self.outcomes), "clear_errors": dict(self.clear),
                "unexplained": self.unexplained, "faults": self.faults, "pools": pools,
                "rss_mb": {"start": rss_start, "end": rss(self.stack)},
                "router": {m: metric_total(router_metrics, m) for m in
                           ("request_migrations", "worker_restarts", "worker_lost")}}


def _brief(message: str) -> str:
    """An error message without its addresses, ids and figures, for counting by kind."""
    return re.sub(r"\S+:\d+|req-\S+|\d+(\.\d+)?", "#", message)[:100]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="soak.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    fault_stack.add_stack_flags(p, concurrency=8, shapes=12, min_faults=2, fault_interval=8.0)
    p.add_argument("--cancels", type=float, default=0.1, help="share cancelled by the client")
    p.add_argument("--deadlines", type=float, default=0.15,
                   help="share of gRPC requests with a deadline (1-4 s)")
    p.add_argument("--client-timeout", type=float, default=120.0,
                   help="HTTP client timeout (a request this slow is unexplained)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    r = fault_stack.run_supervised(a, "soak", 5.0, lambda stack: Soak(a, stack).run())
    print(report(r, a))
    if a.out:
        a.out.write_text(json.dumps(r, indent=2))
    leaked = sum(p["blocks_in_use"] + p["leases"] + p["running"] + p["waiting"]
                 for p in r["pools"].values())
    return 1 if r["unexplained"] or leaked or r["supervisor_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
