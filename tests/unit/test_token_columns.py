"""A worker's outbox writes many requests' tokens as columns; the router reads them back as one
update per request and step, in order, with ends and failures after the tokens."""

from __future__ import annotations

import asyncio

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.decode_svc.outbox import Outbox, failure_message
from tandem.engine.sequence import FinishReason, SeqOutput
from tandem.router_svc.worker_stream import _by_request
from tandem.runtime.worker import WorkerError
from tandem.v1 import worker_pb2


def engine_steps(requests, rnd) -> list[list[list[SeqOutput]]]:
    """Steps as the engine makes them: each step, every request with samples left hands its
    sink one output per unfinished sample (requests in any order); a sample ends at a step of
    its own. requests: (samples, steps) per request."""
    ends = {(i, k): rnd.randint(1, steps) for i, (n, steps) in enumerate(requests)
            for k in range(n)}
    out = []
    for t in range(1, max(steps for _, steps in requests) + 1):
        step = []
        for i in rnd.sample(range(len(requests)), len(requests)):
            outs = [SeqOutput(f"req-{i}", k, [rnd.randint(0, 50_000)] * rnd.randint(0, 2), [],
                              FinishReason.LENGTH if ends[i, k] == t else None, 7 + i, 3, t)
                    for k in range(requests[i][0]) if ends[i, k] >= t]
            if outs:
                step.append(outs)
        out.append(step)
    return out


def take(outbox: Outbox) -> worker_pb2.StreamResponse | None:
    return asyncio.run(asyncio.wait_for(outbox.take(), 1))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 4)), min_size=1, max_size=4),
       st.randoms(use_true_random=False))
def test_columns_read_back_as_one_update_per_request_and_step(requests, rnd):
    """Several steps in one message (the router read late): each request's steps stay apart,
    in order, with everything the sink was handed."""
    outbox = Outbox()
    expected = []
    for step in engine_steps(requests, rnd):
        for outs in step:
            outbox.tokens(outs)
            expected.append((outs[0].request_id, [
                (o.sample_index, o.new_token_ids, o.finish_reason.value if o.finish_reason
                 else None) for o in outs]))
    msg = worker_pb2.StreamResponse.FromString(take(outbox).SerializeToString())
    got = _by_request(msg)
    assert [(rid, [(s.index, s.token_ids, s.finish_reason) for s in u.samples])
            for rid, u in got] == expected
    for rid, u in got:
        assert u.num_prompt_tokens == 7 + int(rid[-1]) and u.num_cached_tokens == 3
        assert all(s.logprobs == [None] * len(s.token_ids) for s in u.samples)


def test_ends_and_failures_follow_the_tokens_and_the_outbox_empties():
    outbox = Outbox()
    outbox.tokens([SeqOutput("a", 0, [5], [None], FinishReason.STOP, 4, 0, 1)])
    outbox.update(worker_pb2.RequestUpdate(request_id="a", done=True))
    outbox.update(failure_message("b", WorkerError(grpc.StatusCode.UNAVAILABLE,
                                                   "KV transfer failed")))
    msg = take(outbox)
    assert [(rid, [s.token_ids for s in u.samples]) for rid, u in
            _by_request(msg)] == [("a", [[5]])]
    assert [(u.request_id, u.done, u.error_message) for u in msg.updates] == \
        [("a", True, ""), ("b", True, "KV transfer failed")]
    outbox.close()
    assert take(outbox) is None and outbox.closing  # nothing left; only the close is news
