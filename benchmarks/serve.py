"""Open-loop serving benchmark: a workload sent on a Poisson schedule through Tandem's public API,
or the offline engine on the same workload in this process.

    # against a running router (gRPC; --api http for the OpenAI HTTP API)
    python benchmarks/serve.py --target 127.0.0.1:50051 --num-requests 500 --rate 4 8 16
    # start the stack (one worker per device), measure, stop it
    python benchmarks/serve.py --launch colocated --model benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --devices cuda:0 --workload sharegpt --num-requests 1000 --rate inf
    python benchmarks/serve.py --launch disaggregated --num-prefill 1 --num-decode 1 \\
        --devices cuda:0,cuda:1 --workload prompt-heavy --rate 2 4 8 ...
    # the engine alone (LLM.generate, all requests at once), with KV-memory and step-time figures
    python benchmarks/serve.py --mode offline --model benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --devices cuda:0 --num-requests 1000
Engine flags after `--` go to every launched worker and to the offline engine, e.g.
`-- --max-num-seqs 256 --max-num-batched-tokens 4096`.

Offline mode wraps the engine's step while LLM.generate runs and, after every step, records
token times, the sequences running and KV slots allocated vs filled (paged waste, against what
static batches of --static-batch-size would reserve for the same requests); on CUDA every
--gpu-time-every-th step runs under torch.profiler to split its wall time into GPU busy time
(kernels and copies) and the rest (Python, scheduling, launches, host syncs). Its throughput
excludes the probe's own time; its latencies do not (use --gpu-time-every 0 for clean ones).

Every request sends token ids with max_tokens = the workload's length, ignore_eos and greedy
sampling, so every output is exactly as long as the workload says (checked). Per request:
  TTFT   send -> first response chunk that carries a token
  ITL    gaps between successive token-carrying chunks (vLLM's convention: a chunk carrying k
         tokens is one gap; over gRPC Tandem sends one chunk per token and step)
  TPOT   (e2e - TTFT) / (tokens - 1)
  e2e    send -> last chunk
Goodput: requests per second of the run's duration (first send -> last finish) that completed
every token with TTFT <= --slo-ttft-ms AND their own P90 ITL <= --slo-itl-ms (--goodput-itl
picks max, p99, p90, p50 or mean; P90 by default: a request whose tokens mostly arrive on time
counts even if one gap in ten is a stall; the run's pooled P99 ITL is reported next to it).
Over HTTP, times are those of SSE chunks with text (what an OpenAI client sees) and the token
count comes from the usage chunk; models without a tokenizer stream no text there: use gRPC.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
# The repository first, even when PYTHONPATH already lists it: the script's own directory
# (benchmarks/, which holds kernels.py) must not shadow the `kernels` package.
for _p in (ROOT / "protos", ROOT):
    sys.path.insert(0, str(_p))

from benchmarks.procstat import (  # noqa: E402
    engine_steps,
    pin,
    pin_plan,
    pin_stack,
    process_cpu_s,
    thread_deltas,
    thread_stats,
)
from benchmarks.workloads import (  # noqa: E402
    Request,
    add_workload_args,
    build_workload,
    describe,
    static_batch_kv,
)
from cli.launcher import LocalStack  # noqa: E402

STARTUP_TIMEOUT_S = 900  # an 8B model with dummy weights, profiling and CUDA graph capture
ITL_STATS = ("max", "p99", "p90", "p50", "mean")


# -- statistics ----------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), None when empty."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def dist(values: list[float]) -> dict:
    """mean, p50, p90, p99, max of a sample (None when empty)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None, "n": 0}
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99), "max": max(values),
            "n": len(values)}


def itl_stat(gaps: list[float], which: str) -> float:
    if not gaps:
        return 0.0
    if which == "max":
        return max(gaps)
    if which == "mean":
        return sum(gaps) / len(gaps)
    return percentile(gaps, float(which[1:]))


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
    bar = _progress(len(requests), label, opts.progress)
    if opts.client_procs <= 1:
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


def _progress(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, leave=False,
                disable=not enabled)


# -- one run: a workload at one rate -------------------------------------------------------------
def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: exponential gaps of mean 1/rate seconds, the first at 0; rate inf: all
    at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def summarize(results: list[Result], opts: LoadOptions) -> dict:
    ok = [r for r in results if r.ok]
    starts = [r.sent for r in results if r.sent]
    ends = [r.sent + r.e2e for r in results if r.e2e is not None]
    duration = (max(ends) - min(starts)) if ends else float("nan")
    out_tokens = sum(r.tokens for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)
    itls = [g for r in ok for g in r.itls]
    good = [r for r in ok
            if r.ttft * 1e3 <= opts.slo_ttft_ms
            and itl_stat(r.itls, opts.goodput_itl) * 1e3 <= opts.slo_itl_ms]
    errors = [r.error or f"{r.tokens} tokens, expected {r.expected_tokens}"
              for r in results if not r.ok]
    ms = 1e3
    return {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration,
        "output_tokens": out_tokens,
        "expected_output_tokens": sum(r.expected_tokens for r in results),
        "ttft_ms": dist([r.ttft * ms for r in ok]),
        "tpot_ms": dist([r.tpot * ms for r in ok if r.tpot is not None]),
        "itl_ms": dist([g * ms for g in itls]),
        "e2e_s": dist([r.e2e for r in ok]),
        "goodput": len(good) / duration,
        "slo_attainment": len(good) / len(results),
        "slo": {"ttft_ms": opts.slo_ttft_ms, "itl_ms": opts.slo_itl_ms,
                "per_request_itl": opts.goodput_itl},
    }


