"""How long a router keeps its other clients waiting while it refuses hostile input.

A router with one prefill and one decode worker on the CPU (loopback, the tandem-demo model, an
API key on both public ports), then one hostile case at a time, and all along a prober: every
50 ms, in turn, GET /v1/models, gRPC ListModels and a 4-token greedy completion, each timed from
sending to its answer. Reported per case: the hostile request's answer and how long it took,
and the probes' latency while it was in flight (max, p99, count), beside the same probes with
nothing hostile in flight.

    python benchmarks/robustness/hostile_router.py                     # every case
    python benchmarks/robustness/hostile_router.py --cases ids schema --router-arg=--grammar-budget=2

Cases (sizes as the security review sent them):
    nope_array   POST /nope, an 8.4 MB JSON array of 4.19M zeros, no key
    ids          POST /v1/completions with the key, 1.5M token ids
    keys         POST /v1/completions with the key, logit_bias of 600k keys
    schema       POST /v1/completions with the key, a 55 KB JSON schema (1,000 properties,
                 pattern [a-z]{1,300}): a grammar that takes minutes to build
    tools        POST /v1/chat/completions with the key, 5,000 tools
    grpc_ids     gRPC Generate with the key, 1M token ids
    slow_bodies  50 connections, each sending the headers and 10 of its 1,000 body bytes;
                 timed until the router has closed all of them (--http-read-timeout)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "protos", ROOT):
    sys.path.insert(0, str(_p))

import grpc  # noqa: E402
import httpx  # noqa: E402

from benchmarks.lib.common import percentile  # noqa: E402
from tandem.cli.launcher import LocalStack  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.runtime.convert import params_to_proto  # noqa: E402
from tandem.v1 import api_pb2, api_pb2_grpc  # noqa: E402

KEY = "hostile-router-benchmark-key"
AUTH = {"authorization": f"Bearer {KEY}"}
PROBE_EVERY_S = 0.05


def _bomb() -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string",
                                                        "pattern": "[a-z]{1,300}"}
                                             for i in range(1000)}}


@functools.cache
def http_cases() -> dict[str, tuple[str, bytes, dict]]:
    """name: (path, body, headers)."""
    def body(obj: dict) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()
    schema = {"type": "json_schema", "json_schema": {"name": "bomb", "schema": _bomb()}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}} for i in range(5000)]
    return {
        "nope_array": ("/nope", b"[" + b",".join([b"0"] * 4_190_000) + b"]", {}),
        "ids": ("/v1/completions", body({"prompt": [0] * 1_500_000, "max_tokens": 4}), AUTH),
        "keys": ("/v1/completions", body({"prompt": [1], "max_tokens": 4, "logit_bias": {
            str(i): 0 for i in range(600_000)}}), AUTH),
        "schema": ("/v1/completions", body({"prompt": [1, 2, 3], "max_tokens": 4,
                                            "response_format": schema}), AUTH),
        "tools": ("/v1/chat/completions", body({"messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 4, "tools": tools}), AUTH),
    }


CASES = [*http_cases(), "grpc_ids", "slow_bodies"]


class Prober:
    """Every PROBE_EVERY_S: one of GET /v1/models, gRPC ListModels, a 4-token completion, in
    turn; each answer's latency is kept with the time it was sent."""

    def __init__(self, base: str, grpc_address: str) -> None:
        self.base = base
        self.grpc_address = grpc_address
        self.samples: list[tuple[float, float, str]] = []  # (sent, latency, kind)
        self.failures: list[str] = []

    async def run(self, stop: asyncio.Event) -> None:
        greedy = params_to_proto(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        async with httpx.AsyncClient(base_url=self.base, timeout=300) as http, \
                grpc.aio.insecure_channel(self.grpc_address) as ch:
            stub = api_pb2_grpc.TandemStub(ch)
            md = tuple(AUTH.items())
            probes = [
                ("http_models", lambda: http.get("/v1/models", headers=AUTH)),
                ("grpc_models", lambda: stub.ListModels(api_pb2.ListModelsRequest(),
                                                        metadata=md, timeout=300)),
                ("completion", lambda: _complete(stub, greedy, md)),
            ]
            i = 0
            while not stop.is_set():
                kind, probe = probes[i % len(probes)]
                i += 1
                sent = time.monotonic()
                try:
                    r = await probe()
                    if isinstance(r, httpx.Response) and r.status_code != 200:
                        self.failures.append(f"{kind}: {r.status_code}")
                except Exception as e:  # noqa: BLE001 - counted, the run goes on
                    self.failures.append(f"{kind}: {type(e).__name__}")
                self.samples.append((sent, time.monotonic() - sent, kind))
                await asyncio.sleep(PROBE_EVERY_S)

    def next_after(self, t: float) -> list[float]:
        """The latency of the first probe sent after `t` (a case shorter than the probing
        interval overlaps none): what a client arriving just then waited."""
        later = [lat for sent, lat, _ in self.samples if sent >= t]
        return later[:1]

    def between(self, start: float, end: float) -> list[float]:
        """Latencies of the probes sent while [start, end) lasted or answered within it."""
        return [lat for sent, lat, _ in self.samples if sent < end and sent + lat >= start]


async def _complete(stub, params, md) -> None:
    async for _ in stub.Generate(api_pb2.GenerateRequest(
            token_ids=api_pb2.TokenIds(ids=[5, 6, 7]), params=params), metadata=md, timeout=300):
        pass


async def hostile_http(base: str, path: str, body: bytes, headers: dict) -> str:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        r = await client.post(path, content=body,
                              headers={**headers, "content-type": "application/json"})
    try:
        param = r.json().get("error", {}).get("param")
    except ValueError:
        param = None
    return f"{r.status_code}" + (f" {param}" if param else "")


async def hostile_grpc_ids(address: str) -> str:
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[0] * 1_000_000),
                                  params=params_to_proto(SamplingParams(max_tokens=4)))
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            async for _ in api_pb2_grpc.TandemStub(ch).Generate(
                    req, metadata=tuple(AUTH.items()), timeout=600):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code().name
    return "OK"


