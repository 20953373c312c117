"""Open-loop serving benchmark (the online load generator): a workload sent on a Poisson schedule
through Tandem's public API, to a running router or to a stack this script launches and stops.

    # against a running router (gRPC; --api http for the OpenAI HTTP API)
    python benchmarks/serving/serve.py --target 127.0.0.1:50051 --num-requests 500 --rate 4 8 16
    # start the stack (one worker per device), measure, stop it
    python benchmarks/serving/serve.py --launch colocated --model benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --devices cuda:0 --workload sharegpt --num-requests 1000 --rate inf
    python benchmarks/serving/serve.py --launch disaggregated --num-prefill 1 --num-decode 1 \\
        --devices cuda:0,cuda:1 --workload prompt-heavy --rate 2 4 8 ...
    # the engine alone on the same workload: the offline profiler (benchmarks/serving/offline.py)
    python benchmarks/serving/serve.py --mode offline --model benchmarks/configs/llama-3.1-8b \\
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
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The repository first, even when PYTHONPATH already lists it: the script's own directory
# (a benchmarks/ folder) must not shadow a package of the same name.
sys.path.insert(0, str(ROOT))

from benchmarks.lib.common import (  # noqa: E402
    ITL_STATS,
    add_output_args,
    add_stack_args,
    add_warmup_arg,
    check_lengths,
    counters,
    cuda_names,
    device_name,
    environment,
    model_vocab,
    parse_rate,
    resolve_devices,
    split_passthrough,
    warmup_requests,
    write_report,
)
from benchmarks.lib.procstat import pin_stack  # noqa: E402
from benchmarks.lib.workloads import add_workload_args, build_workload, describe  # noqa: E402
from benchmarks.serving import offline  # noqa: E402
from benchmarks.serving.serve_client import LoadOptions  # noqa: E402
from benchmarks.serving.serve_runs import plot_rows, print_online, run_rates  # noqa: E402
from tandem.cli.launcher import LocalStack  # noqa: E402


# -- launching the stack --------------------------------------------------------------------------
def launch_stack(model: str, roles: list[str], devices: list[str], worker_args: list[str],
                 router_args: list[str], log_dir: Path | None = None,
                 role_args: dict[str, list[str]] | None = None) -> LocalStack:
    """Workers (one OS process each, on the device given) and a router in front: the same
    process manager as `tandem up`, logs to files, this checkout on the children's path.
    role_args[role] go to that role's workers after worker_args."""
    return LocalStack(model, roles, devices, worker_args=worker_args, role_args=role_args,
                      router_args=["--grpc-port", "0", "--http-port", "0", *router_args],
                      log_dir=log_dir, env=launch_env(), metrics=True)


def launch_env() -> dict[str, str]:
    """The launched processes' environment: this checkout first on their path."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


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
    return out + getattr(a, "router_arg", [])


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
                   help="offline: the offline profiler (benchmarks/serving/offline.py) instead")
    tgt = p.add_mutually_exclusive_group()
    tgt.add_argument("--target", default=None,
                     help="a running router: gRPC host:port (--api http: its HTTP host:port)")
    tgt.add_argument("--launch", choices=["colocated", "disaggregated"], default=None)
    p.add_argument("--num-prefill", type=int, default=0)
    p.add_argument("--num-decode", type=int, default=0)
    p.add_argument("--num-both", type=int, default=0,
                   help="colocated workers (default 1 with --launch colocated)")
    p.add_argument("--router-arg", action="append", default=[],
                   help="a flag for the launched router (repeat; --router-arg=--flag=value)")
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
    command = " ".join(["benchmarks/serving/serve.py", *raw])
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
        if stack is not None and "decode" in stack.roles:
            report["kv_pulls"] = asyncio.run(counters(stack))  # over every run, warm-up too
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
    if "kv_pulls" in report:
        k = report["kv_pulls"]
        print(f"KV pulls (every run, warm-up included): {k['blocks']} blocks, {k['bytes'] / 1e9:.2f}"
              f" GB in {k['runs']} copies of adjacent blocks "
              f"({k['blocks'] / max(k['runs'], 1):.1f} blocks a copy), "
              f"{k['bytes'] / max(k['seconds'], 1e-9) / 1e9:.1f} GB per pull second")
    write_report(report, a, plot_rows("", runs), title)
    return 1 if sum(r["summary"]["failed"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
