"""Where a role change's time goes: an elastic 1P+2D stack on the CPU (loopback, cluster TLS, as
`tandem up --elastic` runs it), clients sending short requests all along and long streams on
the worker to change, and `Supervisor.convert` turning one worker decode -> prefill -> decode ...
`--changes` times. Each change is split into its steps, from the supervisor's own marks
(cli/supervisor.py Conversion) and the router's /workers:

    drain    asked -> the worker's drain answered (its requests moved or finished)
    exit     drain answered -> the process gone                (restart only)
    start    exited -> the new process ready, in the file       (restart only)
    switch   drained -> serving its new role on its new port, in the file (in place only)
      (in worker)  the same, as the worker measured it (its SwitchRole answer)
    routed   in the workers file -> the router lists it up

    python benchmarks/robustness/role_change.py --changes 4
    python benchmarks/robustness/role_change.py --changes 4 --restart   # the restart path

Requests that failed are counted (there should be none); --out writes every change as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "protos", ROOT):
    sys.path.insert(0, str(_p))

import grpc  # noqa: E402
import httpx  # noqa: E402

from tandem.cli.launcher import LocalStack  # noqa: E402
from tandem.cli.supervisor import Conversion, Supervisor  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.runtime.convert import params_to_proto  # noqa: E402
from tandem.v1 import api_pb2, api_pb2_grpc  # noqa: E402

SHORT = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
STEPS = ("drain", "exit", "start", "switch", "(in worker)", "routed", "total")


def steps(c: Conversion, routed_at: float) -> dict[str, float | None]:
    """A change's steps in seconds (None: a step its path does not have)."""
    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    in_place = c.exited_at is None
    return {"drain": span(c.asked_at, c.drained_at),
            "exit": None if in_place else span(c.drained_at, c.exited_at),
            "start": None if in_place else span(c.exited_at, c.ready_at),
            "switch": span(c.drained_at, c.ready_at) if in_place else None,
            "(in worker)": c.switch_seconds,
            "routed": span(c.ready_at, routed_at), "total": span(c.asked_at, routed_at)}


async def _generate(stub, prompt: list[int], params: SamplingParams) -> int:
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                  params=params_to_proto(params))
    return sum([len(chunk.token_ids) async for chunk in stub.Generate(req)])


async def _client(stub, k: int, done: asyncio.Event, tally: dict[str, int]) -> None:
    i = 0
    while not done.is_set():
        prompt = [(13 * k + 5 * j + i) % 250 + 1 for j in range(8 + i % 5)]
        try:
            await _generate(stub, prompt, SHORT)
            tally["ok"] += 1
        except grpc.aio.AioRpcError as e:
            tally["failed"] += 1
            print(f"  request failed: {e.code().name}: {e.details()}", flush=True)
        i += 1


async def _routed(h: httpx.AsyncClient, address: str, role: str) -> float:
    """When the router first lists `address` as an up worker of `role`."""
    while True:
        workers = (await h.get("/workers")).json()["workers"]
        if any(w["address"] == address and w["role"] == role and w["state"] == "up"
               and not w["draining"] for w in workers):
            return time.monotonic()
        await asyncio.sleep(0.02)


async def run_changes(stack: LocalStack, sup: Supervisor, changes: int,
                      clients: int) -> tuple[list[dict], dict[str, int]]:
    host = stack.router.address.rsplit(":", 1)[0]
    rows: list[dict] = []
    tally = {"ok": 0, "failed": 0}
    async with grpc.aio.insecure_channel(stack.router.address) as ch, \
            httpx.AsyncClient(base_url=f"http://{host}:{stack.router.http_port}") as h:
        stub = api_pb2_grpc.TandemStub(ch)
        done = asyncio.Event()
        load = [asyncio.create_task(_client(stub, k, done, tally)) for k in range(clients)]
        name, role = "decode1", "prefill"
        for i in range(changes):
            # Long streams, some of them on the worker to change when it is a decode worker.
            longs = [asyncio.create_task(_generate(stub, [i + 3, k + 1, 7] * 3, LONG))
                     for k in range(2)]
            await asyncio.sleep(1.0)
            sup.convert(name, role, reason="benchmark")
            (*_, c) = await asyncio.to_thread(sup.wait_converted, i + 1, 600)
            if c.failed:
                raise RuntimeError(f"role change {name} -> {role} failed: {c.failed}")
            routed_at = await _routed(h, c.address, c.role)
            row = {"worker": c.name, "became": c.new_name, "moved": c.moved,
                   "finished": c.finished, "left": c.left,
                   "path": "restart" if c.exited_at is not None else "in place",
                   **steps(c, routed_at)}
            rows.append(row)
            print("  " + "  ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
            tally["ok"] += sum(await asyncio.gather(*longs)) > 0
            name, role = c.new_name, c.name.rstrip("0123456789")
        done.set()
        await asyncio.gather(*load)
    return rows, tally


def _fmt(v: object) -> str:
    return f"{v:.3f}" if isinstance(v, float) else "-" if v is None else str(v)


def table(rows: list[dict]) -> str:
    head = f"{'step':<12}" + "".join(f"{'change ' + str(i + 1):>10}" for i in range(len(rows)))
    lines = [head + f"{'median':>10}"]
    for step in STEPS:
        vals = [r[step] for r in rows]
        known = [v for v in vals if v is not None]
        med = statistics.median(known) if known else None
        lines.append(f"{step:<12}" + "".join(f"{_fmt(v):>10}" for v in vals) + f"{_fmt(med):>10}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tandem-demo")
    p.add_argument("--changes", type=int, default=4, help="role changes, back and forth")
    p.add_argument("--clients", type=int, default=2, help="clients sending short requests")
    p.add_argument("--restart", action="store_true",
                   help="change roles by restarting the worker (no change in place)")
    p.add_argument("--out", type=Path, default=None, help="write the changes here as JSON")
    p.add_argument("--device", default="cpu", help="every worker's (cuda:0: one GPU shared)")
    p.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                   help="a flag for every worker, after the defaults (e.g. "
                        "--worker-arg=--load-format=dummy)")
    a = p.parse_args()
    worker_args = ["--num-blocks", "256", "--max-num-batched-tokens", "64", *a.worker_arg]
    stack = LocalStack(a.model, ["prefill", "decode", "decode"], [a.device] * 3,
                       worker_args=worker_args, router_args=["--grpc-port", "0",
                                                             "--http-port", "0"],
                       log_dir=tempfile.mkdtemp(prefix="tandem-role-change-"),
                       cluster_ca=True, elastic=True)
    print(f"starting an elastic 1P+2D stack of {a.model} on {a.device} "
          f"({platform.processor() or platform.machine()}); logs in {stack.log_dir}", flush=True)
    stack.start()
    say = lambda m: print(f"  supervisor: {m}", flush=True)  # noqa: E731
    sup = Supervisor(stack, say=say, in_place=not a.restart).start(0.2)
    try:
        rows, tally = asyncio.run(run_changes(stack, sup, a.changes, a.clients))
    finally:
        codes = stack.stop()
    print(f"\nrole changes ({'by restart' if a.restart else 'in place'}), seconds:")
    print(table(rows))
    print(f"requests: {tally['ok']} ok, {tally['failed']} failed; exit codes {codes}")
    if a.out is not None:
        a.out.write_text(json.dumps({"restart": a.restart, "changes": rows, **tally}, indent=1))
    return 0 if tally["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
