"""Bounds on what a worker RPC's caller sends, checked before any work proportional to a
field's size or value: a list built per sample, a string logged, hashed or sent to the engine
core, a token list copied. gRPC's message limit (64 MiB, runtime/lifecycle.py) bounds a
message's bytes, not the work a value asks for: `n = 2**32 - 1` costs four bytes to send.

Every check raises InvalidArgument naming the field (INVALID_ARGUMENT on the wire). The
request's own fields against the model (token ids, lengths, `n`) are RequestLimits' checks
(engine/sampling_params.py); the sampling parameters' lists are bounded in runtime/convert.py
before they are converted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sized

from tandem.engine.sampling_params import RequestLimits
from tandem.errors import InvalidArgument
from tandem.v1 import worker_pb2

# Request ids: the router's are at most 128 characters (router_svc/grpc_api.py), plus a leg's
# suffix (".3") when a request moves to another decode worker.
MAX_REQUEST_ID_CHARS = 160
MAX_WORKER_ID_CHARS = 256  # worker and instance ids, logged
MAX_ADDRESS_CHARS = 256  # host:port of a prefill worker
MAX_LEASE_ID_CHARS = 64  # a lease token is 32 hex characters (kvtransfer/lease.py)
# W3C trace context: traceparent is 55 characters, tracestate at most 512; a few vendor keys.
MAX_TRACE_ENTRIES = 8
MAX_TRACE_CHARS = 512


def check_chars(field: str, value: str, limit: int, required: bool = False) -> None:
    if len(value) > limit:
        raise InvalidArgument(field, f"at most {limit} characters, got {len(value)}")
    if required and not value:
        raise InvalidArgument(field, "must be non-empty")


def check_count(field: str, items: Sized, limit: int) -> None:
    if len(items) > limit:
        raise InvalidArgument(field, f"at most {limit} entries, got {len(items)}")


def check_request_id(value: str, field: str = "request_id") -> None:
    check_chars(field, value, MAX_REQUEST_ID_CHARS, required=True)


def check_lease_id(value: str, field: str = "lease_id") -> None:
    check_chars(field, value, MAX_LEASE_ID_CHARS)


def check_prompt(field: str, ids: Sized, limits: RequestLimits) -> None:
    """A prompt's length, before its ids are copied or read (their values: RequestLimits)."""
    if not len(ids):
        raise InvalidArgument(field, "must not be empty")
    if len(ids) >= limits.max_model_len:
        raise InvalidArgument(field, f"{len(ids)} tokens; this model serves at most "
                              f"{limits.max_model_len - 1} before its first output")


def check_trace_context(ctx: Mapping[str, str]) -> None:
    check_count("trace_context", ctx, MAX_TRACE_ENTRIES)
    for key, value in ctx.items():
        if len(key) > MAX_TRACE_CHARS or len(value) > MAX_TRACE_CHARS:
            raise InvalidArgument("trace_context", f"keys and values of at most "
                                  f"{MAX_TRACE_CHARS} characters")


def check_kv(kv: worker_pb2.KVLocation, field: str = "kv") -> None:
    check_chars(f"{field}.address", kv.address, MAX_ADDRESS_CHARS)
    check_chars(f"{field}.worker_id", kv.worker_id, MAX_WORKER_ID_CHARS)
    check_chars(f"{field}.instance_id", kv.instance_id, MAX_WORKER_ID_CHARS)
    check_lease_id(kv.lease_id, f"{field}.lease_id")
    if kv.role not in ("", "prefill", "decode"):
        raise InvalidArgument(f"{field}.role", f"prefill or decode, got {kv.role[:16]!r}")


def check_stream_request(msg: worker_pb2.StreamRequest) -> None:
    """What a Stream message carries beyond the request itself (decode_args checks that):
    its id, its trace context, and a decode request's KV locations."""
    check_trace_context(msg.trace_context)
    kind = msg.WhichOneof("kind")
    if kind in ("cancel", "lend"):
        check_request_id(getattr(msg, kind), kind)
        return
    if kind is None:
        raise InvalidArgument("kind", "a Stream message carries generate, decode, cancel, "
                              "handover or lend")
    req = getattr(msg, kind)
    check_request_id(req.request_id)
    if kind == "decode":
        check_kv(req.kv)
        check_kv(req.prefix_kv, "prefix_kv")


def bounded_id(value: str) -> str:
    """An id as far as it may be echoed back or logged (a refused over-long id is cut)."""
    return value[:MAX_REQUEST_ID_CHARS]
