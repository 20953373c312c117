"""Open-loop serving benchmark (the online load generator): a workload sent on a Poisson schedule
through Tandem's public API, to a running router or to a stack this script launches and stops.

    # against a running router (gRPC; --api http for the OpenAI HTTP API)
    python benchmarks/serve.py --target 127.0.0.1:50051 --num-requests 500 --rate 4 8 16
    # start the stack (one worker per device), measure, stop it
    python benchmarks/serve.py --launch colocated --model benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --devices cuda:0 --workload sharegpt --num-requests 1000 --rate inf
    python benchmarks/serve.py --launch disaggregated --num-prefill 1 --num-decode 1 \\
        --devices cuda:0,cuda:1 --workload prompt-heavy --rate 2 4 8 ...
    # the engine alone on the same workload: the offline profiler (benchmarks/offline.py)
    python benchmarks/serve.py --mode offline --model benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --devices cuda:0 --num-requests 1000
Engine flags after `--` go to every launched worker and to the offline engine, e.g.
`-- --max-num-seqs 256 --max-num-batched-tokens 4096`. The stack is the process manager
`tandem up` uses (cli/launcher.py), with logs to files and metrics on, so each run also reports
the CPU time of every process and the engine steps each worker ran.

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
import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The repository first, even when PYTHONPATH already lists it: the script's own directory
# (benchmarks/, which holds kernels.py) must not shadow the `kernels` package.
sys.path.insert(0, str(ROOT))

from benchmarks import offline  # noqa: E402
from benchmarks.common import (  # noqa: E402
    ITL_STATS,
    add_output_args,
    add_stack_args,
    add_warmup_arg,
    check_lengths,
    cuda_names,
    device_name,
    dist,
    environment,
    fmt,
    fmt_rate,
    itl_stat,
    model_vocab,
    parse_rate,
    progress_bar,
    resolve_devices,
    split_passthrough,
    warmup_requests,
    write_report,
)
from benchmarks.procstat import (  # noqa: E402
    engine_steps,
    kv_pull_summary,
    kv_pulls,
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
)
from cli.launcher import LocalStack  # noqa: E402


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
    bar = progress_bar(len(requests), label, opts.progress)
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

    def pulls() -> dict[str, dict | None]:
        return {name: kv_pulls(p.metrics_url) for name, p in procs.items() if p.metrics_port}

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
        before, steps_before, threads_before, pulls_before = cpu(), steps(), threads(), pulls()
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
        s["kv_pulls"] = kv_pull_summary(pulls_before, pulls())
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


# -- launching the stack --------------------------------------------------------------------------
def launch_stack(model: str, roles: list[str], devices: list[str], worker_args: list[str],
                 router_args: list[str], log_dir: Path | None = None,
                 role_args: dict[str, list[str]] | None = None) -> LocalStack:
    """Workers (one OS process each, on the device given) and a router in front: the same
    process manager as `tandem up`, logs to files, this checkout on the children's path.
    role_args[role] go to that role's workers after worker_args."""
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return LocalStack(model, roles, devices, worker_args=worker_args, role_args=role_args,
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


# -- reporting -----------------------------------------------------------------------------------
def print_online(runs: list[dict], header: str) -> None:
    print(header)
    print(f"{'rate':>6}{'done':>7}{'dur s':>8}{'req/s':>8}{'out tok/s':>11}"
          f"{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
          f"{'goodput':>9}{'SLO':>6}")
    for run in runs:
        s = run["summary"]
        print(f"{fmt_rate(s['rate']):>6}{s['completed']:>4}/{s['num_requests']:<3}"
              f"{fmt(s['duration_s']):>7}{fmt(s['request_throughput'], '.2f'):>8}"
              f"{fmt(s['output_throughput'], '.0f'):>11}"
              f"{fmt(s['ttft_ms']['p50'], '.0f'):>10}{fmt(s['ttft_ms']['p99'], '.0f'):>9}"
              f"{fmt(s['tpot_ms']['p50']):>10}{fmt(s['tpot_ms']['p99']):>8}"
              f"{fmt(s['itl_ms']['p50']):>9}{fmt(s['itl_ms']['p99']):>8}"
              f"{fmt(s['goodput'], '.2f'):>9}{fmt(s['slo_attainment'], '.0%'):>6}")
        for e in s["errors"][:3]:
            print(f"    error: {e}")
    if runs:
        slo = runs[0]["summary"]["slo"]
        print(f"(ms; goodput in req/s: TTFT <= {slo['ttft_ms']:g} ms and per-request "
              f"{slo['per_request_itl']} ITL <= {slo['itl_ms']:g} ms)")


def _plot_rows(label_prefix: str, runs: list[dict]) -> list[dict]:
    rows = []
    for run in runs:
        s = run["summary"]
        rows.append({"label": f"{label_prefix}rate {fmt_rate(s['rate'])}", "rate": s["rate"],
                     "goodput": s["goodput"], "request_throughput": s["request_throughput"],
                     "output_throughput": s["output_throughput"], **run["_samples"]})
    return rows


# -- command line --------------------------------------------------------------------------------
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
    add_warmup_arg(g)
    g.add_argument("--channels", type=int, default=4, help="gRPC connections per client process")
    g.add_argument("--client-procs", type=int, default=None,
                   help="client processes sharing the requests (default: a quarter of the cores, "
                        "1 to 4): one Python process cannot time 20k+ tokens/s by itself")
    g.add_argument("--request-timeout", type=float, default=3600.0)
    g.add_argument("--cooldown", type=float, default=2.0, help="seconds between rates")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__,
        epilog="Engine flags after `--` go to every worker and to the offline engine.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["online", "offline"], default="online",
                   help="offline: the offline profiler (benchmarks/offline.py) instead")
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
    offline.add_offline_args(p)
    add_output_args(p)
    p.add_argument("--pin", action="store_true",
                   help="one physical core per process (Linux): this client on the first, then "
                        "each launched worker and the router; --mode offline takes the core the "
                        "first worker would get")
    return p


def default_client_procs() -> int:
    return max(1, min(4, (os.cpu_count() or 1) // 4))


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


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else list(argv)
    argv, passthrough = split_passthrough(raw)
    a = build_parser().parse_args(argv)
    command = " ".join(["benchmarks/serve.py", *raw])
    if a.mode == "offline":
        return offline.measure(a, passthrough, command, benchmark="serve")
    if not (a.target or a.launch):
        raise SystemExit("serve.py: give --target HOST:PORT or --launch colocated|disaggregated "
                         "(or --mode offline)")
    if a.launch and not a.model:
        raise SystemExit("serve.py: --model is required with --launch")
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
              "engine_args": passthrough, "environment": environment(), "command": command}
    title = (f"{a.label or Path(a.model or model_id).name} {a.mode} "
             f"{a.launch or ''} {a.workload} x{a.num_requests}")
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
    write_report(report, a, _plot_rows("", runs), title)
    return 1 if sum(r["summary"]["failed"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
