"""`tandem router`: the public gRPC API and the OpenAI-compatible HTTP API in one process, over
one WorkerSet. Same start-up and shut-down order as the workers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import replace
from pathlib import Path

import structlog

from tandem.engine.config import ModelConfig
from tandem.engine.heap import freeze_startup_heap
from tandem.engine.model_source import resolve_model, served_name
from tandem.engine.tokenizer import Tokenizer, has_tokenizer
from tandem.errors import InvalidArgument
from tandem.router_svc.api_processes import (
    ApiProcesses,
    gather_expositions,
    make_shared_dir,
    merge_expositions,
    publish_metrics_port,
    remove_shared_dir,
    reuse_port_socket,
)
from tandem.router_svc.frontend import Frontend
from tandem.router_svc.grpc_api import TandemServicer
from tandem.router_svc.http_guard import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT_S
from tandem.router_svc.kv_index import DEFAULT_MAX_BLOCKS
from tandem.router_svc.liveness import LoopLag
from tandem.router_svc.membership import Membership, config_from_args
from tandem.router_svc.no_torch import keep_torch_out
from tandem.router_svc.orchestrator import Orchestrator
from tandem.router_svc.planner import Planner, PlannerTargets
from tandem.router_svc.rebalance import RebalanceConfig
from tandem.router_svc.responses_api import DEFAULT_STORE, ResponseStore
from tandem.router_svc.routing import DEFAULT_POLICY, POLICIES, PlacementOptions, make_policy
from tandem.router_svc.routing.placement import DEFAULT_KV_BANDWIDTH
from tandem.router_svc.schema_check import DEFAULT_BUDGET_S, SchemaChecker
from tandem.router_svc.workers import FaultMetrics, WorkerSet
from tandem.runtime.lifecycle import (
    Health,
    check_port_free,
    enable_reflection,
    make_server,
    serve_until_signal,
)
from tandem.runtime.security import (
    ApiKeyInterceptor,
    ClusterTls,
    PublicTls,
    add_cluster_tls_args,
    bind,
    load_api_keys,
    refuse_api_key_flag,
)
from tandem.runtime.telemetry import Telemetry
from tandem.v1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

API_SERVICE = api_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name


def _addresses(values: list[str] | None) -> list[str]:
    return [a for v in values or [] for a in v.split(",") if a]


def model_names(args: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    """The model id served (--served-model-name, default the checkpoint's own name) and the
    other names requests may use for it: --model as given and, for a local path, its absolute
    form."""
    served = args.served_model_name or served_name(args.model)
    path = Path(args.model).expanduser()
    others = {args.model, str(path.resolve())} if path.exists() else {args.model}
    return served, tuple(sorted(others - {served}))


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="run the router (public gRPC + OpenAI HTTP API)")
    add_router_args(p)
    p.set_defaults(func=run)


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the served model (for its tokenizer)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: the checkpoint directory's "
                        "name; --model as given is accepted too)")
    p.add_argument("--prefill", action="append", help="prefill worker address(es), host:port")
    p.add_argument("--decode", action="append", help="decode worker address(es)")
    p.add_argument("--workers", action="append", help="colocated (role both) worker address(es)")
    p.add_argument("--workers-file", default=None,
                   help="a file of 'ROLE HOST:PORT' lines, re-read every --membership-interval: "
                        "workers added there join, workers removed drain")
    p.add_argument("--prefill-dns", action="append",
                   help="NAME:PORT: every address NAME resolves to is a prefill worker, "
                        "re-resolved every --membership-interval (a headless Service)")
    p.add_argument("--decode-dns", action="append", help="NAME:PORT: likewise, decode workers")
    p.add_argument("--membership-interval", type=float, default=5.0,
                   help="seconds between reads of --workers-file and the DNS names")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000, help="0 picks a free port; -1: off")
    p.add_argument("--poll-interval", type=float, default=0.5,
                   help="seconds between polls of each worker's load and health")
    p.add_argument("--worker-timeout", type=float, default=3.0,
                   help="seconds without an answered poll after which a worker counts as lost "
                        "(hung): the requests in flight on it are failed or moved at once")
    p.add_argument("--max-migrations", type=int, default=3,
                   help="times a request may move to another decode worker after its worker "
                        "failed mid-stream (0: never; it then fails UNAVAILABLE)")
    p.add_argument("--prefill-fallback", action=argparse.BooleanOptionalAction, default=True,
                   help="when no prefill worker is up, decode workers prefill prompts "
                        "themselves, in chunks (default: on; --no-prefill-fallback: such "
                        "requests fail UNAVAILABLE)")
    p.add_argument("--prefill-saturation", type=int, default=0,
                   help="with prefill fallback: requests in flight or waiting on every prefill "
                        "worker past which a new prompt is prefilled on its decode worker "
                        "instead (0: only when no prefill worker is up)")
    p.add_argument("--remote-prefix-blocks", type=int, default=0, metavar="N",
                   help="when a worker's host tier that the worker computing a prompt cannot "
                        "read (another host's) holds at least N more of the prompt's leading "
                        "blocks, that worker lends them and the computing worker pulls them "
                        "over the lender's transport instead of computing them "
                        "(docs/host-kv-tier.md; 0: off)")
    p.add_argument("--rebalance", action=argparse.BooleanOptionalAction, default=False,
                   help="move running requests off a decode worker whose KV pool is nearly "
                        "full to one with room, by live migration (default: off)")
    p.add_argument("--rebalance-free-fraction", type=float,
                   default=RebalanceConfig.free_fraction,
                   help="with --rebalance: a decode worker with fewer free KV blocks than this "
                        "share of its pool (or with requests waiting) is nearly full; a "
                        "destination must keep this share free after a move")
    p.add_argument("--rebalance-max-moves", type=int, default=RebalanceConfig.max_moves,
                   help="with --rebalance: moves in flight off one decode worker at a time")
    p.add_argument("--max-requests", type=int, default=1024,
                   help="requests in flight (queued included) before RESOURCE_EXHAUSTED / 429")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default=None,
                   help="reported by GetModelInfo until a worker has told its own (default: "
                        "the workers')")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--routing-policy", choices=sorted(POLICIES), default=DEFAULT_POLICY,
                   help="how each request's workers are picked: " + "; ".join(
                       f"{name}: {policy.summary}" for name, policy in sorted(POLICIES.items())))
    p.add_argument("--placement-short-prompt", type=int, default=0,
                   help="cost-placement: a prompt with at most this many tokens its decode "
                        "worker does not cache is prefilled there, whatever the costs (0: the "
                        "costs alone decide)")
    p.add_argument("--placement-interference", type=float, default=1.0,
                   help="cost-placement: how much the delay a prefill on a decode worker adds "
                        "to that worker's running requests weighs against the request's own "
                        "time to first token (priority 0; 0 for priority < 0, 4x for > 0)")
    p.add_argument("--placement-kv-bandwidth", type=float, default=DEFAULT_KV_BANDWIDTH,
                   help="cost-placement: bytes per second a KV handoff is assumed to move until "
                        "the decode workers have measured their own pulls")
    p.add_argument("--planner-ttft", type=float, default=0.0,
                   help="planner: the time-to-first-token percentile (seconds) to stay under; "
                        "with --planner-itl, the router exports the prefill and decode worker "
                        "counts that meet both as tandem:planner_desired_replicas{role} "
                        "(0: no planner)")
    p.add_argument("--planner-itl", type=float, default=0.0,
                   help="planner: the inter-token-latency percentile (seconds) to stay under")
    p.add_argument("--planner-percentile", type=float, default=0.9,
                   help="planner: which percentile of each window the targets hold (0.9: p90)")
    p.add_argument("--planner-interval", type=float, default=30.0,
                   help="planner: seconds per window (one decision each)")
    p.add_argument("--planner-low-water", type=float, default=0.5,
                   help="planner: below this share of its target (nothing queued), a role "
                        "gives back one worker")
    p.add_argument("--planner-min-replicas", type=int, default=1)
    p.add_argument("--planner-max-replicas", type=int, default=8)
    p.add_argument("--kv-index-max-blocks", type=int, default=DEFAULT_MAX_BLOCKS,
                   help="block hashes the router keeps of what its workers cache, for routing "
                        "(about 78 bytes each: 78 MB for the default 1M); past it the oldest "
                        "are forgotten")
    refuse_api_key_flag(p)
    p.add_argument("--api-key-file", default=None,
                   help="require a bearer token on both public ports: any key in this file, "
                        "one per line, each its own tenant (default: $TANDEM_API_KEY_FILE; "
                        "$TANDEM_API_KEY adds one key). Never a key on the command line")
    p.add_argument("--tls-cert", default=None, help="serve both public ports over TLS with "
                   "this certificate (PEM; with --tls-key)")
    p.add_argument("--tls-key", default=None, help="the private key of --tls-cert (PEM)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest HTTP request body; a larger one is answered 413 unread")
    p.add_argument("--http-read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                   help="seconds an HTTP client has, from a request's first byte, to send all "
                        "of it (line, headers, body); a slower one is disconnected (408)")
    p.add_argument("--grammar-budget", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds a structured-output schema's grammar (response_format, tools "
                        "with tool_choice required or named) may take to build, checked in a "
                        "process of its own; a slower one is refused (400)")
    p.add_argument("--responses-store", type=int, default=DEFAULT_STORE,
                   help="responses the Responses API keeps in memory for previous_response_id "
                        "and GET /v1/responses/{id}, least recently used dropped first "
                        "(0: none kept)")
    p.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=True,
                   help="gRPC server reflection on the public port, for grpcurl and other "
                        "tools (default: on; --no-reflection turns it off)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds to drain in-flight requests (gRPC and HTTP) on SIGTERM")
    p.add_argument("--api-processes", type=int, default=1, metavar="N",
                   help="router processes serving the same ports (SO_REUSEPORT): each takes "
                        "its share of the connections, so a burst of streams is not held up "
                        "by one process's CPU (router_svc/api_processes.py); needs "
                        "--responses-store 0")
    p.add_argument("--api-process-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--api-shared-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ready-file", default=None)
    p.add_argument("--trace-content", action="store_true",
                   help="record prompt and output text in traces (off: never recorded)")
    add_cluster_tls_args(p)


def placement_options(args: argparse.Namespace, cfg: ModelConfig) -> PlacementOptions | None:
    """The --placement-* flags (None: all at their defaults and a policy that places nothing).
    A KV block's bytes come from the model's shape (16-bit unless --dtype says otherwise) until
    the decode workers measure them."""
    try:
        opts = PlacementOptions(args.placement_short_prompt, args.placement_interference,
                                args.placement_kv_bandwidth)
    except ValueError as e:
        flag = str(e).split(" ", 1)[0]
        raise InvalidArgument(flag, str(e)) from None
    if not POLICIES[args.routing_policy].places:
        return None if opts == PlacementOptions() else opts  # make_policy refuses it
    itemsize = {"float32": 4, "float64": 8}.get(args.dtype or "", 2)
    return replace(opts, kv_block_bytes=(cfg.num_layers * 2 * args.block_size
                                         * cfg.num_kv_heads * cfg.head_dim * itemsize))


def planner_targets(args: argparse.Namespace) -> PlannerTargets | None:
    """The --planner-* flags (None: no planner)."""
    if not (args.planner_ttft or args.planner_itl):
        return None
    if not args.planner_interval > 0:
        raise InvalidArgument("--planner-interval", f"must be > 0, got {args.planner_interval}")
    try:
        return PlannerTargets(args.planner_ttft, args.planner_itl, args.planner_percentile,
                              args.planner_low_water, args.planner_min_replicas,
                              args.planner_max_replicas)
    except ValueError as e:
        raise InvalidArgument(str(e).split(" ", 1)[0], str(e)) from None


async def serve(args: argparse.Namespace, stop_event: asyncio.Event | None = None,
                telemetry: Telemetry | None = None, shared_dir: Path | None = None) -> int:
    """`telemetry`: the process's logging, tracing and metrics, as run() sets them up (default:
    tracing off, metrics unserved but for /metrics). `shared_dir`: where a group of API
    processes finds each other's metrics (run() makes it for the primary). Returns the exit
    code."""
    telemetry = telemetry or Telemetry("router")
    prefill, decode, both = (_addresses(a) for a in (args.prefill, args.decode, args.workers))
    learnt = config_from_args(args.workers_file, args.prefill_dns, args.decode_dns,
                              args.membership_interval)
    if not (prefill or decode or both or learnt.enabled):
        raise InvalidArgument("--prefill", "give --prefill and --decode, or --workers, or a "
                                           "--workers-file or --prefill-dns and --decode-dns")
    if not learnt.enabled and bool(prefill) != bool(decode):
        raise InvalidArgument("--prefill" if decode else "--decode",
                              "prefill and decode workers go together")
    if args.prefill_saturation < 0:
        raise InvalidArgument("--prefill-saturation",
                              f"must be >= 0, got {args.prefill_saturation}")
    if args.remote_prefix_blocks < 0:
        raise InvalidArgument("--remote-prefix-blocks",
                              f"must be >= 0, got {args.remote_prefix_blocks}")
    if args.max_body_bytes < 1:
        raise InvalidArgument("--max-body-bytes", f"must be >= 1, got {args.max_body_bytes}")
    if args.responses_store < 0:
        raise InvalidArgument("--responses-store", f"must be >= 0, got {args.responses_store}")
    if not args.grammar_budget > 0:
        raise InvalidArgument("--grammar-budget", f"must be > 0, got {args.grammar_budget}")
    if not args.http_read_timeout > 0:
        raise InvalidArgument("--http-read-timeout", f"must be > 0, got {args.http_read_timeout}")
    if args.api_processes < 1:
        raise InvalidArgument("--api-processes", f"must be >= 1, got {args.api_processes}")
    # In a group of API processes (the primary of several, or one it started).
    grouped = args.api_processes > 1 or args.api_process_index > 0
    if grouped and args.responses_store:
        raise InvalidArgument("--api-processes", "stored responses live in one process, and "
                              "a follow-up may reach another: give --responses-store 0")
    if args.api_processes > 1:
        # The ports are bound shareable (SO_REUSEPORT): first make sure no other server holds
        # them, which would then quietly take a share of the connections.
        check_port_free(args.host, args.grpc_port, "--grpc-port")
        check_port_free(args.host, args.http_port, "--http-port")
    cluster_tls = ClusterTls.from_args(args)
    if cluster_tls is not None:
        cluster_tls.check_role("router")
    exit_code = [0]
    public_tls = PublicTls.from_args(args)
    api_keys = load_api_keys(key_file=args.api_key_file)
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer(model_dir) if has_tokenizer(model_dir) else None
    policy = make_policy(args.routing_policy, placement_options(args, cfg))
    workers = WorkerSet(prefill, decode, both, block_size=args.block_size,
                        poll_interval_s=args.poll_interval,
                        worker_timeout_s=args.worker_timeout,
                        metrics=FaultMetrics(telemetry.metrics.registry), tls=cluster_tls,
                        kv_index_max_blocks=args.kv_index_max_blocks,
                        policy=policy,
                        prefill_fallback=args.prefill_fallback)
    targets = planner_targets(args)
    # One planner per fleet: the primary API process's.
    planner = (Planner(targets, telemetry.metrics.registry, workers, args.planner_interval)
               if targets is not None and args.api_process_index == 0 else None)
    orchestrator = Orchestrator(workers, max_migrations=args.max_migrations,
                                prefill_saturation=args.prefill_saturation,
                                rebalance=RebalanceConfig(args.rebalance,
                                                          args.rebalance_free_fraction,
                                                          args.rebalance_max_moves),
                                remote_prefix_blocks=args.remote_prefix_blocks)
    served, aliases = model_names(args)
    info = Frontend.model_info(served, cfg, args.dtype or "", args.block_size,
                               args.max_model_len, aliases)
    # Started on the first schema: a router never asked for one runs no checker process.
    schemas = (SchemaChecker(model_dir, cfg.vocab_size, cfg.eos_token_ids, args.grammar_budget)
               if tokenizer is not None else None)
    frontend = Frontend(tokenizer, orchestrator, info, args.max_requests, telemetry, schemas)

    interceptors = list(telemetry.tracing.server_interceptors())
    if api_keys:
        # Innermost: refused before the servicer runs, inside the tracing interceptors, so that
        # a refusal is traced like any other call.
        interceptors.append(ApiKeyInterceptor(api_keys))
    server = make_server(interceptors, reuse_port=grouped)
    grpc_port = bind(server, args.host, args.grpc_port,
                     public_tls.server_credentials() if public_tls else None)
    api_pb2_grpc.add_TandemServicer_to_server(TandemServicer(frontend, (args.host, grpc_port)),
                                              server)
    health = Health(server, [API_SERVICE])
    if args.reflection:
        enable_reflection(server, [API_SERVICE])
    membership = Membership(learnt, workers.set_members)
    loop_lag = LoopLag(workers.metrics.loop_lag)
    loop_lag.start()
    if learnt.enabled:
        await membership.refresh()  # the workers known at start, polled by start()
    await workers.start()
    if learnt.enabled:
        await membership.start()
    if planner is not None:
        planner.start()
    orchestrator.start()
    # gRPC readiness says what HTTP /health/ready says: NOT_SERVING while no path through the
    # workers can take a request (liveness stays SERVING).
    workers.on_health = lambda: health.depend(workers.ready())
    await health.depend(workers.ready())

    http = None
    http_port = None
    if args.http_port >= 0:
        from starlette.responses import Response  # noqa: PLC0415
        from starlette.routing import Route  # noqa: PLC0415

        from tandem.router_svc.http_api import HttpServer  # noqa: PLC0415 - FastAPI, HTTP only

        async def metrics(_request) -> Response:
            body, content_type = telemetry.metrics.exposition()
            if shared_dir is not None:  # every API process's series
                body = merge_expositions(await gather_expositions(
                    shared_dir, args.api_process_index, body))
            return Response(body, media_type=content_type)

        http = HttpServer(frontend, workers, args.host, args.http_port, api_keys,
                          sock=reuse_port_socket(args.host, args.http_port) if grouped
                          else None,
                          routes=[Route("/metrics", metrics, methods=["GET"])],
                          grace_s=args.grace, tls=public_tls,
                          max_body_bytes=args.max_body_bytes,
                          read_timeout_s=args.http_read_timeout,
                          responses_store=ResponseStore(args.responses_store))
        http_port = await http.start()

    others: ApiProcesses | None = None
    if shared_dir is not None and http is not None:  # read by the others' /metrics
        publish_metrics_port(shared_dir, args.api_process_index,
                             telemetry.metrics.serve("127.0.0.1", 0, any_port=True))
    if args.api_processes > 1:
        others = ApiProcesses(args.command_argv, args.api_processes, grpc_port,
                              -1 if http_port is None else http_port, shared_dir)
        await others.start()
        stop_event = stop_event or asyncio.Event()
        watch = asyncio.create_task(_watch(others, stop_event, exit_code))

    def ready() -> None:
        log.info("router: gRPC on %s:%d, HTTP on %s, %d workers", args.host, grpc_port,
                 f"{args.host}:{http_port}" if http else "off", len(workers.workers))
        freeze_startup_heap()
        if args.ready_file:
            tmp = f"{args.ready_file}.tmp"
            with open(tmp, "w") as f:
                f.write(f"{grpc_port} {http_port or 0}")
            os.replace(tmp, args.ready_file)

    async def stop() -> None:
        if others is not None:
            watch.cancel()
        telemetry.metrics.stop()
        await loop_lag.close()
        if planner is not None:
            await planner.close()
        if schemas is not None:
            await schemas.close()
        await membership.close()
        await orchestrator.close()
        await workers.close()

    # HTTP drains alongside gRPC: both refuse new requests from SIGTERM on.
    drain_also = [http.stop] if http else []
    if others is not None:
        drain_also.append(others.stop)  # they drain alongside this one
    await serve_until_signal(server, health, grace_s=args.grace, on_stop=stop, ready=ready,
                             stop_event=stop_event, drain_also=drain_also)
    return exit_code[0]


async def _watch(others: ApiProcesses, stop: asyncio.Event, exit_code: list[int]) -> None:
    """The primary stops (exit code 1) when another API process dies: a supervisor restarts
    the whole router, rather than its ports serving on with a share of the connections lost."""
    index, code = await others.wait_any_exit()
    if not others.stopping:
        log.error("router API process %d exited with %s: stopping the router", index, code)
        exit_code[0] = 1
        stop.set()


def run(args: argparse.Namespace) -> int:
    # A built-in or GGUF model's directory is made on its first use, with torch; once made
    # (`tandem up` makes it before starting the router), the router's process stays torch-free.
    resolve_model(args.model)
    torch_free = keep_torch_out()
    telemetry = Telemetry.start("router", model_names(args)[0],
                                capture_content=args.trace_content)
    if not torch_free:
        log.info("torch is loaded (the model's directory was built by this process): the "
                 "router keeps it")
    shared_dir = Path(args.api_shared_dir) if args.api_shared_dir else None
    made = shared_dir is None and args.api_processes > 1
    if args.api_processes > 1 or args.api_process_index > 0:  # on every log line
        structlog.contextvars.bind_contextvars(api_process=args.api_process_index)
    if made:
        shared_dir = make_shared_dir()
    try:
        return asyncio.run(serve(args, telemetry=telemetry, shared_dir=shared_dir))
    finally:
        telemetry.shutdown()  # flush spans still buffered
        if made:
            remove_shared_dir(shared_dir)
