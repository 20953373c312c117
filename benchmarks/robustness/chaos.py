"""Chaos probe: a supervised stack (router, prefill and decode workers on the CPU, restarted when
they exit) under steady load while, one at a time, a random worker is killed (SIGKILL), hung
(SIGSTOP, then SIGCONT a few seconds later) or drained (each kind in turn; the Drain RPC, as
`tandem drain` and Kubernetes' preStop hook call it). Loopback only; bounded in time
(--duration, at most --max-duration) and count (--max-requests).

    python benchmarks/robustness/chaos.py --duration 600 --out chaos.json
    python benchmarks/robustness/chaos.py --duration 30 --min-faults 3    # the CI version's size

Unlike benchmarks/robustness/soak.py, which accepts clear errors (503, 429), this probe counts
every request that does not finish whole as lost: with prefill fallback, moves on failure and
drains that move requests, none should be. The requests are greedy and seeded (n = 1 and 2),
each shape run once before any fault: a later run must give exactly that output. At the end,
with every worker back: each pool's blocks in use, leases and requests (all 0 when nothing
leaked). Exit code 1 when a request was lost or something leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
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

FAULTS = ("kill", "hang", "drain")


def make_shapes(rng: random.Random, count: int, max_tokens: int
                ) -> list[tuple[list[int], SamplingParams]]:
    shapes = []
    for i in range(count):
        prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(4, 120))]
        seeded = i % 2 == 1
        shapes.append((prompt, SamplingParams(
            n=1 + (i % 4 == 3), temperature=0.9 if seeded else 0.0, seed=i if seeded else None,
            max_tokens=max_tokens, ignore_eos=True)))
    return shapes


class Chaos:
    def __init__(self, a: argparse.Namespace, stack: LocalStack) -> None:
        self.a, self.stack = a, stack
        self.rng = random.Random(a.seed)
        self.shapes = make_shapes(self.rng, a.shapes, a.max_tokens)
        self.expected: list[list[list[int]]] = []
        self.faults: list[dict] = []
        self.lost: list[dict] = []
        self.ok = 0
        self.recovered = 0  # faults the stack is whole again after

    async def generate(self, i: int) -> list[list[int]]:
        prompt, params = self.shapes[i]
        req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                      params=params_to_proto(params))
        out: list[list[int]] = [[] for _ in range(params.n)]
        async for chunk in self.stub.Generate(req, timeout=self.a.request_timeout):
            out[chunk.index] += chunk.token_ids
        return out

    async def load(self) -> int:
        """`concurrency` clients until the time or count runs out (past --duration until the
        stack recovered from --min-faults faults, up to --max-duration)."""
        a, sent = self.a, 0
        t0 = time.monotonic()

        def more() -> bool:
            now = time.monotonic() - t0
            return sent < a.max_requests and now < a.max_duration and (
                now < a.duration or self.recovered < a.min_faults)

        async def client() -> None:
            nonlocal sent
            while more():
                sent += 1
                i = self.rng.randrange(len(self.shapes))
                try:
                    got = await self.generate(i)
                except grpc.aio.AioRpcError as e:
                    self.lost.append({"shape": i, "error": e.code().name,
                                      "detail": (e.details() or "")[:200]})
                    continue
                if got != self.expected[i]:
                    self.lost.append({"shape": i, "error": "different output"})
                else:
                    self.ok += 1

        await asyncio.gather(*(client() for _ in range(a.concurrency)))
        return sent

    async def inject(self, t0: float) -> None:
        """Faults on random workers, once the stack is whole again, about --fault-interval
        apart: every kind asked for in turn, in an order drawn at random."""
        a = self.a
        kinds = list(a.faults)
        self.rng.shuffle(kinds)
        await asyncio.sleep(a.first_fault)
        while True:
            kind = kinds[len(self.faults) % len(kinds)]
            name = self.rng.choice([p.name for p in self.stack.workers()])
            at = time.monotonic() - t0
            self.faults.append({"kind": kind, "worker": name, "at_s": round(at, 1)})
            print(f"chaos: {at:7.1f} s  {kind} {name}", flush=True)
            drained = await fault_stack.inject(self.stack, kind, name, a.hang)
            if drained:
                self.faults[-1]["drain"] = drained
            await fault_stack.whole(self.http, "chaos")
            self.recovered += 1
            await asyncio.sleep(a.fault_interval * self.rng.uniform(0.7, 1.3))

    async def run(self) -> dict:
        a = self.a
        async with grpc.aio.insecure_channel(self.stack.router.address) as ch, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.stack.router.http_port}",
                                  timeout=30) as http:
            self.stub, self.http = api_pb2_grpc.TandemStub(ch), http
            self.expected = await asyncio.gather(*(self.generate(i)
                                                   for i in range(len(self.shapes))))
            t0 = time.monotonic()
            faults = asyncio.create_task(self.inject(t0))
            try:
                sent = await self.load()
            finally:
                faults.cancel()
                await asyncio.gather(faults, return_exceptions=True)
            elapsed = time.monotonic() - t0
            await fault_stack.whole(http, "chaos")
            pools = await fault_stack.pools(self.stack, timeout=a.lease_ttl + 30)
            metrics = (await http.get("/metrics")).text
        return {"elapsed_s": round(elapsed, 1), "requests": sent, "ok": self.ok,
                "lost": self.lost, "faults": self.faults, "pools": pools,
                "router": {m: metric_total(metrics, m) for m in
                           ("request_migrations", "prefill_fallbacks", "worker_restarts",
                            "worker_lost")}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chaos.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    fault_stack.add_stack_flags(p, concurrency=6, shapes=8, min_faults=3, fault_interval=5.0)
    p.add_argument("--faults", type=lambda s: s.split(","), default=list(FAULTS),
                   help=f"comma-separated, among {','.join(FAULTS)}")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens a sample")
    p.add_argument("--request-timeout", type=float, default=180.0,
                   help="a request slower than this counts as lost")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    bad = set(a.faults) - set(FAULTS)
    if bad:
        raise SystemExit(f"chaos.py: --faults: unknown {', '.join(sorted(bad))}")
    r = fault_stack.run_supervised(a, "chaos", 30.0, lambda stack: Chaos(a, stack).run())
    leaked = sum(sum(p.values()) for p in r["pools"].values())
    print(f"chaos: {r['requests']} requests in {r['elapsed_s']} s, {r['ok']} whole, "
          f"{len(r['lost'])} lost; faults: "
          + ", ".join(f"{f['kind']} {f['worker']}" for f in r["faults"])
          + f"; router: {r['router']}; blocks, leases and requests left: {leaked}", flush=True)
    if a.out:
        a.out.write_text(json.dumps(r, indent=2))
    return 1 if r["lost"] or leaked or r["supervisor_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