def good_requests(rows: list[dict], slo_ttft_ms: float, slo_itl_ms: float,
                  goodput_itl: str = "p90") -> int:
    """Requests (run_rates' per-request rows) that meet the SLOs: summarize()'s rule, again."""
    return sum(1 for r in rows if r["ok"] and r["ttft_ms"] <= slo_ttft_ms
               and r[f"itl_{goodput_itl}_ms"] <= slo_itl_ms)


def run_rates(opts: LoadOptions, requests: list[Request], rates: list[float], seed: int,
              label: str = "", warmup: list[Request] | None = None,
              cooldown_s: float = 1.0, stack: LocalStack | None = None) -> list[dict]:
    """The workload once per rate; each run: its summary, per-request rows and the samples the
    CDF plot needs. With the `stack` it runs on, the summary's cpu_s says what CPU time each
    process and the clients spent during the run, and engine_steps how many steps each worker
    ran (when the stack serves metrics)."""
    procs = stack.procs if stack is not None else {}

    def cpu() -> dict[str, float | None]:
        return {name: process_cpu_s(p.popen.pid) for name, p in procs.items()}

    def threads() -> dict[str, dict[str, dict[str, float]]]:
        return {name: thread_stats(p.popen.pid) for name, p in procs.items()}

    def steps() -> dict[str, int | None]:
        return {name: engine_steps(p.metrics_url) for name, p in procs.items()
                if p.metrics_port}

    if warmup:
        w, _ = send_all(opts, warmup, [0.0] * len(warmup), f"{label}warmup")
        bad = [r.error for r in w if r.error]
        if bad:
            raise RuntimeError(f"warmup requests failed: {bad[:3]}")
    runs = []
    for k, rate in enumerate(rates):
        if k:
            time.sleep(cooldown_s)
        offsets = arrival_offsets(len(requests), rate, seed + 1000 * k)
        before, steps_before, threads_before = cpu(), steps(), threads()
        results, client_cpu_s = send_all(opts, requests, offsets, f"{label}rate {fmt_rate(rate)}")
        after, steps_after, threads_after = cpu(), steps(), threads()
        s = summarize(results, opts)
        s["rate"] = rate
        s["cpu_s"] = {"client": client_cpu_s, **{
            name: after[name] - before[name] for name in before
            if before[name] is not None and after[name] is not None}}
        s["threads"] = {name: thread_deltas(threads_before[name], threads_after[name])
                        for name in threads_after}
        s["engine_steps"] = {name: steps_after[name] - steps_before[name] for name in steps_before
                             if steps_before[name] is not None and steps_after[name] is not None}
        ok = [r for r in results if r.ok]
        runs.append({
            "summary": s,
            # per request: enough to recompute goodput under other SLOs (good_requests)
            "requests": [{"prompt_len": r.prompt_len, "output_tokens": r.tokens,
                          "expected_tokens": r.expected_tokens, "ok": r.ok,
                          "ttft_ms": _ms(r.ttft), "tpot_ms": _ms(r.tpot), "e2e_s": r.e2e,
                          **{f"itl_{k}_ms": _ms(itl_stat(r.itls, k)) for k in ITL_STATS},
                          "error": r.error}
                         for r in results],
            # for the plot only (not written to JSON)
            "_samples": {"ttft_ms": [r.ttft * 1e3 for r in ok],
                         "tpot_ms": [r.tpot * 1e3 for r in ok if r.tpot is not None],
                         "itl_ms": [g * 1e3 for r in ok for g in r.itls],
                         "e2e_s": [r.e2e for r in ok]},
        })
    return runs


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def fmt_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# -- launching the stack -------------------------------------------------------------------------
_TORCH_NAMES = ("import torch\nfor i in range(torch.cuda.device_count()):\n"
                "    print(f'{i}, {torch.cuda.get_device_name(i)}')")


def cuda_names() -> dict[int, str]:
    """GPU index -> name as the workers will see them, from nvidia-smi or else from torch in a
    child process (this one stays without a CUDA context, which would take GPU memory)."""
    cmds = [[sys.executable, "-c", _TORCH_NAMES]]
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):  # nvidia-smi ignores it
        cmds.insert(0, ["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"])
    for cmd in cmds:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                                 check=True).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        names = {}
        for line in out.strip().splitlines():
            idx, _, name = line.partition(",")
            if idx.strip().isdigit():
                names[int(idx)] = name.strip()
        return names
    return {}


