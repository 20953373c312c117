"""Wire <-> engine conversions shared by every service. The engine never imports *_pb2; the
servicers call these."""

from __future__ import annotations

import json
from collections.abc import Sequence

from tandem.engine.sampling_params import (
    FORMAT_AFTER,
    FORMAT_KINDS,
    MAX_CHOICES,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_STOP_ENTRIES,
    Logprob,
    ResponseFormat,
    SamplingParams,
    TokenLogprobs,
    request_params,
)
from tandem.errors import InvalidArgument
from tandem.kvtransfer.descriptor import PoolDescriptor
from tandem.v1 import common_pb2, worker_pb2

# The proto's oneof that carries SamplingParams.response_format; every other request
# parameter is the proto field of its own name (tests/unit/test_params_seam.py holds them equal).
FORMAT_ONEOF = "response_format"


def params_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Unset fields take SamplingParams' defaults (a proto3 scalar without presence at zero is
    unset); bad values raise InvalidArgument naming the field (as SamplingParams does). The
    lists' lengths are checked before they are copied."""
    for name, items, limit in (("stop", p.stop, MAX_STOP_ENTRIES),
                               ("stop_token_ids", p.stop_token_ids, MAX_STOP_ENTRIES),
                               ("logit_bias", p.logit_bias, MAX_LOGIT_BIAS_ENTRIES)):
        if len(items) > limit:
            raise InvalidArgument(name, f"at most {limit} entries, got {len(items)}")
    kw: dict = {}
    for f in request_params():
        if f.name == FORMAT_ONEOF:
            kw[f.name] = _format_from_proto(p)
            continue
        desc = p.DESCRIPTOR.fields_by_name[f.name]
        value = getattr(p, f.name)
        if _is_map(desc):
            kw[f.name] = tuple(sorted(value.items()))
        elif desc.is_repeated:
            kw[f.name] = tuple(value)
        elif p.HasField(f.name) if desc.has_presence else value:
            kw[f.name] = value
    return SamplingParams(**kw)


def params_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams()
    for f in request_params():
        value = getattr(s, f.name)
        if f.name == FORMAT_ONEOF:
            _format_to_proto(p, value)
        elif value is None:
            continue
        elif _is_map(p.DESCRIPTOR.fields_by_name[f.name]):
            getattr(p, f.name).update(dict(value))  # stored as (key, value) pairs
        elif isinstance(value, tuple):
            getattr(p, f.name).extend(value)
        else:
            setattr(p, f.name, value)
    return p


def _is_map(desc) -> bool:
    return desc.message_type is not None and desc.message_type.GetOptions().map_entry


def _format_to_proto(p: common_pb2.SamplingParams, fmt: ResponseFormat | None) -> None:
    if fmt is None:
        return
    kind = FORMAT_KINDS[fmt.type]
    if kind is bool:
        setattr(p, fmt.type, True)
    elif kind is list:  # a message of one repeated field
        getattr(p, fmt.type).choices.extend(json.loads(fmt.schema or "[]"))
    else:
        setattr(p, fmt.type, fmt.schema or "")
    setattr(p, FORMAT_AFTER, fmt.after)


def _format_from_proto(p: common_pb2.SamplingParams) -> ResponseFormat | None:
    which = p.WhichOneof(FORMAT_ONEOF)
    after = getattr(p, FORMAT_AFTER)
    if which is None:
        if after:
            raise InvalidArgument(FORMAT_AFTER, "goes with a response format")
        return None
    kind = FORMAT_KINDS[which]
    if kind is bool and not getattr(p, which):
        raise InvalidArgument(which, "set it to true, or leave it unset")
    if kind is list and len(getattr(p, which).choices) > MAX_CHOICES:  # before the copy
        raise InvalidArgument(which, f"at most {MAX_CHOICES} entries, got "
                              f"{len(getattr(p, which).choices)}")
    spec = None if kind is bool else (json.dumps(list(getattr(p, which).choices))
                                      if kind is list else getattr(p, which))
    try:
        return ResponseFormat(which, spec, after)
    except InvalidArgument as e:
        raise InvalidArgument(which if e.field == "response_format" else e.field,
                              e.message) from None


def logprobs_to_proto(lp: TokenLogprobs | None) -> common_pb2.TokenLogprobs:
    if lp is None:
        return common_pb2.TokenLogprobs()
    return common_pb2.TokenLogprobs(
        sampled=common_pb2.Logprob(token_id=lp.sampled.token_id, logprob=lp.sampled.logprob),
        top=[common_pb2.Logprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top])


def logprobs_from_proto(items: Sequence[common_pb2.TokenLogprobs],
                        count: int) -> tuple[TokenLogprobs | None, ...]:
    """`count` entries; a missing list (logprobs not asked for) gives Nones."""
    if not items:
        return (None,) * count
    if len(items) != count:
        raise InvalidArgument("first_logprobs", f"expected {count} entries, got {len(items)}")
    if any(len(i.top) > MAX_LOGPROBS for i in items):
        raise InvalidArgument("first_logprobs", f"at most {MAX_LOGPROBS} top entries a token")
    return tuple(TokenLogprobs(Logprob(i.sampled.token_id, i.sampled.logprob),
                               tuple(Logprob(t.token_id, t.logprob) for t in i.top))
                 for i in items)


def descriptor_to_proto(d: PoolDescriptor, with_handle: bool = True) -> worker_pb2.PoolDescriptor:
    return worker_pb2.PoolDescriptor(
        dtype=d.dtype, block_size=d.block_size, num_layers=d.num_layers,
        num_kv_heads=d.num_kv_heads, head_dim=d.head_dim, num_blocks=d.num_blocks,
        transport=d.transport, handle=d.handle if with_handle else b"",
        device_index=d.device_index, owner_pid=d.owner_pid, model_kv_heads=d.model_kv_heads,
        tensor_parallel_size=d.tensor_parallel_size,
        tensor_parallel_rank=d.tensor_parallel_rank)


def descriptor_from_proto(p: worker_pb2.PoolDescriptor) -> PoolDescriptor:
    return PoolDescriptor(
        dtype=p.dtype, block_size=p.block_size, num_layers=p.num_layers,
        num_kv_heads=p.num_kv_heads, head_dim=p.head_dim, num_blocks=p.num_blocks,
        transport=p.transport, handle=p.handle, device_index=p.device_index,
        owner_pid=p.owner_pid, model_kv_heads=p.model_kv_heads,
        tensor_parallel_size=p.tensor_parallel_size,
        tensor_parallel_rank=p.tensor_parallel_rank)
