"""What every worker role shares: flags, engine construction, the Abort and GetLoad RPCs, error
mapping, and the run loop. Prefill (prefill_svc) and decode/colocated (decode_svc) servicers
derive from WorkerServicer."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from tandem.engine.serving.async_engine import AsyncEngine, EngineDead, RequestAborted
from tandem.engine.serving.core_messages import CoreSpec, LeaseDone
from tandem.errors import InvalidArgument, LayoutMismatch, ModelLoadError, Overloaded
from tandem.kvtransfer import transports
from tandem.runtime.cluster_roles import RoleInterceptor
from tandem.runtime.engine_args import add_engine_args, engine_config
from tandem.runtime.kv_events import KVEventHub, SubscriberLagged
from tandem.runtime.lifecycle import Health, enable_reflection, make_server, serve_until_signal
from tandem.runtime.security import ClusterTls, add_cluster_tls_args
from tandem.runtime.security import bind as bind_port
from tandem.runtime.step_pace import StepPace
from tandem.runtime.telemetry import Telemetry, configure_process_logging
from tandem.runtime.worker_inputs import check_request_id
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# How often a drain looks again at what the worker still holds (the engine's snapshot).
DRAIN_POLL_S = 0.1


def add_worker_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    g = p.add_argument_group("service")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback: only this machine's "
                        "processes reach the worker); without cluster TLS only a loopback "
                        "address, unless --insecure")
    g.add_argument("--insecure", action="store_true",
                   help="without cluster TLS, listen on a non-loopback --host anyway, and "
                        "(decode) take KV from prefill workers on other hosts: whoever reaches "
                        "the port may then call the worker as router or decode worker, read "
                        "its KV and plant KV in its cache. For networks that authenticate "
                        "peers themselves (a service mesh's mutual TLS)")
    g.add_argument("--port", type=int, default=0, help="gRPC port (0: pick a free one)")
    g.add_argument("--worker-id", default=None, help="default: ROLE@HOST:PORT")
    g.add_argument("--grace", type=float, default=30.0,
                   help="seconds to drain in-flight requests on SIGTERM")
    g.add_argument("--reflection", action="store_true", help="enable gRPC server reflection")
    g.add_argument("--ready-file", default=None,
                   help="write the bound port here once serving (used by `tandem up`)")
    g.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics at /metrics on this port (0: off)")
    g.add_argument("--cpu-threads", type=_at_least_one, default=None,
                   help="torch CPU threads of the engine core (default: every core on the "
                        "CPU, 1 on a GPU); engine cores sharing a machine need their share")
    add_cluster_tls_args(p)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class WorkerError(Exception):
    """A request failed on this worker with the gRPC status its caller should see."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status that reports an engine or worker error to the caller."""
    if isinstance(exc, WorkerError):
        return exc.code, exc.message
    for kind, code in ((EngineDead, grpc.StatusCode.UNAVAILABLE),
                       (RequestAborted, grpc.StatusCode.ABORTED),
                       (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
                       (LayoutMismatch, grpc.StatusCode.FAILED_PRECONDITION),
                       (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
                       (ModelLoadError, grpc.StatusCode.NOT_FOUND)):
        if isinstance(exc, kind):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def abort_for(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the status that reports `exc` (this raises)."""
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        raise exc  # logged by gRPC; the caller sees UNKNOWN
    await context.abort(code, message)


async def checked(context: grpc.aio.ServicerContext, check: Callable[..., None],
                  *args: object) -> None:
    """Run `check(*args)`; an InvalidArgument it raises ends the RPC with INVALID_ARGUMENT."""
    try:
        check(*args)
    except InvalidArgument as e:
        await abort_for(context, e)


@dataclass
class DrainTally:
    """What a drain did: requests moved elsewhere, finished here, still held at its end."""

    moved: int = 0
    finished: int = 0
    left: int = 0


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    role = "both"
    # Mutual TLS toward peers (decode -> prefill), as run_worker sets it; None: plaintext.
    cluster_tls: ClusterTls | None = None
    insecure = False  # --insecure: plaintext beyond loopback
    pace = StepPace()  # how fast its engine steps lately (run_worker gives each its own)

    def __init__(self, engine: AsyncEngine, worker_id: str) -> None:
        self.engine = engine
        self.worker_id = worker_id
        # This process, among the ones that served as worker_id: a restart gets a new one.
        self.instance_id = secrets.token_hex(8)
        self.telemetry = Telemetry(self.role)  # run_worker sets the process's
        # What the prefix cache holds, for routers (WatchKV); fed by the engine core's events.
        self.kv_events = KVEventHub(engine.snapshot.block_size, self.instance_id,
                                    host_tier_id=engine.info.host_tier_id)
        engine.on_kv_events = self.kv_events.publish
        # Draining (Drain, SIGTERM): new requests refused, Load.draining set; `drained` once
        # the role's evacuation is over (run_worker then stops the server).
        self.draining = False
        self.drained = asyncio.Event()
        self.drain_tally = DrainTally()
        self.drain_seconds = 0.0
        self.request_stop: Callable[[], None] = lambda: None  # run_worker sets it

    # -- the lease RPCs: every role lends KV (a prefill worker its prompts', a decode worker its
    # running sequences' for live migration, either a cached prefix) through `self.leases`, a
    # LeaseRPCs (runtime/lease_rpcs.py) each role's servicer makes.
    async def Register(self, request, context):  # noqa: N802
        return await self.leases.register(request, context)

    async def ClaimLease(self, request, context):  # noqa: N802
        return await self.leases.claim(request, context)

    async def Release(self, request, context):  # noqa: N802
        return await self.leases.release(request, context)

    async def RenewLeases(self, request, context):  # noqa: N802
        return await self.leases.renew(request, context)

    async def LendPrefix(self, request, context):  # noqa: N802
        return await self.leases.lend_prefix(request, context, self.address, self.role,
                                             self.draining)

    async def Abort(self, request, context):  # noqa: N802 - gRPC method name
        await checked(context, check_request_id, request.request_id)
        return worker_pb2.AbortResponse(aborted=await self.engine.abort(request.request_id))

    async def GetLoad(self, request, context):  # noqa: N802
        s = self.engine.snapshot
        return worker_pb2.Load(
            worker_id=self.worker_id, role=self.role, num_running=s.num_running,
            num_waiting=s.num_waiting, num_free_blocks=s.num_free_blocks,
            num_blocks=s.num_blocks, num_leases=s.num_leases, block_size=s.block_size,
            num_requests=s.num_requests_added, prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits, dtype=self.engine.spec.config.dtype,
            instance_id=self.instance_id, prompt_tokens_computed=s.prompt_tokens_computed,
            kv_blocks_pulled=s.kv_blocks_pulled, kv_bytes_pulled=s.kv_bytes_pulled,
            kv_runs_pulled=s.kv_runs_pulled, kv_pull_seconds=s.kv_pull_seconds,
            draining=self.draining, step_seconds=self.pace.step_seconds,
            prompt_token_seconds=self.pace.prompt_token_seconds,
            kv_blocks_migrated=s.kv_blocks_migrated, migrations_in=s.migrations_in,
            host_kv_blocks_restored=s.host_kv_hits, host_kv_bytes_used=s.host_kv_bytes_used,
            host_kv_bytes_allocated=s.host_kv_bytes_allocated,
            host_kv_capacity_bytes=s.host_kv_capacity_bytes)

    async def Drain(self, request, context):  # noqa: N802
        """Take this worker out without dropping a request (the same as SIGTERM): answered once
        the evacuation is over, before the server stops."""
        self.request_stop()
        await self.drained.wait()
        t = self.drain_tally
        return worker_pb2.DrainResponse(moved=t.moved, finished=t.finished, left=t.left,
                                        seconds=self.drain_seconds)

    async def Move(self, request, context):  # noqa: N802
        """Move one running request elsewhere: a decode worker's (DecodeServicer) alone."""
        await checked(context, check_request_id, request.request_id)
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"worker {self.worker_id} has role {self.role}: only a decode "
                            "worker's requests move")

    async def run_drain(self, grace_s: float) -> None:
        """Stop taking requests and evacuate (the role's `evacuate`) within `grace_s`, while the
        server still answers; what is left then is the server's graceful stop's to cut."""
        self.draining = True
        t0 = time.monotonic()
        try:
            if not self.engine.dead:  # a worker whose core died has nothing to evacuate
                await asyncio.wait_for(self.evacuate(), grace_s)
        except TimeoutError:
            log.warning("drain: the grace period (%.0f s) ran out", grace_s)
        except EngineDead:
            log.warning("drain: the engine core died")
        self.drain_tally.left = self.still_held()
        self.drain_seconds = time.monotonic() - t0
        t = self.drain_tally
        log.info("drained: %d requests moved, %d finished here, %d left, in %.2f s", t.moved,
                 t.finished, t.left, self.drain_seconds)
        self.drained.set()

    async def WatchKV(self, request, context):  # noqa: N802
        try:
            async for msg in self.kv_events.watch():
                yield msg
        except SubscriberLagged:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "fell too far behind the prefix-cache events: subscribe again")

    def lease_done(self, done: LeaseDone) -> None:
        """Hook, decode role: the engine core is done with a prefill worker's lease."""

    async def on_start(self) -> None:
        """Hook: after the server is up (e.g. register with peers)."""

    async def on_stop(self) -> None:
        """Hook: after the server stopped, before the engine shuts down."""

    async def drain(self) -> None:
        """Hook: shutting down; new calls are refused, in-flight requests finish. Runs alongside
        the server's graceful stop."""

    async def evacuate(self) -> None:
        """Hook: draining, with the server still up; return once nothing is left here (a
        colocated worker's requests finish in place: nothing holds their KV elsewhere)."""
        while self.still_held():
            await self.engine.refresh()
            await asyncio.sleep(DRAIN_POLL_S)

    def still_held(self) -> int:
        """Requests (or leases) this worker holds that a drain waits for."""
        return self.engine.num_requests()


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, or a name) is this machine's loopback: only 'localhost' among
    names, since another name could resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(args: argparse.Namespace, tls: ClusterTls | None, role: str) -> None:
    """With cluster TLS: the certificate must be this role's. Without: say so at start, and
    listen on loopback only unless --insecure."""
    if tls is not None:
        tls.check_role(role)
        return
    insecure = getattr(args, "insecure", False)
    if not is_loopback(args.host) and not insecure:
        raise InvalidArgument("--host", f"{args.host} is not a loopback address: without "
                              "cluster TLS (--cluster-ca, --cluster-cert, --cluster-key) a "
                              "worker listens there only with --insecure")
    log.warning("NO CLUSTER TLS: any process that reaches this %s worker (%s) can call it as "
                "a router or a decode worker (send it requests, claim its KV, plant KV in its "
                "cache); %s", role, args.host,
                "listening beyond loopback (--insecure)" if insecure else
                "listening on loopback only. `tandem up` and `tandem certs` make a cluster CA")