def device_name(device: str, names: dict[int, str] | None = None) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    names = cuda_names() if names is None else names
    idx = int(device.partition(":")[2] or 0)
    return names.get(idx, device)


def resolve_devices(spec: str, n: int) -> list[str]:
    """One device per worker. spec: comma-separated devices, one per worker in the order
    prefill..., decode..., both...; a single device is shared by all; `auto`: cuda:0..n-1 when
    there are n GPUs, else cpu."""
    if spec == "auto":
        count = len(cuda_names())
        return [f"cuda:{i}" for i in range(n)] if count >= n else ["cpu"] * n
    devs = [d.strip() for d in spec.split(",") if d.strip()]
    if len(devs) == 1:
        return devs * n
    if len(devs) < n:
        raise SystemExit(f"serve.py: {n} workers need {n} devices, --devices names {len(devs)}")
    return devs[:n]


def launch_stack(model: str, roles: list[str], devices: list[str], worker_args: list[str],
                 router_args: list[str], log_dir: Path | None = None) -> LocalStack:
    """Workers (one OS process each, on the device given) and a router in front: the same
    process manager as `tandem up`, logs to files, this checkout on the children's path."""
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos"),
                                          os.environ.get("PYTHONPATH", "")])}
    return LocalStack(model, roles, devices, worker_args=worker_args,
                      router_args=["--grpc-port", "0", "--http-port", "0", *router_args],
                      log_dir=log_dir, env=env, metrics=True)


def describe_workers(stack: LocalStack) -> list[dict]:
    names = cuda_names() if any(d.startswith("cuda") for d in stack.devices) else {}
    return [{"role": r, "device": d, "card": device_name(d, names)}
            for r, d in zip(stack.roles, stack.devices)]


def launch_roles(a: argparse.Namespace) -> list[str]:
    if a.launch == "colocated":
        return ["both"] * (a.num_both or 1)
    if not a.num_prefill or not a.num_decode:
        raise SystemExit("serve.py: --launch disaggregated needs --num-prefill and --num-decode")
    return ["prefill"] * a.num_prefill + ["decode"] * a.num_decode + ["both"] * a.num_both


def common_worker_args(a: argparse.Namespace, passthrough: list[str]) -> list[str]:
    return ["--dtype", a.dtype, "--load-format", a.load_format, "--max-model-len",
            str(a.max_model_len), *passthrough]


def router_args(a: argparse.Namespace, passthrough: list[str], num_requests: int) -> list[str]:
    out = ["--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
           "--max-requests", str(max(1024, 2 * num_requests))]
    if "--block-size" in passthrough:  # the router hashes prefixes with the workers' block size
        out += ["--block-size", passthrough[passthrough.index("--block-size") + 1]]
    return out


