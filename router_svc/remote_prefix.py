"""A prompt's prefix held in the host tier of a worker that is not the one computing the prompt
(another host's tier, or a private one), lent to it instead of computed there.

    router: the worker W picked to compute the prompt (a prefill worker, or a decode worker
            prefilling it itself) serves k blocks of its prefix from its pool and the tiers
            it reads; worker L's pool and host tier hold k + g of them, g >= --remote-prefix-
            blocks, some in a tier W cannot read (KVIndex.lender)
    router ── LendPrefix(prompt's first k + g blocks, cache salt) ──▶ L: its tier's blocks
              copied back into its pool, leased (bound to those tokens and the salt)
    router ── Prefill / Decode(prompt, prefix_kv: the lease) ──▶ W
    W ── Register (once), ClaimLease ──▶ L;  W's engine pulls the blocks over L's transport
         (NIXL between hosts), computes the rest;  W ── Release ──▶ L

Once the request carrying it is sent, the lease is W's: it releases it after the pull, or at
once when it cannot use it (its claim refused, its lender gone: W computes those blocks
instead). A lease never sent (no worker took the request) is released here. A lend that fails
or finds nothing lends nothing: the prompt is computed as without a lender.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from tandem.router_svc.routing import RouteRequest
from tandem.router_svc.workers import Worker, WorkerSet
from tandem.runtime.request_trace import client_call
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

LEND_TIMEOUT_S = 5.0  # a lender that does not answer by then is not waited for


@dataclass(frozen=True)
class LentPrefix:
    """A lease on a prompt's prefix, from `lender`, for the request to carry (`kv`)."""

    lender: Worker
    kv: worker_pb2.KVLocation


class PrefixLending:
    """The router's side: which worker lends, and the ask. `min_blocks`: the fewest blocks a
    lender must hold beyond what the computing worker serves itself (a pull has a fixed cost:
    a claim and a READ)."""

    def __init__(self, workers: WorkerSet, min_blocks: int, tracer: trace.Tracer) -> None:
        if min_blocks < 1:
            raise ValueError(f"min_blocks must be >= 1, got {min_blocks}")
        self.workers = workers
        self.min_blocks = min_blocks
        self.tracer = tracer

    def lender(self, route: RouteRequest, dest: Worker) -> tuple[Worker, int] | None:
        """The worker to ask and how many of the prompt's leading blocks it holds."""
        bs = self.workers.block_size
        # At least one prompt token is computed on `dest` (its logits give the first token).
        hashes = route.block_hashes[:(len(route.prompt) - 1) // bs]
        if not hashes or dest.slot < 0:
            return None
        peers = {w.slot: w for w in self.workers.workers
                 if w.role in ("prefill", "decode") and w.healthy and not w.load.draining
                 and w.slot >= 0 and w is not dest}
        found = self.workers.kv_index.lender(hashes, dest.slot, peers, self.min_blocks)
        if found is None:
            return None
        slot, blocks = found
        return peers[slot], blocks

    async def lend(self, route: RouteRequest, dest: Worker, cache_salt: str,
                   ctx: Context | None) -> LentPrefix | None:
        """A lease on the prompt's prefix from the best lender for `dest`, or None (none
        holds enough, or it lent nothing)."""
        found = self.lender(route, dest)
        if found is None:
            return None
        w, blocks = found
        req = worker_pb2.LendPrefixRequest(
            prompt_token_ids=route.prompt[:blocks * self.workers.block_size],
            cache_salt=cache_salt)
        try:
            with client_call("/tandem.v1.Worker/LendPrefix", w.address, ctx, self.tracer,
                             **{"tandem.kv.blocks": blocks}) as traced:
                resp = await w.stub.LendPrefix(req, timeout=LEND_TIMEOUT_S,
                                               metadata=traced.metadata)
        except grpc.aio.AioRpcError as e:
            log.info("worker %s lent no prefix: %s", w.address, e.code().name)
            return None
        if not resp.HasField("kv") or not resp.kv.lease_id:
            return None
        resp.kv.address = w.address  # where this router reaches it, whatever it said
        trace.get_current_span(ctx).add_event("prefix_lent", {
            "tandem.worker": w.address, "tandem.worker.to": dest.address,
            "tandem.kv.tokens": resp.kv.num_tokens})
        return LentPrefix(w, resp.kv)
