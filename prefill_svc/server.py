"""The prefill worker: the engine in the prefill role.

Prefill runs the prompt (chunked, prefix-cached, batched with other prompts), samples the first
token of every sample, and pins the prompt's blocks under a lease until the decode worker that
pulls them calls Release, or the lease expires. The lease's id is a secret token: the decode
worker presents it (ClaimLease) and gets the lease's block ids, once, while the lease lives;
this worker answers from its own table (kvtransfer.lease.LeaseClaims), on its event loop,
without waiting for an engine step. While the request waits for its pull, the decode worker
renews the lease (RenewLeases), so a lease outlives its time to live only while a live decode
worker holds it. Register hands a decode worker this pool's descriptor (layout + handle), once
per pair.

A prompt whose leading blocks another worker lent from its cache (PrefillRequest.prefix_kv: a
worker of another host whose host tier holds them, asked by the router) has them pulled rather
than computed: claimed from that worker as a decode worker claims a prefill lease
(runtime/kv_peers.py), pulled by the engine core, released once pulled; computed after all if
the lease cannot be used.
"""

from __future__ import annotations

import argparse
import contextvars
import logging
import time

import grpc

from tandem.engine.sequence import RemoteKV
from tandem.engine.serving.core_messages import LeaseDone
from tandem.errors import InvalidArgument
from tandem.kvtransfer import transports
from tandem.kvtransfer.lease import Claim, prompt_digest
from tandem.runtime.convert import logprobs_to_proto, params_from_proto
from tandem.runtime.kv_peers import PeerPools
from tandem.runtime.lease_rpcs import LeaseRPCs
from tandem.runtime.role_switch import RoleOptions
from tandem.runtime.worker import (
    WorkerError,
    WorkerServicer,
    abort_for,
    add_worker_args,
    main_worker,
)
from tandem.runtime.worker_inputs import (
    bounded_id,
    check_kv,
    check_prompt,
    check_request_id,
)
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

class PrefillServicer(WorkerServicer):
    role = "prefill"

    def __init__(self, engine, worker_id: str, address: str) -> None:
        super().__init__(engine, worker_id)
        self.address = address
        # Register, ClaimLease, Release, RenewLeases: its pool and the leases on it.
        self.leases = LeaseRPCs(engine, worker_id, self.instance_id)
        self.claims = self.leases.claims
        self.limits = engine.info.limits
        # The pools of workers that lend it a cached prefix (LendPrefix), and the leases it
        # pulls: token -> its request's context, until the core is done with it (LeaseDone).
        self.pools = PeerPools(self)
        self._pulling: dict[str, contextvars.Context] = {}

    async def Prefill(self, request, context):  # noqa: N802 - gRPC method name
        with self.telemetry.request_span("prefill", bounded_id(request.request_id)) as record:
            try:
                if self.draining:  # the router prefills it elsewhere (or on a decode worker)
                    self.pools.let_go(request.prefix_kv)
                    raise WorkerError(grpc.StatusCode.UNAVAILABLE,
                                      f"prefill worker {self.worker_id} drains", draining=True)
                check_request_id(request.request_id)
                check_prompt("prompt_token_ids", request.prompt_token_ids, self.limits)
                check_kv(request.prefix_kv, "prefix_kv")
                params = params_from_proto(request.params)
                prompt = list(request.prompt_token_ids)
                prefix = await self._lent_prefix(request, prompt, params)
                out = await self.engine.prefill(request.request_id, prompt, params, prefix)
            except Exception as e:  # noqa: BLE001 - mapped to a status
                record.cause = e  # the abort below raises an AbortError in its place
                await abort_for(context, e)
            if out.handoff is None:
                record.cause = RuntimeError(out.error or f"prefill ended: {out.finish_reason}")
                await abort_for(context, record.cause)
            self.telemetry.prefill_done(record, out)
        if self.draining:
            self.drain_tally.finished += 1
        h = out.handoff
        self.leases.offer(h.lease_id, Claim(h.block_ids, h.num_tokens,
                                            prompt_digest(request.prompt_token_ids),
                                            h.lease_deadline))
        return worker_pb2.PrefillResponse(
            first_token_ids=list(h.first_token_ids),
            first_logprobs=[logprobs_to_proto(lp) for lp in h.first_logprobs]
            if params.logprobs is not None else [],
            finish_reasons=[r.value if r else "" for r in h.finish_reasons],
            kv=worker_pb2.KVLocation(worker_id=self.worker_id, address=self.address,
                                     num_tokens=h.num_tokens, lease_id=h.lease_id,
                                     lease_ttl_ms=int(h.lease_ttl_s * 1000),
                                     instance_id=self.instance_id),
            num_cached_tokens=h.num_cached_tokens,
            prompt_logprobs=[logprobs_to_proto(lp) for lp in out.prompt_logprobs or ()])

    async def _lent_prefix(self, request, prompt: list[int], params) -> RemoteKV | None:
        """The prompt prefix another worker lent for this request (prefix_kv; the router asked
        it, LendPrefix), claimed: what the engine pulls instead of computing it. None without
        one, or when it cannot be used (then the prompt is computed whole): prompt logprobs
        are computed at every position, so that request's lease is released at once."""
        if not request.HasField("prefix_kv"):
            return None
        if params.prompt_logprobs is not None:
            self.pools.let_go(request.prefix_kv)
            return None
        prefix = await self.pools.claim_prefix(request.prefix_kv, prompt, params.cache_salt)
        if prefix is not None:  # its pull's span joins this request's trace
            self._pulling[prefix.lease_id] = contextvars.copy_context()
        return prefix

    def lease_done(self, done: LeaseDone) -> None:
        """The engine core is done with a lent prefix's lease: record its pull, release it."""
        context = self._pulling.pop(done.lease_id, None)
        if done.pulled:
            self.telemetry.kv_transfer(context, done)
        self.pools.spawn_release(done.address, done.lease_id, context)

    def still_held(self) -> int:
        """A draining prefill worker waits for its prompts and for every lease it granted to be
        released (its decode worker pulled it) or to expire; meanwhile it answers claims,
        releases and renewals."""
        return self.engine.num_requests() + self.engine.snapshot.num_leases

    async def on_start(self) -> None:
        # Blocks pinned by claimed leases, per holder, read when Prometheus scrapes.
        self.telemetry.metrics.watch_leases(lambda: self.claims.pinned_by_holder(
            time.monotonic()))

    async def on_stop(self) -> None:
        await self.pools.close()