# -- offline: the engine in this process ---------------------------------------------------------
class StepProbe:
    """Wraps one LLMEngine's step (and its runner's execute) while LLM.generate drives it, and
    after every step records: token arrival times per request, the sequences running, and KV
    slots allocated vs filled. Every `gpu_every`-th step runs under torch.profiler (CUDA
    activity only) to measure the GPU's busy time (union of kernel and copy intervals) against
    the step's wall time. Profiler set-up and parsing (`overhead_s`) and the probe's own
    bookkeeping (`record_s`) happen outside the timed step; the caller takes both off the run's
    duration."""

    def __init__(self, engine, gpu_every: int) -> None:
        self.engine = engine
        self.block_size = engine.block_pool.block_size
        self.gpu_every = gpu_every
        self._step, self._execute = engine.step, engine.runner.execute
        engine.step, engine.runner.execute = self.step, self.execute
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.itls: list[float] = []
        self.steps = 0
        self.step_s = 0.0
        self.execute_s = 0.0
        self.overhead_s = 0.0  # profiler set-up and parsing
        self.record_s = 0.0  # this probe's bookkeeping after each step
        self.peak_running = 0
        self.peak_used_blocks = 0
        self.alloc_slot_steps = 0
        self.filled_slot_steps = 0
        self.step_waste: list[float] = []
        # Per step kind (decode, mixed, prefill): steps, tokens, wall s; and the profiled
        # steps' (wall s, GPU busy s).
        self.kinds: dict[str, list] = {k: [0, 0, 0.0, []] for k in STEP_KINDS}
        self.saturated = [0, 0.0]  # tokens sampled and seconds in steps with >= 200 running
        self.gpu_error: str | None = None

    def restore(self) -> None:
        self.engine.step, self.engine.runner.execute = self._step, self._execute

    def execute(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self._execute(*args, **kwargs)
        finally:
            self.execute_s += time.perf_counter() - t

    def step(self):
        prof = None
        if self.gpu_every and self.gpu_error is None and self.steps % self.gpu_every == 0:
            t = time.perf_counter()
            prof = _start_profiler(self)
            self.overhead_s += time.perf_counter() - t
        t0 = time.perf_counter()
        outs = self._step()
        t1 = time.perf_counter()
        self.steps += 1
        self.step_s += t1 - t0
        last = self.engine.last_step
        kind = self.kinds[step_kind(last)] if last is not None and last.num_seqs else None
        if kind is not None:
            kind[0] += 1
            kind[1] += last.num_tokens
            kind[2] += t1 - t0
            if last.num_seqs >= SATURATED_SEQS:
                self.saturated[0] += last.num_sampled
                self.saturated[1] += t1 - t0
        if prof is not None:
            busy = _stop_profiler(self, prof)
            if busy is not None and kind is not None:
                kind[3].append((t1 - t0, busy))
            self.overhead_s += time.perf_counter() - t1
        t2 = time.perf_counter()
        self._record(outs, t1)
        self.record_s += time.perf_counter() - t2
        return outs

    def _record(self, outs, now: float) -> None:
        for o in outs:
            rid = o.request_id
            if o.new_token_ids:
                last = self.last.get(rid)
                if last is None:
                    self.first[rid] = now
                else:
                    self.itls.append(now - last)
                self.last[rid] = now
            if o.finish_reason is not None:
                self.done[rid] = now
        running = self.engine.scheduler.running
        blocks = filled = 0
        for s in running:
            blocks += len(s.block_ids)
            filled += s.num_computed_tokens
        self.peak_running = max(self.peak_running, len(running))
        self.peak_used_blocks = max(self.peak_used_blocks, self.engine.block_pool.num_used)
        if blocks:
            alloc = blocks * self.block_size
            self.alloc_slot_steps += alloc
            self.filled_slot_steps += filled
            self.step_waste.append(1 - filled / alloc)

    def step_account(self) -> dict:
        """Per step kind: steps, tokens, mean wall time; over the profiled steps of that kind,
        mean GPU-busy time and host time (wall minus busy: no kernel or copy running)."""
        out: dict = {"gpu_sampled_every": self.gpu_every, "gpu_error": self.gpu_error}
        for name, (steps, tokens, wall, prof) in self.kinds.items():
            row = {"steps": steps, "tokens": tokens,
                   "wall_ms_mean": wall / steps * 1e3 if steps else None,
                   "profiled": len(prof), "gpu_busy_ms_mean": None, "host_ms_mean": None,
                   "host_share": None}
            if prof:
                p_wall = sum(w for w, _ in prof)
                p_busy = sum(b for _, b in prof)
                row.update(gpu_busy_ms_mean=p_busy / len(prof) * 1e3,
                           host_ms_mean=(p_wall - p_busy) / len(prof) * 1e3,
                           host_share=1 - p_busy / p_wall)
            out[name] = row
        return out


STEP_KINDS = ("decode", "mixed", "prefill")
SATURATED_SEQS = 200  # the saturated phase: steps running at least this many sequences


def step_kind(step) -> str:
    """decode: every sequence advanced one token; prefill: none did; mixed: both kinds."""
    if step.num_decodes == step.num_seqs:
        return "decode"
    return "prefill" if step.num_decodes == 0 else "mixed"


def _start_profiler(probe: StepProbe):
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
        return prof
    except Exception as e:  # noqa: BLE001 - measuring must not break the run
        probe.gpu_error = f"{type(e).__name__}: {e}"
        return None


def _stop_profiler(probe: StepProbe, prof) -> float | None:
    """Seconds the GPU was busy (union of device-side intervals) during the profiled step."""
    try:
        import torch
        from torch.autograd import DeviceType

        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == DeviceType.CUDA)
    except Exception as e:  # noqa: BLE001
        probe.gpu_error = f"{type(e).__name__}: {e}"
        return None
    if not spans:
        probe.gpu_error = "the profiler recorded no GPU activity"
        return None
    busy, (cur_lo, cur_hi) = 0.0, spans[0]
    for lo, hi in spans[1:]:
        if lo > cur_hi:
            busy += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    busy += cur_hi - cur_lo
    return busy / 1e6  # microseconds -> seconds


