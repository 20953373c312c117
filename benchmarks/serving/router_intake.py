"""What the router costs per token, and how fast it takes new calls while it streams, with no
engine behind it: a synthetic worker (this script, `--serve-worker`) answers the router's Stream
call with one token per running request every engine step (a fixed step time plus a time per
running request, as a decode step of a large model), so the router and its clients are the only
real work. All requests are sent at once, as serve.py's bursts are.

    python benchmarks/serving/router_intake.py --num-requests 1000 --output-len 200

Prints, and writes with --out: output tokens/s, the router's CPU microseconds per output token,
and the intake: when each call reached the worker after its client sent it (p50, p90, max), the
moment the last one did, and TTFT. On a GPU, the 8B config's decode step at batch ~250 is about
10 ms (BENCHMARKS); the defaults stand for that. `--router-arg=--flag` passes flags to the router.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from benchmarks.lib.common import dist, fmt  # noqa: E402
from benchmarks.lib.procstat import process_cpu_s  # noqa: E402
from benchmarks.lib.workloads import Request  # noqa: E402
from benchmarks.serving.serve_client import LoadOptions, send_all  # noqa: E402
from tandem.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402


# -- the synthetic worker -------------------------------------------------------------------------
class StepWorker(worker_pb2_grpc.WorkerServicer):
    """Role both. Every step, each running request of a Stream call gets one token (ids drawn
    from the vocabulary's upper part, so the router detokenizes real text); the last one ends
    it ("length"). Records when each request arrived (time.monotonic(): this host's clock)."""

    def __init__(self, step_s: float, per_request_s: float, vocab: int) -> None:
        self.step_s, self.per_request_s, self.vocab = step_s, per_request_s, vocab
        self.instance = uuid.uuid4().hex
        self.arrived: dict[str, float] = {}
        self.running = 0

    async def GetLoad(self, request, context):  # noqa: N802 - gRPC method name
        return worker_pb2.Load(worker_id="step-worker", role="both", block_size=16,
                               dtype="float32", instance_id=self.instance, num_blocks=1 << 20,
                               num_free_blocks=1 << 20, num_running=self.running,
                               step_seconds=self.step_s)

    async def WatchKV(self, request, context):  # noqa: N802 - no prefix cache here
        await asyncio.Event().wait()
        yield worker_pb2.WatchKVResponse()

    async def Stream(self, requests, context):  # noqa: N802
        mine: dict[str, list[int]] = {}  # request id -> [tokens left, prompt length]

        async def read() -> None:
            async for req in requests:
                kind = req.WhichOneof("kind")
                if kind == "generate":
                    g = req.generate
                    self.arrived[g.request_id] = time.monotonic()
                    mine[g.request_id] = [max(1, g.params.max_tokens), len(g.prompt_token_ids)]
                elif kind == "cancel":
                    mine.pop(req.cancel, None)

        reader = asyncio.create_task(read())
        rng = random.Random(0)
        lo = self.vocab // 4
        try:
            while not reader.done() or mine:
                t0 = time.monotonic()
                if mine:
                    self.running = len(mine)
                    rids = list(mine)
                    cols = worker_pb2.TokenColumns(
                        request_id=rids, sample_index=[0] * len(rids), num_tokens=[1] * len(rids),
                        token_ids=[rng.randrange(lo, self.vocab) for _ in rids],
                        num_prompt_tokens=[mine[r][1] for r in rids],
                        num_cached_tokens=[0] * len(rids), with_logprobs=[False] * len(rids))
                    ended = []
                    for r in rids:
                        mine[r][0] -= 1
                        if mine[r][0] == 0:
                            ended.append(r)
                            del mine[r]
                    cols.finish_reason.extend("length" if r in ended else "" for r in rids)
                    yield worker_pb2.StreamResponse(tokens=cols, updates=[
                        worker_pb2.RequestUpdate(request_id=r, done=True) for r in ended])
                    pace = self.step_s + self.per_request_s * len(rids)
                else:
                    pace = self.step_s
                await asyncio.sleep(max(0.0, pace - (time.monotonic() - t0)))
        finally:
            reader.cancel()


async def serve_worker(a: argparse.Namespace) -> None:
    worker = StepWorker(a.step_ms / 1e3, a.per_request_us / 1e6, a.vocab)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(port, flush=True)
    await stop.wait()
    Path(a.arrivals).write_text(json.dumps(worker.arrived))
    await server.stop(0)


# -- the run --------------------------------------------------------------------------------------
def start_router(model: str, worker: str, router_args: list[str], tmp: Path) -> tuple:
    ready = tmp / "router.ready"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    # ROUTER_PROFILE=FILE: the router runs under cProfile, its statistics written there.
    prof = (["-m", "cProfile", "-o", os.environ["ROUTER_PROFILE"]]
            if os.environ.get("ROUTER_PROFILE") else [])
    with open(tmp / "router.log", "w") as log:
        p = subprocess.Popen([sys.executable, *prof, "-m", "tandem.cli.main", "router",
                              "--model", model, "--workers", worker, "--grpc-port", "0",
                              "--http-port", "-1", "--max-requests", "100000",
                              "--ready-file", str(ready), *router_args],
                             stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while not ready.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"router did not start:\n{(tmp / 'router.log').read_text()[-3000:]}")
        time.sleep(0.05)
    return p, f"127.0.0.1:{ready.read_text().split()[0]}"


def run(a: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="router-intake-"))
    arrivals = tmp / "arrivals.json"
    worker = subprocess.Popen([sys.executable, __file__, "--serve-worker", "--arrivals",
                               str(arrivals), "--step-ms", str(a.step_ms), "--per-request-us",
                               str(a.per_request_us), "--vocab", str(a.vocab)],
                              stdout=subprocess.PIPE, text=True)
    router = None
    try:
        port = int(worker.stdout.readline())
        router, target = start_router(a.model, f"127.0.0.1:{port}", a.router_arg, tmp)
        rng = random.Random(a.seed)
        reqs = [Request([rng.randrange(a.vocab // 4, a.vocab) for _ in range(a.prompt_len)],
                        a.output_len) for _ in range(a.num_requests)]
        opts = LoadOptions(target=target, channels=a.channels, client_procs=a.client_procs,
                           progress=False)
        send_all(opts, reqs[:a.warmup], [0.0] * a.warmup, "warm-up")
        cpu0, t0 = process_cpu_s(router.pid), time.monotonic()
        results, client_cpu = send_all(opts, reqs, [0.0] * len(reqs), "run")
        wall = time.monotonic() - t0
        router_cpu = process_cpu_s(router.pid) - cpu0
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            router.wait(60)
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
    arrived = json.loads(arrivals.read_text())
    failed = [r for r in results if not r.ok]
    tokens = sum(r.tokens for r in results)
    # The router's request ids are its own: match a call to its arrival by order of arrival
    # against order of sending is not possible, so the intake is told by the arrival times
    # alone, from the first call sent.
    first_sent = min(r.sent for r in results)
    lags = sorted(t - first_sent for t in arrived.values() if t >= first_sent)
    return {"requests": len(results), "failed": len(failed),
            "errors": sorted({r.error or "short" for r in failed})[:3],
            "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "router_cpu_us_per_token": 1e6 * router_cpu / max(1, tokens),
            "client_cpu_s": client_cpu,
            "arrival_s": dist(lags), "last_arrival_s": lags[-1] if lags else None,
            "ttft_s": dist([r.ttft for r in results if r.ttft is not None])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arrivals", help=argparse.SUPPRESS)
    p.add_argument("--model", default="tandem-demo", help="the router's tokenizer")
    p.add_argument("--vocab", type=int, default=None, help="token ids drawn below this "
                   "(default: the model's vocabulary)")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=6.0, help="the worker's step: this much")
    p.add_argument("--per-request-us", type=float, default=15.0,
                   help="... plus this much per running request")
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--client-procs", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--router-arg", action="append", default=[],
                   help="a flag for the router (repeat; --router-arg=--flag=value)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.serve_worker:
        asyncio.run(serve_worker(a))
        return
    if a.vocab is None:
        from benchmarks.lib.common import model_vocab
        a.vocab = model_vocab(a.model)[0]
    reports = [run(a) for _ in range(a.rounds)]
    print(f"{a.num_requests} requests x {a.output_len} tokens at once, worker step "
          f"{a.step_ms:g} ms + {a.per_request_us:g} us/request, {os.cpu_count()} CPUs, "
          f"router args {a.router_arg or '-'}")
    print(f"{'tok/s':>8} {'router us/tok':>14} {'arrival p50':>12} {'p90':>6} {'last':>6} "
          f"{'TTFT p50':>9} {'p99':>6} {'failed':>7}")
    for r in reports:
        print(f"{r['output_tok_s']:>8.0f} {r['router_cpu_us_per_token']:>14.1f} "
              f"{fmt(r['arrival_s']['p50'], '.2f'):>12} {fmt(r['arrival_s']['p90'], '.2f'):>6} "
              f"{fmt(r['last_arrival_s'], '.2f'):>6} {fmt(r['ttft_s']['p50'], '.2f'):>9} "
              f"{fmt(r['ttft_s']['p99'], '.2f'):>6} {r['failed']:>7}")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "runs": reports}, indent=1))


if __name__ == "__main__":
    main()
