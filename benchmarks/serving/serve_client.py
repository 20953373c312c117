"""The load generator of benchmarks/serving/serve.py: each request sent with its token ids through
Tandem's public API (gRPC, or the OpenAI HTTP API) at its offset from a common start, one
client process or several, and timed chunk by chunk into a Result (the latency definitions are
serve.py's, see its docstring)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import asdict, dataclass, field

from benchmarks.lib.common import progress_bar
from benchmarks.lib.workloads import Request
from tandem.engine.heap import freeze_startup_heap


# -- one request's record ------------------------------------------------------------------------
@dataclass
class Result:
    index: int
    prompt_len: int
    expected_tokens: int
    sent: float = 0.0  # time.monotonic() when sent (comparable across this host's processes)
    ttft: float | None = None  # seconds after sent
    chunk_times: list[float] = field(default_factory=list)  # seconds after sent, token chunks
    tokens: int = 0
    e2e: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.tokens == self.expected_tokens

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


@dataclass(frozen=True)
class LoadOptions:
    api: str = "grpc"  # grpc | http
    target: str = ""  # gRPC host:port, or the HTTP base URL / host:port
    model_id: str = ""  # HTTP: the served model's id
    channels: int = 4
    request_timeout: float = 3600.0
    slo_ttft_ms: float = 2000.0
    slo_itl_ms: float = 100.0
    goodput_itl: str = "p90"
    client_procs: int = 1
    progress: bool = True


# -- clients -------------------------------------------------------------------------------------
async def _grpc_one(stub, req: Request, res: Result, timeout: float) -> None:
    import grpc

    from tandem.v1 import api_pb2, common_pb2

    msg = api_pb2.GenerateRequest(
        token_ids=api_pb2.TokenIds(ids=req.prompt),
        params=common_pb2.SamplingParams(max_tokens=req.max_tokens, ignore_eos=True,
                                         temperature=0.0))
    res.sent = t0 = time.monotonic()
    try:
        async for chunk in stub.Generate(msg, timeout=timeout):
            now = time.monotonic() - t0
            if chunk.token_ids:
                if res.ttft is None:
                    res.ttft = now
                res.chunk_times.append(now)
                res.tokens += len(chunk.token_ids)
        res.e2e = time.monotonic() - t0
    except grpc.aio.AioRpcError as e:
        res.error = f"{e.code().name}: {e.details()}"


async def _http_one(client, model_id: str, req: Request, res: Result, timeout: float) -> None:
    body = {"model": model_id, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    res.sent = t0 = time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])
                    return
                now = time.monotonic() - t0
                if any(c.get("text") for c in obj.get("choices", ())):
                    if res.ttft is None:
                        res.ttft = now
                    res.chunk_times.append(now)
                if obj.get("usage"):
                    res.tokens = obj["usage"]["completion_tokens"]
        res.e2e = time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - any transport failure is this request's error
        res.error = f"{type(e).__name__}: {e}"


async def run_shard(opts: LoadOptions, shard: list[tuple[int, Request, float]], start: float,
                    on_done) -> list[Result]:
    """Send each (index, request, offset) at start + offset; on_done() after each finishes."""
    results = [Result(i, len(r.prompt), r.max_tokens) for i, r, _ in shard]
    if opts.api == "grpc":
        import grpc

        from tandem.v1 import api_pb2_grpc

        # Separate connections (a local subchannel pool per channel), so one HTTP/2
        # connection's flow control does not serialize every stream.
        chans = [grpc.aio.insecure_channel(opts.target, options=[
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_receive_message_length", 64 << 20)]) for _ in range(opts.channels)]
        stubs = [api_pb2_grpc.TandemStub(c) for c in chans]

        def send(k, req, res):
            return _grpc_one(stubs[k % len(stubs)], req, res, opts.request_timeout)
    else:
        import httpx

        base = opts.target if "://" in opts.target else f"http://{opts.target}"
        client = httpx.AsyncClient(base_url=base, timeout=opts.request_timeout,
                                   limits=httpx.Limits(max_connections=None,
                                                       max_keepalive_connections=None))

        def send(k, req, res):
            return _http_one(client, opts.model_id, req, res, opts.request_timeout)

    async def one(k: int, req: Request, res: Result, offset: float) -> None:
        delay = start + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await send(k, req, res)
        on_done()

    try:
        await asyncio.gather(*(one(k, req, res, off)
                               for k, ((_, req, off), res) in enumerate(zip(shard, results))))
    finally:
        if opts.api == "grpc":
            for c in chans:
                await c.close()
        else:
            await client.aclose()
    return results


def _shard_process(opts: LoadOptions, shard, conn, go, start_value) -> None:
    """A client process (--client-procs > 1): connect, say ready, send at the common start."""
    done = 0

    def on_done():
        nonlocal done
        done += 1
        if done % 8 == 0:
            conn.send(("progress", 8))

    async def main():
        freeze_startup_heap()  # a collection's pause here would read as the server's latency
        conn.send(("ready", None))
        await asyncio.to_thread(go.wait)
        c0 = time.process_time()
        return await run_shard(opts, shard, start_value.value, on_done), time.process_time() - c0

    results, cpu_s = asyncio.run(main())
    conn.send(("progress", done % 8))
    conn.send(("results", ([asdict(r) for r in results], cpu_s)))
    conn.close()


def send_all(opts: LoadOptions, requests: list[Request], offsets: list[float],
             label: str) -> tuple[list[Result], float]:
    """Every request at its offset from a common start: results in request order, and the CPU
    seconds the clients spent sending and reading."""
    indexed = [(i, r, off) for i, (r, off) in enumerate(zip(requests, offsets))]
    bar = progress_bar(len(requests), label, opts.progress)
    if opts.client_procs <= 1:
        freeze_startup_heap()  # a collection's pause here would read as the server's latency
        c0 = time.process_time()
        results = asyncio.run(run_shard(opts, indexed, time.monotonic() + 0.05,
                                        lambda: bar.update(1)))
        bar.close()
        return results, time.process_time() - c0
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # gRPC does not survive fork
    go, start_value = ctx.Event(), ctx.Value("d", 0.0)
    shards = [indexed[k::opts.client_procs] for k in range(opts.client_procs)]
    pipes, procs = [], []
    for shard in shards:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_shard_process, args=(opts, shard, child, go, start_value),
                        daemon=True)
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)
    for c, p in zip(pipes, procs):
        if not c.poll(120):
            raise RuntimeError(f"client process {p.pid} did not start (exit code {p.exitcode})")
        kind, _ = c.recv()
        assert kind == "ready", kind
    start_value.value = time.monotonic() + 0.1
    go.set()
    out: list[Result] = []
    cpu_s = 0.0
    from multiprocessing.connection import wait

    pending = list(pipes)
    while pending:
        for c in wait(pending):
            try:
                kind, payload = c.recv()
            except EOFError:
                pending.remove(c)
                continue
            if kind == "progress":
                bar.update(payload)
            elif kind == "results":
                out += [Result(**d) for d in payload[0]]
                cpu_s += payload[1]
                pending.remove(c)
    for p in procs:
        p.join(10)
    bar.close()
    if len(out) != len(requests):
        raise RuntimeError(f"client processes returned {len(out)} of {len(requests)} results")
    return sorted(out, key=lambda r: r.index), cpu_s