def run_offline(a: argparse.Namespace, requests: list[Request], warmup: list[Request],
                passthrough: list[str]) -> dict:
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # no log lines per profiled step
    import torch

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from runtime.engine_args import add_engine_args, engine_config

    device = resolve_devices(a.devices, 1)[0]
    cores = pin_plan(["client", "engine"])["engine"] if a.pin else None
    if cores:
        pin(os.getpid(), cores)
    p = argparse.ArgumentParser(prog="serve.py --mode offline (engine flags after --)")
    add_engine_args(p)  # the workers' defaults
    ea = p.parse_args(["--model", a.model, "--device", device, "--dtype", a.dtype,
                       "--load-format", a.load_format, "--max-model-len", str(a.max_model_len),
                       *passthrough])
    cfg = engine_config(ea)
    card = None
    if device.startswith("cuda"):
        from benchmarks.floors import measure_card

        card = measure_card(device)
    t = time.perf_counter()
    llm = LLM(cfg.model, **{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "model"},
              progress=False)
    startup_s = time.perf_counter() - t
    if warmup:
        llm.generate([r.prompt for r in warmup],
                     [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0)
                      for r in warmup])
    gpu_every = a.gpu_time_every if device.startswith("cuda") else 0
    engine = llm.engine
    probe = StepProbe(engine, gpu_every)
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0)
              for r in requests]
    bar = _progress(len(requests), "offline", a.progress)
    record = probe._record

    def record_with_bar(outs, now):
        record(outs, now)
        n = sum(1 for o in outs if o.finish_reason is not None)
        if n:
            bar.update(n)

    probe._record = record_with_bar
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        outs = llm.generate([r.prompt for r in requests], params)
    finally:
        t1, c1 = time.perf_counter(), time.process_time()
        probe.restore()
        bar.close()
    duration = t1 - t0 - probe.overhead_s - probe.record_s
    counts = [len(o.outputs[0].token_ids) for o in outs]
    wrong = [i for i, (c, r) in enumerate(zip(counts, requests)) if c != r.max_tokens]
    ids = [o.request_id for o in outs]
    ttft = [(probe.first[i] - t0) * 1e3 for i in ids if i in probe.first]
    e2e = [probe.done[i] - t0 for i in ids if i in probe.done]
    tpot = [(probe.done[i] - probe.first[i]) / (c - 1) * 1e3
            for i, c in zip(ids, counts) if c > 1 and i in probe.done]
    out_tokens = sum(counts)
    pool_slots = engine.block_pool.num_blocks * engine.block_pool.block_size
    static = static_batch_kv(requests, a.static_batch_size)
    kv = {
        "block_size": engine.block_pool.block_size,
        "pool_slots": pool_slots,
        "max_num_seqs": engine.config.max_num_seqs,
        "peak_running_seqs": probe.peak_running,
        "peak_used_slots": probe.peak_used_blocks * engine.block_pool.block_size,
        # allocated but unfilled: Σ_steps (blocks of running seqs × block size − tokens in
        # them) / Σ_steps allocated
        "paged_waste": (1 - probe.filled_slot_steps / probe.alloc_slot_steps
                        if probe.alloc_slot_steps else None),
        "paged_waste_mean_per_step": (sum(probe.step_waste) / len(probe.step_waste)
                                      if probe.step_waste else None),
        "preemptions": engine.scheduler.num_preemptions,
        "static": static,
        # rows that B × (P + O) reservations of this workload's average size fit in this pool
        "static_rows_fitting_pool": int(pool_slots // static["mean_reserved_slots_per_row"]),
    }
    steps = {"steps": probe.steps, "step_s_total": probe.step_s,
             "step_ms_mean": probe.step_s / max(1, probe.steps) * 1e3,
             "execute_share": probe.execute_s / probe.step_s if probe.step_s else None,
             "outside_execute_share": 1 - probe.execute_s / probe.step_s if probe.step_s else None,
             "profiler_overhead_s": probe.overhead_s, "probe_bookkeeping_s": probe.record_s,
             "excluded_from_duration_s": probe.overhead_s + probe.record_s,
             "by_kind": probe.step_account(),
             "saturated_output_throughput": (probe.saturated[0] / probe.saturated[1]
                                             if probe.saturated[1] else None)}
    floor = None
    if card is not None:
        from benchmarks.floors import describe_model, floors

        model = describe_model(engine.runner.model,
                               engine.runner.block_bytes // engine.block_pool.block_size)
        floor = floors(card, model, [len(r.prompt) for r in requests], counts,
                       [probe.first[i] - t0 for i in ids], duration)
    return {
        "mode": "offline", "device": device,
        "card": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda")
        else "cpu",
        "engine_config": {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "extra"},
        "num_blocks": engine.block_pool.num_blocks,
        "startup_s": startup_s,
        "num_requests": len(requests), "completed": len(requests) - len(wrong),
        "wrong_length": wrong[:10],
        "duration_s": duration, "output_tokens": out_tokens,
        "cpu_s": {"engine": c1 - c0},  # this process, all threads, probe included
        "pinned": {"engine": cores} if a.pin else None,
        "expected_output_tokens": sum(r.max_tokens for r in requests),
        "request_throughput": len(requests) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(len(r.prompt) for r in requests)) / duration,
        "ttft_ms": dist(ttft), "tpot_ms": dist(tpot),
        "itl_ms": dist([g * 1e3 for g in probe.itls]), "e2e_s": dist(e2e),
        "kv": kv, "step_time": steps, "floors": floor,
        "_samples": {"ttft_ms": ttft, "tpot_ms": tpot,
                     "itl_ms": [g * 1e3 for g in probe.itls], "e2e_s": e2e},
    }


# -- reporting -----------------------------------------------------------------------------------
def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_online(runs: list[dict], header: str) -> None:
    print(header)
    print(f"{'rate':>6}{'done':>7}{'dur s':>8}{'req/s':>8}{'out tok/s':>11}"
          f"{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
          f"{'goodput':>9}{'SLO':>6}")
    for run in runs:
        s = run["summary"]
        print(f"{fmt_rate(s['rate']):>6}{s['completed']:>4}/{s['num_requests']:<3}"
              f"{_f(s['duration_s']):>7}{_f(s['request_throughput'], '.2f'):>8}"
              f"{_f(s['output_throughput'], '.0f'):>11}"
              f"{_f(s['ttft_ms']['p50'], '.0f'):>10}{_f(s['ttft_ms']['p99'], '.0f'):>9}"
              f"{_f(s['tpot_ms']['p50']):>10}{_f(s['tpot_ms']['p99']):>8}"
              f"{_f(s['itl_ms']['p50']):>9}{_f(s['itl_ms']['p99']):>8}"
              f"{_f(s['goodput'], '.2f'):>9}{_f(s['slo_attainment'], '.0%'):>6}")
        for e in s["errors"][:3]:
            print(f"    error: {e}")
    if runs:
        slo = runs[0]["summary"]["slo"]
        print(f"(ms; goodput in req/s: TTFT <= {slo['ttft_ms']:g} ms and per-request "
              f"{slo['per_request_itl']} ITL <= {slo['itl_ms']:g} ms)")


def print_offline(r: dict, header: str) -> None:
    print(header)
    print(f"{r['completed']}/{r['num_requests']} requests in {r['duration_s']:.2f} s: "
          f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.0f} output tok/s, "
          f"{r['total_token_throughput']:.0f} total tok/s; TTFT p50 {_f(r['ttft_ms']['p50'], '.0f')}"
          f" ms, TPOT p50 {_f(r['tpot_ms']['p50'])} ms; saturated phase (>= {SATURATED_SEQS} "
          f"running) {_f(r['step_time']['saturated_output_throughput'], '.0f')} output tok/s")
    f = r.get("floors")
    if f:
        c = f["card"]
        print(f"floors (card: {c['matmul_tflops']:.0f} TFLOP/s bf16 matmul, {c['copy_gbps']:.0f} "
              f"GB/s copy, measured): compute {f['compute_floor_s']:.2f} s ({f['tflop']:.0f} "
              f"TFLOP), bandwidth {f['bandwidth_floor_s']:.2f} s, critical path "
              f"{f['critical_path_s']:.2f} s (request {f['critical_request']['index']}: first "
              f"token at {f['critical_request']['earliest_first_token_s']:.2f} s at the earliest,"
              f" {f['critical_request']['measured_first_token_s']:.2f} s measured; "
              f"{f['critical_request']['output_tokens']} tokens at "
              f"{f['batch1_step_floor_ms']:.2f} ms); bound by {f['bound_by']}: this run is "
              f"{f['share_of_floor']:.0%} of its floor")
    kv, st = r["kv"], r["kv"]["static"]
    print(f"KV: peak {kv['peak_running_seqs']} sequences running (max_num_seqs "
          f"{kv['max_num_seqs']}); slots allocated but unfilled {_f(kv['paged_waste'], '.1%')} "
          f"(paged, {kv['block_size']}-token blocks) vs {st['reserved_waste']:.1%} reserved by "
          f"static batches of {st['batch_size']} (B x (max prompt + max new)); "
          f"{st['dynamic_cache_waste']:.1%} with a growing cache")
    print(f"    pool {kv['pool_slots']} slots: fits {kv['static_rows_fitting_pool']} static rows "
          f"of this workload's mean reservation; peak slots in use {kv['peak_used_slots']}; "
          f"{kv['preemptions']} preemptions")
    s = r["step_time"]
    print(f"steps: {s['steps']}, mean {s['step_ms_mean']:.2f} ms; outside the model runner "
          f"(scheduling, bookkeeping) {_f(s['outside_execute_share'], '.1%')}")
    k = s["by_kind"]
    if k["gpu_error"]:
        print(f"    GPU time: unavailable ({k['gpu_error']})")
    print(f"    {'step kind':>9}{'steps':>7}{'tokens':>9}{'wall ms':>9}{'GPU busy':>10}"
          f"{'host ms':>9}{'host %':>8}  (GPU figures: every {k['gpu_sampled_every']}th step)")
    for name in STEP_KINDS:
        row = k[name]
        print(f"    {name:>9}{row['steps']:>7}{row['tokens']:>9}{_f(row['wall_ms_mean'], '.2f'):>9}"
              f"{_f(row['gpu_busy_ms_mean'], '.2f'):>10}{_f(row['host_ms_mean'], '.2f'):>9}"
              f"{_f(row['host_share'], '.1%'):>8}")


