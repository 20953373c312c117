"""Rolling restart and prefill kill under steady open-loop load: a supervised stack (1 prefill
+ 2 decode workers of `tandem-demo` by default, restarted when they exit, as `tandem up` runs
them) takes requests at a fixed rate (--rate per second, sent on time whether or not earlier
ones finished) of long generations, greedy and seeded, streamed over gRPC and over the OpenAI
HTTP API (SSE). Once the load is steady, two phases, one after the other:

    rolling    each decode worker in turn, as a Kubernetes rolling update does: SIGTERM → it
               drains (its running requests moved live to the other decode worker) → exits 0 →
               the supervisor starts it again → the router routes to it → the next one
    prefill    SIGKILL of the only prefill worker; the router prefills on the decode workers
               (fallback) until the supervisor's restart is up

Each request is judged: whole (every sample finished, its output equal to the same request's
fault-free run before the load), failed (an error status, or no answer within
--request-timeout), cut (the stream ended without a finish reason, or short) or different
(finished, another output). A phase counts every request whose life overlapped its window;
requests that overlapped no phase count as "no fault". At the end, with every worker back:
each pool's blocks in use, leases and requests (all 0 when nothing leaked). Loopback only.

    python benchmarks/robustness/rolling_restart.py                      # 50 req/s, 128-256 tokens
    python benchmarks/robustness/rolling_restart.py --rate 6 --out roll.json

Exit code 1 when a request was not whole or something leaked. The load the machine actually
sustained is printed next to the one offered (sent/s, finished/s, requests in flight): a rate
the stack cannot keep up with piles requests up until the router refuses them (429), which this
probe counts as failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "protos", ROOT):
    sys.path.insert(0, str(_p))

import grpc  # noqa: E402
import httpx  # noqa: E402

from benchmarks.robustness import fault_stack  # noqa: E402
from benchmarks.robustness.soak_report import metric_total  # noqa: E402
from tandem.cli.launcher import LocalStack  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.runtime.convert import params_to_proto  # noqa: E402
from tandem.v1 import api_pb2, api_pb2_grpc  # noqa: E402

RESULTS = ("whole", "failed", "cut", "different")
NUMBERS = re.compile(r"[0-9a-f]{16,}|\d+")  # ids and counts, out of a cause's text
COUNTERS = ("live_migrations", "request_migrations", "prefill_fallbacks", "worker_restarts",
            "worker_lost")


@dataclass(frozen=True)
class Shape:
    prompt: tuple[int, ...]
    api: str  # grpc or http (both streamed)
    seed: int | None  # None: greedy
    max_tokens: int

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=0.0 if self.seed is None else 0.8, seed=self.seed,
                              max_tokens=self.max_tokens, ignore_eos=True)

    def body(self) -> dict:
        b = {"prompt": list(self.prompt), "max_tokens": self.max_tokens, "ignore_eos": True,
             "temperature": 0.0 if self.seed is None else 0.8, "stream": True}
        if self.seed is not None:
            b["seed"] = self.seed
        return b


def make_shapes(rng: random.Random, a: argparse.Namespace) -> list[Shape]:
    """Short prompts (the load is the generation), a quarter over HTTP, a third seeded."""
    return [Shape(tuple(rng.randrange(1, 250) for _ in range(rng.randrange(4, a.max_prompt + 1))),
                  "http" if rng.random() < a.http_share else "grpc",
                  1000 + i if i % 3 == 2 else None,
                  rng.randrange(a.min_tokens, a.max_tokens + 1))
            for i in range(a.shapes)]


@dataclass
class Outcome:
    shape: int
    sent: float  # seconds since the load began
    done: float
    result: str  # one of RESULTS
    detail: str = ""


@dataclass
class Phase:
    name: str
    start: float  # seconds since the load began
    end: float = 0.0
    events: list[str] = field(default_factory=list)
    router: dict[str, float] = field(default_factory=dict)  # counters' change over the window


def tally(outcomes: list[Outcome], phases: list[Phase]) -> list[dict]:
    """Rows of the table: each phase (requests whose life overlapped its window), requests that
    overlapped none ("no fault"), and all of them."""
    def row(name: str, window: str, rows: list[Outcome]) -> dict:
        counts = {r: sum(o.result == r for o in rows) for r in RESULTS}
        secs = sorted(o.done - o.sent for o in rows if o.result == "whole")
        pct = (lambda q: round(secs[min(len(secs) - 1, int(q * len(secs)))], 1)) if secs \
            else (lambda q: None)
        return {"phase": name, "window_s": window, "requests": len(rows), **counts,
                "latency_p50_s": pct(0.5), "latency_p99_s": pct(0.99)}

    def overlaps(o: Outcome, p: Phase) -> bool:
        return o.sent <= p.end and o.done >= p.start

    out = [row(p.name, f"{p.start:.1f}-{p.end:.1f}", [o for o in outcomes if overlaps(o, p)])
           for p in phases]
    out.insert(0, row("no fault", "", [o for o in outcomes
                                       if not any(overlaps(o, p) for p in phases)]))
    out.append(row("all", "", outcomes))
    return out


class Rolling:
    def __init__(self, a: argparse.Namespace, stack: LocalStack) -> None:
        self.a, self.stack = a, stack
        self.rng = random.Random(a.seed)
        self.shapes = make_shapes(self.rng, a)
        self.reference: list[list[str] | list[list[int]]] = []
        self.outcomes: list[Outcome] = []
        self.phases: list[Phase] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.t0 = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- one request -------------------------------------------------------------------------
    async def request(self, i: int) -> tuple[str, str, list | None]:
        """(result, detail, output) of shape i: whole is judged against the reference later."""
        s = self.shapes[i]
        try:
            if s.api == "grpc":
                return await asyncio.wait_for(self._grpc(s), self.a.request_timeout)
            return await asyncio.wait_for(self._http(s), self.a.request_timeout)
        except TimeoutError:
            return "failed", f"{s.api}: no answer within {self.a.request_timeout:.0f} s", None
        except grpc.aio.AioRpcError as e:
            return "failed", f"grpc {e.code().name}: {(e.details() or '')[:160]}", None
        except (httpx.HTTPError, OSError) as e:
            return "failed", f"http client {type(e).__name__}: {str(e)[:160]}", None

    async def _grpc(self, s: Shape) -> tuple[str, str, list | None]:
        req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=list(s.prompt)),
                                      params=params_to_proto(s.params()))
        tokens: list[int] = []
        finish = ""
        async for chunk in self.stub.Generate(req):
            tokens += chunk.token_ids
            finish = chunk.finish_reason or finish
        if finish != "length" or len(tokens) != s.max_tokens:
            return "cut", f"grpc: {len(tokens)} of {s.max_tokens} tokens, finish " \
                          f"{finish or 'none'}", tokens
        return "whole", "", tokens

    async def _http(self, s: Shape) -> tuple[str, str, list | None]:
        text, finish, done = "", "", False
        async with self.http.stream("POST", "/v1/completions", json=s.body()) as r:
            if r.status_code != 200:
                return "failed", f"HTTP {r.status_code}: {(await r.aread())[:160]!r}", None
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "failed", f"SSE error {str(event['error'])[:160]}", None
                    for c in event["choices"]:
                        text += c["text"]
                        finish = c.get("finish_reason") or finish
        if not done or finish != "length":
            return "cut", f"http: finish {finish or 'none'}, [DONE] {done}", text
        return "whole", "", text

    async def one(self, i: int) -> None:
        sent = self.now()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            result, detail, out = await self.request(i)
        finally:
            self.in_flight -= 1
        if result == "whole" and out != self.reference[i]:
            result, detail = "different", f"shape {i} ({self.shapes[i].api}): output differs " \
                                          "from its fault-free run"
        self.outcomes.append(Outcome(i, round(sent, 3), round(self.now(), 3), result, detail))

    # -- the load and the faults -------------------------------------------------------------
    async def load(self, faults: asyncio.Task) -> dict:
        """A request every 1/rate s, on time, until the faults are over and --tail s more (at
        most --max-duration); then until every request answered."""
        a = self.a
        tasks: list[asyncio.Task] = []
        late = 0.0  # how far behind its schedule the last send was (the client's own lag)
        k = 0
        while k < a.max_requests and self.now() < a.max_duration:
            if faults.done() and self.now() > (self.phases[-1].end if self.phases else 0) \
                    + a.tail:
                break
            due = k / a.rate
            wait = due - self.now()
            if wait > 0:
                await asyncio.sleep(wait)
            late = max(late, self.now() - due)
            tasks.append(asyncio.create_task(self.one(self.rng.randrange(len(self.shapes)))))
            k += 1
        sending = self.now()
        in_flight_then = self.in_flight
        await asyncio.gather(*tasks)
        return {"sent": k, "sending_s": round(sending, 1), "max_late_s": round(late, 2),
                "in_flight_when_sending_stopped": in_flight_then,
                "max_in_flight": self.max_in_flight, "all_answered_s": round(self.now(), 1)}

    async def faults(self) -> None:
        a = self.a
        await asyncio.sleep(a.warmup)
        if "rolling" in a.phases:
            p = await self._phase("rolling restart: " + ", ".join(
                w.name for w in self.stack.workers("decode")))
            for w in self.stack.workers("decode"):
                await self._restart(p, w.name, signal.SIGTERM)
            await self._end(p)
            await asyncio.sleep(a.settle)
        if "prefill" in a.phases:
            names = [w.name for w in self.stack.workers("prefill")]
            p = await self._phase(f"SIGKILL {', '.join(names)}")
            for name in names:
                await self._restart(p, name, signal.SIGKILL)
            await self._end(p)

    async def _phase(self, name: str) -> Phase:
        p = Phase(name, round(self.now(), 1))
        p.router = await self._counters()
        self.phases.append(p)
        print(f"rolling_restart: {p.start:7.1f} s  {name} ({self.in_flight} requests in "
              "flight)", flush=True)
        return p

    async def _end(self, p: Phase) -> None:
        p.end = round(self.now(), 1)
        after = await self._counters()
        p.router = {k: after[k] - p.router[k] for k in COUNTERS}

    async def _restart(self, p: Phase, name: str, sig: signal.Signals) -> None:
        """Signal worker `name`; once it exited, wait for the supervisor's restart and for the
        router to route to the new instance."""
        proc = self.stack.procs[name]
        before = await self._instance(proc.address)
        t = self.now()
        os.kill(proc.popen.pid, sig)
        while proc.popen.poll() is None:
            await asyncio.sleep(0.1)
        exited = self.now()
        drained = re.findall(r"drained: (\d+) requests moved, (\d+) finished here, (\d+) left",
                             proc.log_text())
        while self.stack.procs[name] is proc or not self.stack.read_ready(self.stack.procs[name]):
            await asyncio.sleep(0.1)
        while (w := await self._instance(proc.address)) is None or w["instance_id"] == \
                before["instance_id"] or w["state"] != "up" or w["draining"]:
            await asyncio.sleep(0.1)
        moved = (f", drain: {drained[-1][0]} moved, {drained[-1][1]} finished there, "
                 f"{drained[-1][2]} left" if drained and sig == signal.SIGTERM else "")
        event = (f"{name} {sig.name} at {t:.1f} s: exit {proc.popen.returncode} after "
                 f"{exited - t:.1f} s{moved}; routed again {self.now() - exited:.1f} s later")
        p.events.append(event)
        print(f"rolling_restart: {event}", flush=True)

    async def _instance(self, address: str) -> dict | None:
        workers = (await self.http.get("/workers")).json()["workers"]
        return next((w for w in workers if w["address"] == address), None)

    async def _counters(self) -> dict[str, float]:
        text = (await self.http.get("/metrics")).text
        return {m: metric_total(text, m) for m in COUNTERS}

    async def run(self) -> dict:
        a = self.a
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with grpc.aio.insecure_channel(self.stack.router.address) as ch, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.stack.router.http_port}",
                                  timeout=httpx.Timeout(a.request_timeout, pool=None),
                                  limits=limits) as http:
            self.stub, self.http = api_pb2_grpc.TandemStub(ch), http
            self.reference = [None] * len(self.shapes)
            await self._references()
            self.t0 = time.monotonic()
            loadavg = [os.getloadavg()[0]]
            faults = asyncio.create_task(self.faults())
            try:
                sent = await self.load(faults)
            finally:
                faults.cancel()
                await asyncio.gather(faults, return_exceptions=True)
            await fault_stack.whole(http, "rolling_restart")
            pools = await fault_stack.pools(self.stack, timeout=a.lease_ttl + 30)
            router = await self._counters()
            loadavg.append(os.getloadavg()[0])
        done = [o for o in self.outcomes if o.result in ("whole", "different")]
        load_end = max((o.done for o in self.outcomes), default=1.0)
        return {"load": {**sent, "offered_per_s": a.rate,
                         "sent_per_s": round(sent["sent"] / max(sent["sending_s"], 1e-9), 1),
                         "finished_per_s": round(len(done) / load_end, 1),
                         "output_tokens_per_s": round(sum(self.shapes[o.shape].max_tokens
                                                          for o in done) / load_end)},
                "table": tally(self.outcomes, self.phases),
                "whole_by_kind": self._by_kind(),
                "not_whole_by_cause": self._causes(),
                "phases": [asdict(p) for p in self.phases],
                "not_whole": [asdict(o) for o in self.outcomes if o.result != "whole"][:50],
                "pools": pools, "router": router,
                "loadavg_1min_start_end": [round(x, 1) for x in loadavg]}

    def _by_kind(self) -> dict[str, int]:
        """Whole requests by API and sampling (grpc greedy, http seeded...)."""
        out: dict[str, int] = {}
        for o in self.outcomes:
            if o.result == "whole":
                s = self.shapes[o.shape]
                kind = f"{s.api} {'greedy' if s.seed is None else 'seeded'}"
                out[kind] = out.get(kind, 0) + 1
        return out

    def _causes(self) -> dict[str, int]:
        """Requests not whole, by result and cause (a 429 apart from a cut stream)."""
        out: dict[str, int] = {}
        for o in self.outcomes:
            if o.result != "whole":
                cause = f"{o.result}: {NUMBERS.sub('N', o.detail)[:90]}"
                out[cause] = out.get(cause, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    async def _references(self) -> None:
        """Each shape once, before any fault and any load: what every later run must give."""
        sem = asyncio.Semaphore(8)

        async def ref(i: int) -> None:
            async with sem:
                result, detail, out = await self.request(i)
            if result != "whole":
                raise SystemExit(f"rolling_restart: the fault-free run of shape {i} was "
                                 f"{result}: {detail}")
            self.reference[i] = out

        await asyncio.gather(*(ref(i) for i in range(len(self.shapes))))


def report(r: dict, a: argparse.Namespace) -> str:
    ld = r["load"]
    lines = [f"rolling_restart: {a.prefill_workers}P+{a.decode_workers}D {a.model} on {a.device} "
             f"({r['cores']} cores, 1-min load average {r['loadavg_1min_start_end']} at the load's start and end); offered {ld['offered_per_s']} "
             f"req/s of {a.min_tokens}-{a.max_tokens} tokens; sent {ld['sent']} at "
             f"{ld['sent_per_s']}/s over {ld['sending_s']} s (client at most "
             f"{ld['max_late_s']} s late); finished {ld['finished_per_s']}/s, "
             f"{ld['output_tokens_per_s']} output tok/s; in flight at most "
             f"{ld['max_in_flight']}, {ld['in_flight_when_sending_stopped']} when sending "
             f"stopped; all answered at {ld['all_answered_s']} s"]
    head = ("phase", "window s", "requests", *RESULTS, "p50 s", "p99 s")
    lines.append(" | ".join(head))
    for row in r["table"]:
        lines.append(" | ".join(str(row[k]) for k in (
            "phase", "window_s", "requests", *RESULTS, "latency_p50_s", "latency_p99_s")))
    for p in r["phases"]:
        lines.append(f"{p['name']}: router {p['router']}")
        lines += [f"  {e}" for e in p["events"]]
    lines.append(f"whole by kind: {r['whole_by_kind']}")
    lines += [f"  not whole: {n} x {cause}" for cause, n in r["not_whole_by_cause"].items()]
    lines.append(f"pools at the end: {r['pools']}; supervisor restarts {r['restarts']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rolling_restart.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    fault_stack.add_worker_flags(p)
    p.add_argument("--rate", type=float, default=50.0, help="requests sent per second")
    p.add_argument("--min-tokens", type=int, default=128, help="tokens a request, at least")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens a request, at most")
    p.add_argument("--max-prompt", type=int, default=16, help="prompt tokens, at most")
    p.add_argument("--shapes", type=int, default=24, help="distinct prompts + parameters")
    p.add_argument("--http-share", type=float, default=0.25,
                   help="share of the shapes sent over the OpenAI HTTP API")
    p.add_argument("--phases", type=lambda s: s.split(","), default=["rolling", "prefill"],
                   help="comma-separated, among rolling,prefill")
    p.add_argument("--warmup", type=float, default=10.0,
                   help="seconds of load before the first phase")
    p.add_argument("--settle", type=float, default=5.0, help="seconds between the phases")
    p.add_argument("--tail", type=float, default=5.0,
                   help="seconds of load after the last phase")
    p.add_argument("--max-duration", type=float, default=300.0,
                   help="seconds of sending, at most")
    p.add_argument("--max-requests", type=int, default=20_000)
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="a request with no answer by then counts as failed")
    p.add_argument("--grace", type=float, default=60.0, help="the workers' drain --grace")
    p.add_argument("--lease-ttl", type=float, default=5.0, help="prefill workers' --lease-ttl")
    p.add_argument("--worker-timeout", type=float, default=2.0, help="router --worker-timeout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if set(a.phases) - {"rolling", "prefill"} or a.rate <= 0 or \
            not 0 < a.min_tokens <= a.max_tokens:
        raise SystemExit("rolling_restart.py: --phases among rolling,prefill; --rate > 0; "
                         "0 < --min-tokens <= --max-tokens")
    a.duration = a.max_duration  # run_supervised's bound (3 x --duration when unset)
    r = fault_stack.run_supervised(a, "rolling_restart", a.grace,
                                   lambda stack: Rolling(a, stack).run())
    print(report(r, a), flush=True)
    if a.out:
        a.out.write_text(json.dumps(r, indent=2))
    leaked = sum(sum(p.values()) for p in r["pools"].values())
    bad = sum(r["table"][-1][k] for k in RESULTS if k != "whole")
    return 1 if bad or leaked or r["supervisor_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
