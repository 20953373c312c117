"""The decode side of the prefill → decode handoff: what a decode request must be before the
engine sees it, and the prefill lease it carries, from the router's handover to its one release.

    router ── DecodeRequest(prompt, params, kv {address, lease token}, first tokens) ──▶ D
    D: every id and length checked (INVALID_ARGUMENT naming the field)
    D ── ClaimLease(token) ──▶ P: the lease's block ids, prompt length and digest, time left;
                                 once, while the lease lives (else FAILED_PRECONDITION)
    D: the prompt must be the lease's; the engine core pulls exactly the claimed blocks, then
       D ── Release(token) ──▶ P
    meanwhile, every third of the lease's time to live:
       D ── RenewLeases(tokens) ──▶ P: a full time to live each (decode_svc/lease_renewal.py)

Nothing a caller names is read from a prefill worker's pool: block ids come from the claim.
The claim costs one unary call to the prefill worker per request, answered on its event loop
(not between its engine steps), before the request joins the engine's queue.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from tandem.engine.sampling_params import RequestLimits, SamplingParams, TokenLogprobs
from tandem.engine.sequence import RemoteKV
from tandem.errors import InvalidArgument
from tandem.kvtransfer.lease import prompt_digest
from tandem.runtime.convert import logprobs_from_proto, params_from_proto
from tandem.runtime.kv_peers import LEASE_MARGIN_S
from tandem.runtime.request_trace import client_call
from tandem.runtime.worker import WorkerError
from tandem.runtime.worker_inputs import check_prompt, check_request_id
from tandem.v1 import worker_pb2

# A held lease is renewed once this share of the time its claim (or last renewal) gave it has
# passed: with the default 30 s, every 10 s, two tries before the margin runs out.
RENEW_AFTER = 1 / 3

WORKER, CORE, REFUSED = "worker", "core", "refused"


def renew_time(sent: float, ttl_ms: int) -> float:
    """When to renew a lease that had `ttl_ms` left at `sent` (time.monotonic())."""
    return sent + ttl_ms / 1000 * RENEW_AFTER


@dataclass(eq=False)
class HeldLease:
    """A decode request's prefill lease as this worker holds it, from the router's handover to
    its one release. `owner` says who releases it: this worker (WORKER) when the request ends
    before the engine core took it; the core (CORE), whose LeaseDone the worker turns into the
    Release call; nobody (REFUSED) when the prefill worker refused our claim: it was never ours."""

    address: str
    lease_id: str  # the token: a capability, never logged
    # The request's context (its span, the request id for log lines): the KV-transfer span is
    # its child and the Release call joins its trace.
    context: contextvars.Context | None = None
    owner: str = WORKER
    # Once claimed: until when it may be pulled (this host's monotonic clock, margin taken)
    # and when to renew it (decode_svc/lease_renewal.py), both moved by each renewal.
    deadline: float = 0.0
    renew_at: float = float("inf")
    # Live migration: the lease is a decode worker's on a running sequence ("decode"), and
    # `on_pulled` is told once its KV is here (the router then hands the request over).
    role: str = "prefill"
    on_pulled: Callable[[], None] | None = None


@dataclass(frozen=True)
class DecodeArgs:
    """A decode request's fields once checked."""

    prompt: list[int]
    params: SamplingParams
    first_token_ids: tuple[int, ...]
    first_logprobs: tuple[TokenLogprobs | None, ...]
    # A request moved here mid-stream: per sample, the outputs after the first it already has.
    resume_token_ids: tuple[tuple[int, ...], ...] = ()


