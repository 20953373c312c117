"""Prefill fallback, the router's decision and the decode worker's checks, without processes:
a prompt goes to its decode worker when no prefill worker is up, or when every one is past
--prefill-saturation; never with --no-prefill-fallback; the router is ready with decode workers
alone while fallback is on; a decode request without a lease is checked like any other."""

from __future__ import annotations

import pytest

from tandem.decode_svc.handoff import decode_args
from tandem.engine.sampling_params import RequestLimits, SamplingParams
from tandem.errors import InvalidArgument
from tandem.router_svc.decode_legs import Fallback
from tandem.router_svc.orchestrator import Orchestrator
from tandem.router_svc.workers import FaultMetrics, Worker, WorkerSet
from tandem.runtime.convert import params_to_proto
from tandem.v1 import worker_pb2


def _workers(prefill_loads: list[int], fallback: bool = True) -> WorkerSet:
    ws = WorkerSet([], [], [], metrics=FaultMetrics(), prefill_fallback=fallback)
    ws.workers = [Worker(f"p{i}", "prefill", None, None, None, healthy=True, in_flight=load)
                  for i, load in enumerate(prefill_loads)]
    ws.workers.append(Worker("d0", "decode", None, None, None, healthy=True))
    return ws


def test_falls_back_only_without_a_prefill_worker_by_default():
    orch = Orchestrator(_workers([0, 50]))
    assert orch.fallback() is None
    assert orch.fallback({"p0"}) is None  # p1 is still up, however busy
    assert orch.fallback({"p0", "p1"}) == Fallback("no_prefill")
    for w in orch.workers.by_role("prefill"):
        w.healthy = False
    assert orch.fallback() == Fallback("no_prefill")


def test_saturation_bound_sends_prompts_to_decode_when_every_prefill_worker_is_past_it():
    orch = Orchestrator(_workers([3, 5]), prefill_saturation=4)
    assert orch.fallback() is None  # p0 has room
    orch.workers.workers[0].in_flight = 4
    assert orch.fallback() == Fallback("saturated")


def test_no_fallback_when_turned_off_or_no_decode_worker():
    assert Orchestrator(_workers([], fallback=False)).fallback() is None
    ws = _workers([])
    ws.workers = []
    assert Orchestrator(ws).fallback() is None


def test_ready_with_decode_workers_alone_while_fallback_is_on():
    ws = _workers([0])
    ws.workers[0].healthy = False
    assert ws.ready()
    ws.prefill_fallback = False
    assert not ws.ready()


LIMITS = RequestLimits(vocab_size=256, max_model_len=128, max_n=4)


def _request(**kw) -> worker_pb2.DecodeRequest:
    params = params_to_proto(SamplingParams(n=2, max_tokens=8))
    return worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1, 2, 3], params=params,
                                    **kw)


def test_a_decode_request_without_a_lease_is_prefilled_here():
    args = decode_args(_request(), LIMITS)
    assert args.first_token_ids == () and args.resume_token_ids == ()
    # Moved with no prefill worker up: the tokens the client has, per sample.
    args = decode_args(_request(first_token_ids=[5, 6],
                                resume=[worker_pb2.SampleTokens(token_ids=[7]),
                                        worker_pb2.SampleTokens(token_ids=[])]), LIMITS)
    assert args.first_token_ids == (5, 6) and args.resume_token_ids == ((7,), ())


@pytest.mark.parametrize("kw, field", [
    ({"resume": [worker_pb2.SampleTokens(token_ids=[7])] * 2}, "first_token_ids"),
    ({"first_token_ids": [5]}, "first_token_ids"),
    ({"first_token_ids": [5, 999]}, "first_token_ids"),
])
def test_a_decode_request_without_a_lease_is_checked(kw, field):
    with pytest.raises(InvalidArgument, match=field):
        decode_args(_request(**kw), LIMITS)