# A lease's whole life, renewals included, is at most this many times its time to live unless
# --lease-max-life says otherwise: 5 minutes with the default 30 s, far longer than a pull waits
# on a busy decode worker or a slow link, and a bound on what one holder of leases can pin.
MAX_LIFE_TTLS = 10


def lease_life(args: argparse.Namespace) -> tuple[float, float]:
    """The leases' time to live and their longest life, from the flags (checked)."""
    ttl = args.lease_ttl
    if not ttl > 0:
        raise InvalidArgument("--lease-ttl", f"must be > 0, got {ttl}")
    life = args.lease_max_life if args.lease_max_life is not None else MAX_LIFE_TTLS * ttl
    if not life >= ttl:
        raise InvalidArgument("--lease-max-life", f"must be >= --lease-ttl ({ttl}), got {life}")
    return ttl, life


def role_options(args: argparse.Namespace) -> RoleOptions:
    """The prefill role as this worker's flags set it (its pool's transport, its leases)."""
    ttl, life = lease_life(args)
    return RoleOptions("prefill", PrefillServicer,
                       args.transport or transports.default_for(args.device), ttl, life)


def run(args: argparse.Namespace) -> int:
    return main_worker(args, role_options(args))


def add_lease_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """--transport, --lease-ttl and --lease-max-life (`tandem worker` adds them with a note that
    they are for the prefill role: `prefix`)."""
    p.add_argument("--transport", choices=transports.names(), default=None,
                   help=f"{prefix}how decode workers reach this pool (role decode too: peers "
                        f"pulling what it lends): {transports.describe()}")
    p.add_argument("--lease-ttl", type=float, default=30.0,
                   help=f"{prefix}seconds a finished prompt's blocks stay pinned for a decode "
                        "worker, counted from the prefill and again from each renewal by the "
                        "decode worker that claimed them (every third of this while it waits)")
    p.add_argument("--lease-max-life", type=float, default=None,
                   help=f"{prefix}seconds a lease lives at most, renewals included, counted "
                        f"from the prefill (default: {MAX_LIFE_TTLS} times --lease-ttl): "
                        "renewals cannot pin blocks for good")


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="run a prefill worker")
    add_worker_args(p)
    add_lease_args(p)
    p.set_defaults(func=run)