def decode_args(req: worker_pb2.DecodeRequest, limits: RequestLimits) -> DecodeArgs:
    """Every id and length the caller handed over, checked against the model's limits; a bad
    one raises InvalidArgument naming its field. Nothing here trusts the caller, and every
    count is checked before anything is built from it."""
    check_request_id(req.request_id)
    check_prompt("prompt_token_ids", req.prompt_token_ids, limits)
    prompt = list(req.prompt_token_ids)
    limits.check_ids("prompt_token_ids", prompt)
    params = params_from_proto(req.params)
    if params.n > limits.max_n:
        raise InvalidArgument("n", f"must be <= {limits.max_n}, got {params.n}")
    if not req.HasField("kv") and not req.first_token_ids:  # fresh, prefilled here
        if req.first_logprobs or req.resume:
            raise InvalidArgument("first_token_ids", "a request without kv or first tokens "
                                  "is prefilled and sampled here: it resumes nothing")
        return DecodeArgs(prompt, params, (), ())
    if len(req.first_token_ids) != params.n:
        raise InvalidArgument("first_token_ids", f"{len(req.first_token_ids)} ids for "
                              f"n={params.n}")
    firsts = tuple(req.first_token_ids)
    limits.check_ids("first_token_ids", firsts)
    if req.resume and len(req.resume) != params.n:
        raise InvalidArgument("resume", f"{len(req.resume)} samples for n={params.n}")
    resume = []
    for sample in req.resume:
        if len(prompt) + 1 + len(sample.token_ids) > limits.max_model_len:
            raise InvalidArgument("resume", f"{1 + len(sample.token_ids)} outputs after a "
                                  f"prompt of {len(prompt)} exceed max_model_len "
                                  f"{limits.max_model_len}")
        resume.append(tuple(sample.token_ids))
        limits.check_ids("resume", resume[-1])
    return DecodeArgs(prompt, params, firsts, logprobs_from_proto(req.first_logprobs, params.n),
                      tuple(resume))


async def claim(stub, lease: HeldLease, args: DecodeArgs, instance_id: str = "") -> RemoteKV:
    """Present the lease's token to its prefill worker; what the engine core will pull. A
    refused token (unknown, expired, released or claimed before) fails the request with
    FAILED_PRECONDITION and marks the lease not ours to release."""
    sent = time.monotonic()
    try:
        with client_call("/tandem.v1.Worker/ClaimLease", lease.address) as call:
            resp = await stub.ClaimLease(worker_pb2.ClaimLeaseRequest(lease_id=lease.lease_id),
                                         timeout=10, metadata=call.metadata)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
            lease.owner = REFUSED
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"prefill worker {lease.address} refused the lease: "
                              f"{e.details()}") from None
        raise WorkerError(grpc.StatusCode.UNAVAILABLE,
                          f"prefill worker {lease.address}: {e.details()}") from None
    # Claimed: ours to release from here, whatever happens next.
    moving = lease.role == "decode"
    known = _sample0_tokens(args) if moving else args.prompt
    # A prefill lease holds the prompt's KV; a running sequence's (live migration) the
    # prompt's and some of sample 0's outputs, never its last token (whose KV is not written).
    top = len(known) - 1 if moving else len(known)
    if not len(args.prompt) <= resp.num_tokens <= top:
        raise InvalidArgument("prompt_token_ids", f"{len(known)} tokens; the lease holds "
                              f"the KV of {resp.num_tokens}")
    if resp.prompt_digest != prompt_digest(known[:resp.num_tokens]):
        raise InvalidArgument("prompt_token_ids", "not the tokens the lease holds the KV of")
    deadline = sent + resp.ttl_ms / 1000 - LEASE_MARGIN_S
    lease.deadline, lease.renew_at = deadline, renew_time(sent, resp.ttl_ms)
    if deadline <= time.monotonic():
        # Nothing wrong with this worker or the request: a fresh lease (a new prefill, its
        # blocks most likely cached) will do. ABORTED tells the router to retry so.
        raise WorkerError(grpc.StatusCode.ABORTED,
                          f"the lease has {resp.ttl_ms} ms left, too little to pull its KV")
    return RemoteKV(lease.address, lease.lease_id, deadline, tuple(resp.block_ids),
                    args.first_token_ids, args.first_logprobs, args.resume_token_ids,
                    instance_id, resp.num_tokens if moving else 0, moving)


def _sample0_tokens(args: DecodeArgs) -> list[int]:
    """The prompt and sample 0's outputs the client has: what a lent sequence's KV is of."""
    if not args.first_token_ids:
        raise InvalidArgument("first_token_ids", "a running request moving here (kv.role "
                              "decode) carries the tokens its client has")
    more = args.resume_token_ids[0] if args.resume_token_ids else ()
    return [*args.prompt, args.first_token_ids[0], *more]