async def slow_bodies(port: int, n: int = 50) -> str:
    """n connections each send their headers and 10 of 1,000 body bytes, then wait."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n")

    async def one() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + b'{"prompt":')
        await writer.drain()
        answer = await reader.read()  # until the router closes the connection
        writer.close()
        return answer

    answers = await asyncio.gather(*(one() for _ in range(n)))
    codes = {a.split(b" ", 2)[1].decode() if a.startswith(b"HTTP/") else "closed"
             for a in answers}
    return f"{n} closed ({', '.join(sorted(codes))})"


async def run_case(name: str, stack: LocalStack, prober: Prober) -> dict:
    base = f"http://127.0.0.1:{stack.router.http_port}"
    if name in http_cases():
        path, body, headers = http_cases()[name]
        work = hostile_http(base, path, body, headers)
    elif name == "grpc_ids":
        work = hostile_grpc_ids(stack.router.address)
    else:
        work = slow_bodies(stack.router.http_port)
    start = time.monotonic()
    answer = await work
    end = time.monotonic()
    await asyncio.sleep(0.5)  # probes sent just before the end have answered
    lat = prober.between(start, end) or prober.next_after(end)
    return {"case": name, "answer": answer, "seconds": round(end - start, 3),
            "probes": len(lat), "probe_max_s": round(max(lat), 3) if lat else None,
            "probe_p99_s": round(percentile(lat, 99), 3) if lat else None}


async def warm(base: str) -> None:
    """One request with a small schema: the router's schema checker (a process started on the
    first schema) is up before anything is timed."""
    schema = {"type": "json_schema", "json_schema": {"name": "small", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await client.post("/v1/completions", headers=AUTH, json={
            "prompt": [1, 2, 3], "max_tokens": 2, "response_format": schema})


async def measure(stack: LocalStack, cases: list[str], quiet_s: float) -> list[dict]:
    await warm(f"http://127.0.0.1:{stack.router.http_port}")
    prober = Prober(f"http://127.0.0.1:{stack.router.http_port}", stack.router.address)
    stop = asyncio.Event()
    probing = asyncio.create_task(prober.run(stop))
    await asyncio.sleep(quiet_s)  # the baseline: nothing hostile in flight
    t0 = prober.samples[0][0] if prober.samples else time.monotonic()
    quiet = prober.between(t0, time.monotonic())
    rows = [{"case": "(none)", "answer": "", "seconds": None, "probes": len(quiet),
             "probe_max_s": round(max(quiet), 3), "probe_p99_s": round(percentile(quiet, 99), 3)}]
    for name in cases:
        rows.append(await run_case(name, stack, prober))
        print(rows[-1], flush=True)
    stop.set()
    await probing
    if prober.failures:
        print(f"probe failures: {prober.failures[:10]} ({len(prober.failures)})")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", choices=CASES, default=CASES)
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra router flag, e.g. --router-arg=--grammar-budget=2 (repeatable)")
    p.add_argument("--quiet", type=float, default=5.0,
                   help="seconds of probing with nothing hostile in flight first")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        stack = LocalStack("tandem-demo", ["prefill", "decode"], ["cpu", "cpu"],
                           router_args=["--grpc-port", "0", "--http-port", "0",
                                        *args.router_arg],
                           log_dir=tmp, env={"TANDEM_API_KEY": KEY})
        stack.start()
        try:
            rows = asyncio.run(measure(stack, args.cases, args.quiet))
        finally:
            stack.stop()
    print(f"\n{'case':<12} {'answer':<24} {'time s':>8} {'probes':>7} {'max s':>7} {'p99 s':>7}")
    for r in rows:
        print(f"{r['case']:<12} {r['answer']:<24} {r['seconds'] or '':>8} {r['probes']:>7} "
              f"{r['probe_max_s'] or '-':>7} {r['probe_p99_s'] or '-':>7}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