def plot(runs_for_plot: list[dict], path: Path, title: str) -> str | None:
    from benchmarks.plotting import latency_cdfs

    return latency_cdfs(runs_for_plot, path, title)


def _plot_rows(label_prefix: str, runs: list[dict]) -> list[dict]:
    rows = []
    for run in runs:
        s = run["summary"]
        rows.append({"label": f"{label_prefix}rate {fmt_rate(s['rate'])}", "rate": s["rate"],
                     "goodput": s["goodput"], "request_throughput": s["request_throughput"],
                     "output_throughput": s["output_throughput"], **run["_samples"]})
    return rows


def strip_private(obj):
    if isinstance(obj, dict):
        return {k: strip_private(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [strip_private(v) for v in obj]
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return str(obj)
    return obj


def environment() -> dict:
    env = {"python": sys.version.split()[0], "host_cpus": os.cpu_count()}
    import importlib.metadata as md

    for pkg in ("torch", "transformers", "grpcio", "triton"):
        with contextlib.suppress(md.PackageNotFoundError):
            env[pkg] = md.version(pkg)
    return env


# -- command line --------------------------------------------------------------------------------
def parse_rate(s: str) -> float:
    return float("inf") if s.lower() in ("inf", "infinity") else float(s)


def add_load_args(p: argparse.ArgumentParser, single_run: bool = True) -> None:
    """single_run: also --rate and --api (ratio.py has its own rates and uses gRPC)."""
    g = p.add_argument_group("load")
    if single_run:
        g.add_argument("--rate", type=parse_rate, nargs="+", default=[float("inf")],
                       help="requests/s, Poisson arrivals; several values: one run each; inf: "
                            "all at once")
        g.add_argument("--api", choices=["grpc", "http"], default="grpc")
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    g.add_argument("--slo-itl-ms", type=float, default=100.0)
    g.add_argument("--goodput-itl", choices=ITL_STATS, default="p90",
                   help="which of a request's own ITLs must be <= --slo-itl-ms")
    g.add_argument("--warmup", type=int, default=4,
                   help="requests (workload-shaped, at most 16 tokens out) sent first, unmeasured")
    g.add_argument("--channels", type=int, default=4, help="gRPC connections per client process")
    g.add_argument("--client-procs", type=int, default=None,
                   help="client processes sharing the requests (default: a quarter of the cores, "
                        "1 to 4): one Python process cannot time 20k+ tokens/s by itself")
    g.add_argument("--request-timeout", type=float, default=3600.0)
    g.add_argument("--cooldown", type=float, default=2.0, help="seconds between rates")


def add_stack_args(p: argparse.ArgumentParser, devices: bool = True) -> None:
    """devices: also --devices (ratio.py places workers itself)."""
    g = p.add_argument_group("stack (--launch, --mode offline)")
    g.add_argument("--model", default=None,
                   help="checkpoint or config directory, or tandem-demo (for --target: only to "
                        "read the vocabulary; GetModelInfo otherwise)")
    g.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    g.add_argument("--max-model-len", type=int, default=4096)
    if devices:
        g.add_argument("--devices", default="auto",
                       help="comma-separated, one per worker in the order prefill, decode, both "
                            "(e.g. cuda:0,cuda:1); one device is shared by all; auto: cuda:0.. "
                            "if there are enough GPUs, else cpu")
    g.add_argument("--log-dir", type=Path, default=None, help="worker and router logs")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__,
        epilog="Engine flags after `--` go to every worker and to the offline engine.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["online", "offline"], default="online")
    tgt = p.add_mutually_exclusive_group()
    tgt.add_argument("--target", default=None,
                     help="a running router: gRPC host:port (--api http: its HTTP host:port)")
    tgt.add_argument("--launch", choices=["colocated", "disaggregated"], default=None)
    p.add_argument("--num-prefill", type=int, default=0)
    p.add_argument("--num-decode", type=int, default=0)
    p.add_argument("--num-both", type=int, default=0,
                   help="colocated workers (default 1 with --launch colocated)")
    add_stack_args(p)
    add_workload_args(p)
    add_load_args(p)
    g = p.add_argument_group("offline")
    g.add_argument("--gpu-time-every", type=int, default=10,
                   help="profile every Nth engine step's GPU busy time (0: off; CUDA only)")
    g.add_argument("--static-batch-size", type=int, default=64,
                   help="the static batch size the KV comparison assumes")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=None, help="JSON results")
    g.add_argument("--plot", type=Path, default=None,
                   help="PNG of latency CDFs (and goodput vs rate); default: --out with .png")
    g.add_argument("--label", default="", help="a name for this configuration in the report")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--pin", action="store_true",
                   help="one physical core per process (Linux): this client on the first, then "
                        "each launched worker and the router; --mode offline takes the core the "
                        "first worker would get")
    return p


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        k = argv.index("--")
        return argv[:k], argv[k + 1:]
    return argv, []


