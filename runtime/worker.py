"""What every worker role shares: flags, engine construction, the Abort and GetLoad RPCs, error
mapping, and the run loop. Prefill (prefill_svc) and decode/colocated (decode_svc) servicers
derive from WorkerServicer."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from tandem.engine.heap import freeze_startup_heap
from tandem.engine.serving.async_engine import AsyncEngine, EngineDead, RequestAborted
from tandem.engine.serving.core_messages import CoreSpec, LeaseDone
from tandem.errors import InvalidArgument, LayoutMismatch, ModelLoadError, Overloaded
from tandem.kvtransfer import transports
from tandem.runtime.cluster_roles import RoleInterceptor
from tandem.runtime.engine_args import add_engine_args, engine_config
from tandem.runtime.kv_events import KVEventHub, SubscriberLagged
from tandem.runtime.lifecycle import (
    DRAINING_METADATA,
    Health,
    close_server,
    enable_reflection,
    ignore_further_sigterm,
    make_server,
    shut_down,
    stop_on_signals,
)
from tandem.runtime.metrics import Metrics
from tandem.runtime.role_switch import (
    PendingSwitch,
    RoleOptions,
    SwitchChecks,
    Switched,
    SwitchFailed,
    add_switch_args,
    role_certificates,
)
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
    add_switch_args(p)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class WorkerError(Exception):
    """A request failed on this worker with the gRPC status its caller should see.
    `draining`: refused because the worker drains (the status carries DRAINING_METADATA; a
    Stream call's update says so). `lease_returned`: a decode request refused before its lease
    was claimed, the lease neither claimed nor released: its router's again."""

    def __init__(self, code: grpc.StatusCode, message: str, draining: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.draining = draining
        self.lease_returned = False


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
    draining = isinstance(exc, WorkerError) and exc.draining
    await context.abort(code, message, (DRAINING_METADATA,) if draining else ())


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
    # Mutual TLS toward peers (decode -> prefill), as its RoleFront sets it; None: plaintext.
    cluster_tls: ClusterTls | None = None
    insecure = False  # --insecure: plaintext beyond loopback
    pace = StepPace()  # how fast its engine steps lately (its RoleFront gives each its own)

    def __init__(self, engine: AsyncEngine, worker_id: str) -> None:
        self.engine = engine
        self.worker_id = worker_id
        # This process, among the ones that served as worker_id: a restart gets a new one.
        self.instance_id = secrets.token_hex(8)
        self.telemetry = Telemetry(self.role)  # its RoleFront sets the role's
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
        # A role change in place (SwitchRole): what this process may switch to (run_worker
        # sets it), and the change asked, which the run loop does once woken (request_stop).
        self.switch_checks: SwitchChecks | None = None
        self.switch: PendingSwitch | None = None

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

    async def SwitchRole(self, request, context):  # noqa: N802
        """Change role in place (runtime/role_switch.py): checked first (nothing drained when
        refused), then drained and switched by the run loop; answered once the new role's port
        serves."""
        role = request.role
        if role not in ("prefill", "decode"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"role: must be prefill or decode, got {role[:32]!r}")
        checks = self.switch_checks
        why = ("it cannot change role in place" if checks is None
               else checks.refusal(self.role, role))
        if why is None and (self.draining or self.switch is not None):
            why = "it drains already"
        if why is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.worker_id} does not become a {role} worker: {why}")
        self.switch = PendingSwitch(role, asyncio.get_running_loop().create_future())
        log.info("asked to become a %s worker", role)
        self.request_stop()
        try:
            # Shielded: the caller leaving does not stop the change, which has begun.
            done: Switched = await asyncio.shield(self.switch.result)
        except SwitchFailed as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        t = self.drain_tally
        return worker_pb2.SwitchRoleResponse(
            address=done.address, worker_id=done.worker_id, moved=t.moved, finished=t.finished,
            left=t.left, drain_seconds=self.drain_seconds, switch_seconds=done.seconds)

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


@dataclass
class RoleFront:
    """What a worker process shows for one role: the role's servicer on a gRPC server of its
    own (its port, its certificate, its health), its metrics and step pace. The engine core
    behind it is the process's. A process has one front, and two for the moment of a role
    change in place (runtime/role_switch.py), when the new one serves before the old closes."""

    role: str
    servicer: WorkerServicer
    server: grpc.aio.Server
    health: Health
    address: str
    port: int
    telemetry: Telemetry
    pace: StepPace

    @classmethod
    def open(cls, args: argparse.Namespace, engine: AsyncEngine, opts: RoleOptions,
             tls: ClusterTls | None, port: int, telemetry: Telemetry,
             worker_id: str | None = None) -> RoleFront:
        """Built and bound, not serving yet; engine events go to it from here on."""
        # With cluster TLS, every call's caller is checked against its role first.
        roles = [RoleInterceptor(opts.name)] if tls is not None else []
        server = make_server([*roles, *telemetry.tracing.server_interceptors()])
        # With a cluster CA, a caller without a client certificate it signed is refused.
        port = bind(server, args.host, port, tls.server_credentials() if tls else None)
        host = args.host if args.host not in ("0.0.0.0", "::") else socket.gethostname()
        address = f"{host}:{port}"
        servicer = opts.make_servicer(engine, worker_id or f"{opts.name}@{address}", address)
        front = cls(opts.name, servicer, server, Health(server, [WORKER_SERVICE]), address, port,
                    telemetry, StepPace())
        servicer.telemetry = telemetry
        servicer.pace = front.pace
        servicer.cluster_tls = tls
        servicer.insecure = getattr(args, "insecure", False)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        if args.reflection:
            enable_reflection(server, [WORKER_SERVICE])
        metrics = telemetry.metrics
        engine.on_step, engine.on_abort = front.on_step, metrics.on_abort
        engine.on_lease_done = servicer.lease_done
        metrics.bind_engine(lambda: engine.snapshot)
        metrics.watch_engine_core(engine.info.pid)
        return front

    def on_step(self, stats, outputs, end) -> None:
        self.telemetry.metrics.on_step(stats, outputs, end)
        self.pace.observe(stats)

    async def start(self, args: argparse.Namespace, engine: AsyncEngine) -> None:
        """Serving: its servicer's start hook, metrics, the server, SERVING, the ready file."""
        await self.servicer.on_start()
        self.telemetry.metrics.serve(args.host, args.metrics_port)
        await self.server.start()
        await self.health.set(True)
        log.info("%s serving on %s (pid %d, engine core pid %d)", self.servicer.worker_id,
                 self.address, os.getpid(), engine.info.pid)
        freeze_startup_heap()
        if args.ready_file:
            tmp = f"{args.ready_file}.tmp"
            with open(tmp, "w") as f:
                f.write(str(self.port))
            os.replace(tmp, args.ready_file)

    async def shut_down(self, grace_s: float, evacuate: bool) -> None:
        """The process stops: drained (unless its engine died), then the server's graceful
        stop, then the servicer's own."""
        s = self.servicer
        await shut_down(self.server, self.health, grace_s=grace_s, on_stop=s.on_stop,
                        drain_also=[s.drain, s.kv_events.close],
                        evacuate=s.run_drain if evacuate else None)


async def change_role(args: argparse.Namespace, engine: AsyncEngine, front: RoleFront,
                      pending: PendingSwitch, checks: SwitchChecks) -> RoleFront | None:
    """A SwitchRole call's work (runtime/role_switch.py): drain `front`, switch the engine
    core, open and start the new role's front, answer the call, close `front`. The new front,
    or None when the change failed after the drain (the call is told why; the old front is
    closed and the worker stops, drained)."""
    t0 = time.monotonic()
    log.info("changing role from %s to %s: draining", front.role, pending.role)
    await front.health.set(False)
    await front.servicer.run_drain(args.grace)
    drained = time.monotonic()
    new = None
    try:
        if front.servicer.drain_tally.left:
            raise RuntimeError(f"{front.servicer.drain_tally.left} requests or leases were "
                               "still held when the drain's grace ran out")
        opts, tls = checks.roles[pending.role], checks.certs.get(pending.role)
        await engine.switch_role(pending.role, opts.lease_ttl_s, opts.lease_max_life_s,
                                 transports.SiteTls.read(tls) if tls is not None else None)
        telemetry = Telemetry(opts.name, front.telemetry.tracing,
                              Metrics(opts.name, front.telemetry.metrics.model_name),
                              capture_content=front.telemetry.capture_content)
        new = RoleFront.open(args, engine, opts, tls, 0, telemetry)
        # At once (no await in between): the engine's next prefix-cache change reaches the
        # new front's set, which starts from the old one's.
        new.servicer.kv_events.adopt(front.servicer.kv_events)
        new.servicer.request_stop = front.servicer.request_stop
        new.servicer.switch_checks = checks
        front.telemetry.metrics.stop()  # its port is the new front's
        await new.start(args, engine)
    except Exception as e:  # told to the caller; the worker stops
        log.exception("drained, but could not change role to %s", pending.role)
        pending.result.set_exception(SwitchFailed(
            f"drained, but could not become a {pending.role} worker ({e}): it stops"))
        front.telemetry.metrics.stop()
        if new is not None:
            new.telemetry.metrics.stop()
            with contextlib.suppress(Exception):
                await close_server(new.server, 0)
        await _close_front(front, args.grace, t0)
        return None
    done = Switched(new.address, new.servicer.worker_id, time.monotonic() - drained)
    pending.result.set_result(done)
    log.info("now a %s worker on %s (drained in %.2f s, switched in %.2f s)", pending.role,
             new.address, drained - t0, done.seconds)
    await _close_front(front, args.grace, t0)
    return new


async def _close_front(front: RoleFront, grace_s: float, t0: float) -> None:
    """A drained front's server stops (the SwitchRole call in flight answered), then its
    servicer's own shut-down (its peers' channels, its background calls)."""
    left = max(grace_s - (time.monotonic() - t0), 1.0)
    await close_server(front.server, left, [front.servicer.drain,
                                            front.servicer.kv_events.close])
    await front.servicer.on_stop()


async def run_worker(args: argparse.Namespace, start: RoleOptions,
                     telemetry: Telemetry | None = None,
                     also: Sequence[RoleOptions] = ()) -> int:
    """engine core → servicer → health (+ reflection) → start → signal → drain → stop; between
    start and signal, a role change in place for each SwitchRole call (to a role of `also`).
    Returns the exit code: 1 when the engine core died under the server."""
    role = start.name
    telemetry = telemetry or Telemetry(role)
    stop = asyncio.Event()
    ended = {"died": False, "signalled": False}

    def on_death() -> None:
        ended["died"] = True
        stop.set()

    def on_signal() -> None:
        ended["signalled"] = True
        stop.set()

    tls = ClusterTls.from_args(args)  # bad flags fail before the engine loads
    check_exposure(args, tls, role)
    certs = role_certificates(args, tls, role)
    spec = CoreSpec(engine_config(args, role=role), role, start.transport, start.lease_ttl_s,
                    start.lease_max_life_s, args.host,
                    transports.SiteTls.read(tls) if tls is not None else None,
                    cpu_threads=args.cpu_threads,
                    process_setup=configure_process_logging)
    engine = AsyncEngine(spec, on_death=on_death)
    await engine.start()
    front = None
    try:
        checks = SwitchChecks(engine, {o.name: o for o in (start, *also)}, certs,
                              tls=tls is not None, loopback=is_loopback(args.host))
        front = RoleFront.open(args, engine, start, tls, args.port, telemetry, args.worker_id)
        front.servicer.request_stop = stop.set
        front.servicer.switch_checks = checks
        stop_on_signals(on_signal)
        await front.start(args, engine)
        while True:
            await stop.wait()
            pending = front.servicer.switch
            if pending is None or ended["died"] or ended["signalled"]:
                break
            stop.clear()  # from here, a stop is a new ask (a signal, the engine's death)
            front = await change_role(args, engine, front, pending, checks)
            if front is None:  # drained, then failed: closed, and the worker stops
                break
        ignore_further_sigterm()
        if front is not None:
            if pending is not None and not pending.result.done():  # asked as it stopped
                pending.result.set_exception(SwitchFailed("the worker is stopping: it drains "
                                                          "and exits"))
            await front.shut_down(args.grace, evacuate=not ended["died"])
    finally:
        if front is not None:
            front.telemetry.metrics.stop()
        await engine.shutdown()
    return 1 if ended["died"] else 0


def main_worker(args: argparse.Namespace, start: RoleOptions,
                also: Sequence[RoleOptions] = ()) -> int:
    telemetry = Telemetry.start(start.name, Path(args.model).name)
    try:
        return asyncio.run(run_worker(args, start, telemetry=telemetry, also=also))
    finally:
        telemetry.shutdown()  # flush spans still buffered
