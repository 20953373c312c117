"""What the lease claim costs a request: the decode worker's ClaimLease call to the prefill
worker, once per request before its KV pull, against Release, which waits for the prefill
engine core's next step boundary.

A prefill worker of a local stack (`tandem up`'s LocalStack, 1 prefill + 1 decode on the CPU by
default) gets, from this process on 127.0.0.1: a Prefill (a lease), a timed ClaimLease, a timed
Release; repeated, first with the prefill worker otherwise idle, then while other clients keep
its engine core busy with long prompts. Client-side wall-clock times: the gRPC round trip
included, as the decode worker pays it.

    python benchmarks/transfer/lease_claim.py --out lease_claim.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from tandem.cli.launcher import LocalStack
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import worker_pb2, worker_pb2_grpc


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default="tandem-demo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=200, help="timed claims per condition")
    p.add_argument("--prompt-tokens", type=int, default=40, help="of each timed lease")
    p.add_argument("--load-clients", type=int, default=3,
                   help="clients prefilling long prompts during the busy condition")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    return p.parse_args()


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def measure(address: str, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=4))
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)

        async def one(rid: str, seed: int) -> tuple[float, float]:
            prompt = [(seed * 7 + j) % 200 + 1 for j in range(args.prompt_tokens)]
            resp = await stub.Prefill(worker_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, params=params))
            t0 = time.perf_counter()
            await stub.ClaimLease(worker_pb2.ClaimLeaseRequest(lease_id=resp.kv.lease_id))
            t1 = time.perf_counter()
            await stub.Release(worker_pb2.ReleaseRequest(lease_id=resp.kv.lease_id))
            return t1 - t0, time.perf_counter() - t1

        async def series(tag: str) -> dict[str, list[float]]:
            times = [await one(f"{tag}{i}", i) for i in range(args.requests)]
            return {"claim_ms": [c * 1e3 for c, _ in times],
                    "release_ms": [r * 1e3 for _, r in times]}

        for i in range(5):  # warm-up
            await one(f"warm{i}", i)
        out = {"idle": await series("idle")}
        stop = asyncio.Event()

        async def load(k: int) -> None:
            n = 0
            while not stop.is_set():
                prompt = [(k * 13 + j) % 200 + 1 for j in range(900)]
                resp = await stub.Prefill(worker_pb2.PrefillRequest(
                    request_id=f"load{k}-{n}", prompt_token_ids=prompt, params=params))
                await stub.Release(worker_pb2.ReleaseRequest(lease_id=resp.kv.lease_id))
                n += 1

        loaders = [asyncio.create_task(load(k)) for k in range(args.load_clients)]
        await asyncio.sleep(1.0)  # the core is busy by now
        out["prefill core busy"] = await series("busy")
        stop.set()
        await asyncio.gather(*loaders)
    return out


def main() -> None:
    args = parse_args()
    stack = LocalStack(args.model, ["prefill", "decode"], [args.device] * 2,
                       worker_args=["--num-blocks", "1024", "--max-num-batched-tokens", "512"],
                       router_args=["--http-port", "-1"])
    stack.start()
    try:
        figures = asyncio.run(measure(stack.workers("prefill")[0].address, args))
    finally:
        stack.stop()
    print(f"{'condition':18s} {'call':10s} {'p50 ms':>8s} {'p90 ms':>8s} {'p99 ms':>8s}")
    for cond, series in figures.items():
        for name, xs in (("ClaimLease", series["claim_ms"]), ("Release", series["release_ms"])):
            print(f"{cond:18s} {name:10s} {statistics.median(xs):8.2f} {quantile(xs, .9):8.2f} "
                  f"{quantile(xs, .99):8.2f}")
    if args.out:
        args.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                        "device": args.device, "args": vars(args) | {"out": None},
                                        "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