def default_client_procs() -> int:
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def model_vocab(model: str) -> tuple[int, int]:
    from engine.config import ModelConfig
    from engine.model_source import resolve_model

    cfg = ModelConfig.from_dir(resolve_model(model))
    return cfg.vocab_size, cfg.max_model_len


def target_info(target: str) -> tuple[int, int, str]:
    """vocab, max_model_len and model id of a running router, over gRPC."""
    import grpc

    from tandem.v1 import api_pb2, api_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        info = api_pb2_grpc.TandemStub(ch).GetModelInfo(api_pb2.GetModelInfoRequest(), timeout=30)
    return info.vocab_size, info.max_model_len, info.id


def http_model_id(base: str) -> str:
    import httpx

    base = base if "://" in base else f"http://{base}"
    return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]


def check_lengths(requests: list[Request], max_model_len: int) -> None:
    long = [i for i, r in enumerate(requests) if len(r.prompt) + r.max_tokens > max_model_len]
    if long:
        r = requests[long[0]]
        raise SystemExit(f"serve.py: {len(long)} requests exceed max_model_len {max_model_len} "
                         f"(e.g. #{long[0]}: {len(r.prompt)} + {r.max_tokens}); raise "
                         "--max-model-len or shorten the workload")


def warmup_requests(a: argparse.Namespace, vocab: int) -> list[Request]:
    if not a.warmup:
        return []
    saved = a.num_requests
    a.num_requests = a.warmup
    try:
        reqs = build_workload(a, vocab, seed=a.seed + 7919)
    finally:
        a.num_requests = saved
    return [Request(r.prompt, min(r.max_tokens, 16)) for r in reqs]


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else list(argv)
    argv, passthrough = split_passthrough(raw)
    a = build_parser().parse_args(argv)
    if a.mode == "online" and not (a.target or a.launch):
        raise SystemExit("serve.py: give --target HOST:PORT or --launch colocated|disaggregated "
                         "(or --mode offline)")
    if (a.mode == "offline" or a.launch) and not a.model:
        raise SystemExit("serve.py: --model is required with --launch and --mode offline")
    if a.model:
        vocab, model_max = model_vocab(a.model)
        max_len = min(a.max_model_len, model_max)
        model_id = a.model
    else:
        if a.api == "http":
            raise SystemExit("serve.py: with --api http and --target, also give --model")
        vocab, max_len, model_id = target_info(a.target)
    requests = build_workload(a, vocab)
    check_lengths(requests, max_len)
    warm = warmup_requests(a, vocab)
    report = {"benchmark": "serve", "label": a.label, "mode": a.mode, "model": a.model,
              "dtype": a.dtype, "load_format": a.load_format, "workload": a.workload,
              "workload_stats": describe(requests), "seed": a.seed,
              "engine_args": passthrough, "environment": environment(),
              "command": " ".join(["benchmarks/serve.py", *raw])}
    title = (f"{a.label or Path(a.model or model_id).name} {a.mode} "
             f"{a.launch or ''} {a.workload} x{a.num_requests}")
    if a.mode == "offline":
        r = run_offline(a, requests, warm, passthrough)
        report.update(r)
        print_offline(r, f"== {title} on {r['card']} ({a.dtype})")
        plot_rows = [{"label": "offline", "rate": None, **r["_samples"]}]
    else:
        stack = None
        http_target = a.target
        try:
            if a.launch:
                roles = launch_roles(a)
                devices = resolve_devices(a.devices, len(roles))
                stack = launch_stack(a.model, roles, devices, common_worker_args(a, passthrough),
                                     router_args(a, passthrough, a.num_requests), a.log_dir)
                print(f"starting {len(roles)} workers ({', '.join(roles)}) on "
                      f"{', '.join(devices)}; logs in {stack.log_dir}", flush=True)
                t = time.perf_counter()
                stack.start()
                if a.pin:
                    report["pinned"] = pin_stack(stack)
                report["startup_s"] = time.perf_counter() - t
                report["workers"] = describe_workers(stack)
                grpc_target = stack.router.address
                http_target = f"127.0.0.1:{stack.router.http_port}"
            else:
                grpc_target = a.target
            target = grpc_target if a.api == "grpc" else http_target
            if a.api == "http":
                model_id = http_model_id(target)
            opts = LoadOptions(api=a.api, target=target, model_id=model_id, channels=a.channels,
                               request_timeout=a.request_timeout, slo_ttft_ms=a.slo_ttft_ms,
                               slo_itl_ms=a.slo_itl_ms, goodput_itl=a.goodput_itl,
                               client_procs=a.client_procs or default_client_procs(),
                               progress=a.progress)
            runs = run_rates(opts, requests, a.rate, a.seed, warmup=warm, cooldown_s=a.cooldown,
                             stack=stack)
        finally:
            if stack is not None:
                codes = stack.stop()
                report["exit_codes"] = codes
        cards = sorted({w["card"] for w in report.get("workers", [])}) or ["(target)"]
        report["card"] = ", ".join(cards)
        report["api"] = a.api
        report["launch"] = a.launch
        report["runs"] = runs
        print_online(runs, f"== {title} via {a.api} on {report['card']}")
        plot_rows = _plot_rows("", runs)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(strip_private(report), indent=1))
        print(f"wrote {a.out}")
    png = a.plot or (a.out.with_suffix(".png") if a.out else None)
    if png:
        why = plot(plot_rows, png, f"{title} on {report['card']}")
        print(why or f"wrote {png}")
    bad = report.get("failed") or sum(r["summary"]["failed"] for r in report.get("runs", []))
    bad = bad or len(report.get("wrong_length", []))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
