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
import os
import random
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "protos", ROOT):
    sys.path.insert(0, str(_p))

import grpc  # noqa: E402
import httpx  # noqa: E402

from benchmarks.robustness.soak_report import metric_total  # noqa: E402
from tandem.cli.launcher import LocalStack  # noqa: E402
from tandem.cli.supervisor import RestartPolicy, Supervisor  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.runtime.convert import params_to_proto  # noqa: E402
from tandem.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402

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
            proc = self.stack.procs[name]
            at = time.monotonic() - t0
            self.faults.append({"kind": kind, "worker": name, "at_s": round(at, 1)})
            print(f"chaos: {at:7.1f} s  {kind} {name}", flush=True)
            if kind == "hang":
                os.kill(proc.popen.pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(a.hang)
                finally:
                    os.kill(proc.popen.pid, signal.SIGCONT)
            else:
                if kind == "kill":
                    os.kill(proc.popen.pid, signal.SIGKILL)
                else:
                    async with grpc.aio.insecure_channel(proc.address) as ch:
                        r = await worker_pb2_grpc.WorkerStub(ch).Drain(
                            worker_pb2.DrainRequest(), timeout=120)
                    self.faults[-1]["drain"] = {"moved": r.moved, "finished": r.finished,
                                                "left": r.left}
                # Until the supervisor's restart of it is up.
                while self.stack.procs[name] is proc or \
                        not self.stack.procs[name].ready_file.exists():
                    await asyncio.sleep(0.2)
            await self.whole()
            self.recovered += 1
            await asyncio.sleep(a.fault_interval * self.rng.uniform(0.7, 1.3))

    async def whole(self, timeout: float = 300.0) -> None:
        """Until the router routes to every worker (its /workers)."""
        deadline = time.monotonic() + timeout
        while not (await self.http.get("/workers")).json()["all_up"]:
            if time.monotonic() > deadline:
                raise SystemExit("chaos: the stack did not come back")
            await asyncio.sleep(0.2)

    async def pools(self, timeout: float) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        out = {}
        for p in self.stack.workers():
            async with grpc.aio.insecure_channel(p.address) as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)
                while True:
                    ld = await stub.GetLoad(worker_pb2.GetLoadRequest(), wait_for_ready=True,
                                            timeout=max(10.0, deadline - time.monotonic()))
                    used = ld.num_blocks - ld.num_free_blocks
                    if not (used or ld.num_leases or ld.num_running or ld.num_waiting) or \
                            time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.2)
            out[p.name] = {"blocks_in_use": used, "leases": ld.num_leases,
                           "running": ld.num_running, "waiting": ld.num_waiting}
        return out

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
            await self.whole()
            pools = await self.pools(timeout=a.lease_ttl + 30)
            metrics = (await http.get("/metrics")).text
        return {"elapsed_s": round(elapsed, 1), "requests": sent, "ok": self.ok,
                "lost": self.lost, "faults": self.faults, "pools": pools,
                "router": {m: metric_total(metrics, m) for m in
                           ("request_migrations", "prefill_fallbacks", "worker_restarts",
                            "worker_lost")}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chaos.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tandem-demo")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-duration", type=float, default=None,
                   help="hard bound on the load's seconds (default: 3 x --duration)")
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--min-faults", type=int, default=3,
                   help="go on past --duration until this many faults happened")
    p.add_argument("--faults", type=lambda s: s.split(","), default=list(FAULTS),
                   help=f"comma-separated, among {','.join(FAULTS)}")
    p.add_argument("--concurrency", type=int, default=6, help="requests in flight")
    p.add_argument("--shapes", type=int, default=8, help="distinct prompts + parameters")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens a sample")
    p.add_argument("--first-fault", type=float, default=3.0, help="seconds into the load")
    p.add_argument("--fault-interval", type=float, default=5.0,
                   help="seconds between a fault's recovery and the next")
    p.add_argument("--hang", type=float, default=4.0, help="seconds a worker stays SIGSTOPped")
    p.add_argument("--lease-ttl", type=float, default=5.0, help="prefill workers' --lease-ttl")
    p.add_argument("--worker-timeout", type=float, default=2.0, help="router --worker-timeout")
    p.add_argument("--request-timeout", type=float, default=180.0,
                   help="a request slower than this counts as lost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    bad = set(a.faults) - set(FAULTS)
    if bad:
        raise SystemExit(f"chaos.py: --faults: unknown {', '.join(sorted(bad))}")
    a.max_duration = a.max_duration or 3 * a.duration
    roles = ["prefill"] * a.prefill_workers + ["decode"] * a.decode_workers
    stack = LocalStack(a.model, roles, ["cpu"] * len(roles),
                       worker_args=["--num-blocks", "512", "--max-num-batched-tokens", "128"],
                       role_args={"prefill": ["--lease-ttl", str(a.lease_ttl)]},
                       router_args=["--grpc-port", "0", "--http-port", "0", "--dtype",
                                    "float32", "--worker-timeout", str(a.worker_timeout)],
                       log_dir=a.log_dir, grace=30.0)
    try:
        stack.start()
        supervisor = Supervisor(stack, RestartPolicy(max_restarts=10, window_s=60),
                                say=lambda m: print(f"chaos: supervisor: {m}", flush=True)
                                ).start()
        r = asyncio.run(Chaos(a, stack).run())
        r["restarts"] = {k: v for k, v in supervisor.restarts.items() if v}
        r["supervisor_failed"] = supervisor.failed
    finally:
        codes = stack.stop()
    r.update(exit_codes=codes, args={k: str(v) for k, v in vars(a).items()},
             cores=len(os.sched_getaffinity(0)), log_dir=str(stack.log_dir))
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
