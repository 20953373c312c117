"""A colocated worker's request (one `both` worker behind the router) traced like a
disaggregated one, exported to a real OTLP/gRPC receiver on 127.0.0.1: the router's CLIENT span
for the leg with the worker's SERVER span under it, the queue / prefill_compute / decode_steps
phases, and a cancel by the caller as CANCELLED on the worker, its leg and the router, with one
log line each. The pool is idle after each test."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from traces import (
    CLIENT,
    ERROR,
    SERVER,
    attrs,
    cancel_after_tokens,
    has_error,
    traced_cluster,
    wait_logs,
    wait_trace,
)

from cluster import HOLD_WORKER_ARGS, serve
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2


@pytest.fixture(scope="module")
def colocated(tiny_llama_long, tmp_path_factory, receiver):
    yield from serve(traced_cluster(tmp_path_factory.mktemp("colocated"),
                                    str(tiny_llama_long), receiver, prefill=0, decode=0,
                                    both=1, worker_args=HOLD_WORKER_ARGS))


@pytest.fixture(autouse=True)
def idle_after(colocated):
    yield
    asyncio.run(colocated.wait_idle())


def test_colocated_worker_traces_phases_and_cancels(colocated, receiver):
    async def main():
        async with grpc.aio.insecure_channel(colocated.router.address) as ch:
            chunks = [r async for r in colocated.api(ch).Generate(api_pb2.GenerateRequest(
                text="one worker", params=params_to_proto(SamplingParams(
                    temperature=0, max_tokens=5, ignore_eos=True))))]
            return chunks[-1].request_id

    rid = asyncio.run(main())
    # Every span read below: a process exports its spans in batches, its children first.
    t = wait_trace(receiver, rid, lambda t: all(t.named(n, "tandem-both") for n in (
        "generate", "queue", "prefill_compute", "decode_steps")))
    leg = t.one("generate_leg", "tandem-router")
    assert leg.kind == CLIENT and t.parent(leg) is t.root
    gen = t.one("generate", "tandem-both")
    assert gen.kind == SERVER and t.parent(gen) is leg and gen.status.code != ERROR
    assert attrs(gen)["tandem.finish_reasons"] == ["length"]
    assert attrs(gen)["tandem.output_tokens"] == 5
    phases = {n: t.one(n, "tandem-both") for n in ("queue", "prefill_compute", "decode_steps")}
    assert all(t.parent(s) is gen for s in phases.values())
    assert phases["prefill_compute"].end_time_unix_nano <= \
        phases["decode_steps"].start_time_unix_nano

    rid = cancel_after_tokens(colocated)
    t = wait_trace(receiver, rid, lambda t: bool(t.named("generate", "tandem-both"))
                   and bool(t.named("generate_leg", "tandem-router")))
    gen = t.one("generate", "tandem-both")
    assert has_error(gen, "CANCELLED") and attrs(gen)["tandem.finish_reasons"] == ["abort"]
    assert attrs(gen)["tandem.output_tokens"] >= 3
    assert has_error(t.one("generate_leg", "tandem-router"), "CANCELLED")
    assert has_error(t.root, "CANCELLED")
    wait_logs(colocated, rid, {"router": "request cancelled", "both0": "generate cancelled"})
