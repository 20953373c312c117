"""The lease RPCs of a worker whose pool peers map: Register, ClaimLease, Release and
RenewLeases, and LendPrefix, which grants a lease. A prefill worker answers them for prompts it
hands off; a decode worker for running sequences it lends to another decode worker (live
migration); either for a cached prefix it lends to a worker of another host (LendPrefix). One
object per servicer, which its gRPC methods call.

The lease's id is a secret token: the puller presents it (ClaimLease) and gets the lease's
block ids, once, while the lease lives; this worker answers from its own table
(kvtransfer.lease.LeaseClaims), on its event loop, without waiting for an engine step. While
its request waits for the pull, the puller renews the lease (RenewLeases), so a lease outlives
its time to live only while a live puller holds it. Register hands a puller this pool's
descriptor (layout + handle), once per pair.
"""

from __future__ import annotations

import logging
import time

import grpc

from tandem.engine.sampling_params import MAX_CACHE_SALT_CHARS
from tandem.errors import InvalidArgument, LayoutMismatch
from tandem.kvtransfer.descriptor import check_compatible
from tandem.kvtransfer.lease import Claim, LeaseClaims
from tandem.runtime.cluster_roles import caller_identity
from tandem.runtime.convert import descriptor_to_proto
from tandem.runtime.worker import abort_for, checked
from tandem.runtime.worker_inputs import (
    MAX_WORKER_ID_CHARS,
    check_chars,
    check_lease_id,
    check_prompt,
)
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

MAX_RENEWALS = 4096  # leases one RenewLeases call may name


class LeaseRPCs:
    def __init__(self, engine, worker_id: str, instance_id: str) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.instance_id = instance_id
        self.pool = engine.info.pool  # the engine core's pool, as peers map it
        self.claims = LeaseClaims()  # which lease token may read which blocks, once

    def offer(self, lease_id: str, claim: Claim) -> None:
        """A lease granted by the engine core, claimable from now on."""
        self.claims.offer(lease_id, claim, time.monotonic())

    async def claim(self, request, context) -> worker_pb2.ClaimLeaseResponse:
        await checked(context, check_lease_id, request.lease_id)
        now = time.monotonic()
        claim = self.claims.claim(request.lease_id, now, caller_identity(context) or "")
        if claim is None:
            # One answer for unknown, expired, released and claimed: the token opens nothing.
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "no live, unclaimed lease has this token")
        return worker_pb2.ClaimLeaseResponse(
            block_ids=claim.block_ids, num_tokens=claim.num_tokens,
            prompt_digest=claim.prompt_digest, ttl_ms=int((claim.deadline - now) * 1000))

    async def release(self, request, context) -> worker_pb2.ReleaseResponse:
        await checked(context, check_lease_id, request.lease_id)
        if request.if_unclaimed and not self.claims.unclaimed(request.lease_id):
            # Claimed: its claimer may be copying the blocks (or it is gone already).
            return worker_pb2.ReleaseResponse(released=False)
        self.claims.forget(request.lease_id)  # before the core frees the blocks
        return worker_pb2.ReleaseResponse(released=await self.engine.release(request.lease_id))

    async def renew(self, request, context) -> worker_pb2.RenewLeasesResponse:
        """Each live lease this caller claimed gets a full time to live from now, up to the end
        of its life (--lease-max-life). An unclaimed one keeps the deadline it has, and so does
        one another caller claimed (with cluster TLS, callers are told apart by certificate)."""
        if len(request.lease_ids) > MAX_RENEWALS:
            await abort_for(context, InvalidArgument(
                "lease_ids", f"{len(request.lease_ids)} leases; at most {MAX_RENEWALS} a call"))
        ids = list(request.lease_ids)
        for lease_id in ids:
            await checked(context, check_lease_id, lease_id, "lease_ids")
        holder, now = caller_identity(context) or "", time.monotonic()
        mine = [i for i in ids if self.claims.held_by(i, holder, now)]
        left = dict(zip(mine, await self.engine.renew(mine), strict=True))
        for lease_id, seconds in left.items():
            if seconds > 0:
                self.claims.renewed(lease_id, now + seconds)
        return worker_pb2.RenewLeasesResponse(
            ttl_ms=[int(left.get(i, 0.0) * 1000) for i in ids])

    async def lend_prefix(self, request, context, address: str, role: str,
                          draining: bool) -> worker_pb2.LendPrefixResponse:
        """A lease on the longest prefix of the prompt that this worker's pool or host tier
        holds under the request's cache salt, claimable from now on; an empty answer when it
        holds none, drains (it would wait for the lease to end), or peers map no pool here."""
        await checked(context, check_prompt, "prompt_token_ids", request.prompt_token_ids,
                      self.engine.info.limits)
        await checked(context, check_chars, "cache_salt", request.cache_salt,
                      MAX_CACHE_SALT_CHARS)
        if self.pool is None or draining:
            return worker_pb2.LendPrefixResponse()
        lent = await self.engine.lend_prefix(list(request.prompt_token_ids), request.cache_salt)
        if lent is None:
            return worker_pb2.LendPrefixResponse()
        self.offer(lent.lease_id, Claim(lent.block_ids, lent.num_tokens, lent.digest,
                                        lent.deadline))
        return worker_pb2.LendPrefixResponse(kv=worker_pb2.KVLocation(
            worker_id=self.worker_id, address=address, num_tokens=lent.num_tokens,
            lease_id=lent.lease_id, instance_id=self.instance_id,
            role="decode" if role == "decode" else "",
            lease_ttl_ms=int(max(lent.deadline - time.monotonic(), 0) * 1000)))

    async def register(self, request, context) -> worker_pb2.RegisterResponse:
        await checked(context, check_chars, "decode_worker_id", request.decode_worker_id,
                      MAX_WORKER_ID_CHARS)
        mine = self.pool
        if mine is None:  # a colocated worker: its pool is its own, mapped by no peer
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker's KV pool is not shared with peers")
        try:
            check_compatible(mine, request.layout)
        except LayoutMismatch as e:
            log.warning("refused registration of %s: %s", request.decode_worker_id, e)
            await abort_for(context, e)
        log.info("decode worker %s registered (%s)", request.decode_worker_id,
                 mine.redacted())
        return worker_pb2.RegisterResponse(
            prefill_worker_id=self.worker_id, pool=descriptor_to_proto(mine),
            instance_id=self.instance_id,
            rank_pools=[descriptor_to_proto(d) for d in self.engine.info.rank_pools])