def bind(server: grpc.aio.Server, host: str, port: int,
         credentials: grpc.ServerCredentials | None = None) -> int:
    return bind_port(server, host, port, credentials)


async def run_worker(args: argparse.Namespace, role: str,
                     make_servicer: Callable[[AsyncEngine, str, str], WorkerServicer],
                     telemetry: Telemetry | None = None, transport: str | None = None,
                     lease_ttl_s: float = 30.0, lease_max_life_s: float | None = None) -> int:
    """engine core → servicer → health (+ reflection) → start → signal → drain → stop.
    Returns the exit code: 1 when the engine core died under the server."""
    telemetry = telemetry or Telemetry(role)
    metrics = telemetry.metrics
    stop = asyncio.Event()
    died = False

    def on_death() -> None:
        nonlocal died
        died = True
        stop.set()

    tls = ClusterTls.from_args(args)  # bad flags fail before the engine loads
    check_exposure(args, tls, role)
    spec = CoreSpec(engine_config(args, role=role), role, transport, lease_ttl_s,
                    lease_max_life_s, args.host,
                    transports.SiteTls.read(tls) if tls is not None else None,
                    cpu_threads=args.cpu_threads,
                    process_setup=configure_process_logging)
    pace = StepPace()

    def on_step(stats, outputs, end) -> None:
        metrics.on_step(stats, outputs, end)
        pace.observe(stats)

    engine = AsyncEngine(spec, on_step=on_step, on_abort=metrics.on_abort,
                         on_death=on_death)
    await engine.start()
    try:
        metrics.bind_engine(lambda: engine.snapshot)
        metrics.watch_engine_core(engine.info.pid)
        # With cluster TLS, every call's caller is checked against its role first.
        roles = [RoleInterceptor(role)] if tls is not None else []
        server = make_server([*roles, *telemetry.tracing.server_interceptors()])
        # With a cluster CA, a caller without a client certificate it signed is refused.
        port = bind(server, args.host, args.port, tls.server_credentials() if tls else None)
        host = args.host if args.host not in ("0.0.0.0", "::") else socket.gethostname()
        address = f"{host}:{port}"
        worker_id = args.worker_id or f"{role}@{address}"
        servicer = make_servicer(engine, worker_id, address)
        servicer.telemetry = telemetry
        servicer.pace = pace
        servicer.cluster_tls = tls
        servicer.insecure = getattr(args, "insecure", False)
        engine.on_lease_done = servicer.lease_done
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        health = Health(server, [WORKER_SERVICE])
        if args.reflection:
            enable_reflection(server, [WORKER_SERVICE])

        def ready() -> None:
            log.info("%s serving on %s (pid %d, engine core pid %d)", worker_id, address,
                     os.getpid(), engine.info.pid)
            if args.ready_file:
                tmp = f"{args.ready_file}.tmp"
                with open(tmp, "w") as f:
                    f.write(str(port))
                os.replace(tmp, args.ready_file)

        await servicer.on_start()
        metrics.serve(args.host, args.metrics_port)
        servicer.request_stop = stop.set
        await serve_until_signal(server, health, grace_s=args.grace, on_stop=servicer.on_stop,
                                 ready=ready, stop_event=stop, drain_also=[servicer.drain,
                                                         servicer.kv_events.close],
                                 evacuate=None if died else servicer.run_drain)
    finally:
        await engine.shutdown()
    return 1 if died else 0


def main_worker(args: argparse.Namespace, role: str, make_servicer, **kw) -> int:
    telemetry = Telemetry.start(role, Path(args.model).name)
    try:
        return asyncio.run(run_worker(args, role, make_servicer, telemetry=telemetry, **kw))
    finally:
        telemetry.shutdown()  # flush spans still buffered
