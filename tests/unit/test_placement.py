"""Per-request placement (router_svc/routing/placement.py) on plain data: disaggregated or wholly
on the decode worker, by prompt length after each worker's cached prefix, queues, step times, the
KV transfer and the SLO class; and the cost-placement policy's registration and flags."""

from __future__ import annotations

import pytest

from tandem.errors import InvalidArgument
from tandem.router_svc.routing import POLICIES, PlacementOptions, RouteRequest, WorkerLoad
from tandem.router_svc.routing import make_policy as make
from tandem.router_svc.routing.placement import (
    DISAGGREGATED,
    HOST_COPY_BANDWIDTH,
    LOCAL,
    place,
    slo_class,
)

BS = 16
BLOCK_BYTES = 1 << 20  # 1 MiB a block
OPTS = PlacementOptions(kv_bandwidth=1e9, kv_block_bytes=BLOCK_BYTES)


def worker(role: str, *, queued: int = 0, running: int = 0, cached: int = 0,
           step: float = 0.02, token: float = 1e-4, bandwidth: float = 0.0,
           host: int = 0) -> WorkerLoad:
    """`running`: requests running there, none of them this router's (none in flight)."""
    return WorkerLoad(f"{role}:1", role, 0, queued, running, 1000, cached, step_seconds=step,
                      prompt_token_seconds=token, kv_bandwidth=bandwidth, host_blocks=host,
                      other_running=running, other_waiting=queued)


def request(tokens: int, priority: int = 0) -> RouteRequest:
    return RouteRequest(list(range(tokens)), priority=priority)


def test_a_short_prompt_on_an_idle_decode_worker_runs_there():
    # Disaggregated it waits a decode step and a transfer besides its prefill; locally only
    # the prefill, and nobody runs on D to be delayed.
    got = place(request(40), worker("prefill"), worker("decode"), BS, OPTS)
    assert (got.where, got.reason) == (LOCAL, "cheaper_local")
    assert got.inputs.uncached_decode_tokens == 40 and got.inputs.pull_blocks == 3


def test_a_long_prompt_goes_to_the_prefill_worker_when_the_decode_worker_is_busy():
    p, d = worker("prefill"), worker("decode", running=32)
    got = place(request(4000), p, d, BS, OPTS)
    assert (got.where, got.reason) == (DISAGGREGATED, "cheaper_disaggregated")
    # Its first-token estimate alone would favour D (no transfer, no step to wait): the delay
    # it would add to D's 32 running sequences is what sends it away...
    assert got.inputs.local_s < got.inputs.disaggregated_s
    # ...and an interactive request (priority < 0) weighs only its own first token.
    urgent = place(request(4000, priority=-1), p, d, BS, OPTS)
    assert (urgent.where, urgent.inputs.slo_class, urgent.inputs.weight) == (
        LOCAL, "interactive", 0.0)


def test_a_prefix_cached_on_the_decode_worker_counts_only_the_rest():
    # A conversation's next turn: 1000 tokens, 62 of its blocks (992 tokens) on D already;
    # P caches none of it, and D runs 8 sequences.
    p, d = worker("prefill"), worker("decode", running=8, cached=62)
    got = place(request(1000), p, d, BS, OPTS)
    assert got.where == LOCAL
    assert got.inputs.uncached_decode_tokens == 8 and got.inputs.uncached_prefill_tokens == 1000
    assert got.inputs.pull_blocks == 1  # the last, partial block
    # The same prompt with nothing cached on D goes to P.
    assert place(request(1000), p, worker("decode", running=8), BS, OPTS).where == DISAGGREGATED


def test_a_prefix_in_the_decode_workers_host_tier_counts_as_a_copy_not_a_prefill():
    # The same turn as above with its 62 blocks evicted from D's pool into its host tier: D
    # copies them back (62 MiB at the host link's speed) instead of computing 992 tokens.
    p, d = worker("prefill"), worker("decode", running=8, host=62)
    got = place(request(1000), p, d, BS, OPTS)
    assert got.where == LOCAL
    assert (got.inputs.uncached_decode_tokens, got.inputs.host_blocks_d) == (8, 62)
    assert got.inputs.local_s == pytest.approx(8 * 1e-4 + 62 * BLOCK_BYTES / HOST_COPY_BANDWIDTH)
    # A host-tier copy on P shortens the disaggregated estimate the same way.
    on_p = place(request(1000), worker("prefill", host=62), worker("decode", running=8), BS,
                 OPTS)
    assert on_p.inputs.uncached_prefill_tokens == 8


def test_a_queue_on_the_prefill_worker_and_a_slow_link_favour_the_decode_worker():
    d = worker("decode", running=4)
    assert place(request(1000), worker("prefill"), d, BS, OPTS).where == DISAGGREGATED
    assert place(request(1000), worker("prefill", queued=40), d, BS, OPTS).where == LOCAL
    slow = PlacementOptions(kv_bandwidth=1e7, kv_block_bytes=BLOCK_BYTES)
    got = place(request(1000), worker("prefill"), d, BS, slow)
    assert got.where == LOCAL and got.inputs.transfer_s == pytest.approx(63 * BLOCK_BYTES / 1e7)
    # A bandwidth the decode worker measured replaces the flag's.
    fast = worker("decode", running=4, bandwidth=1e12)
    assert place(request(1000), worker("prefill"), fast, BS, slow).where == DISAGGREGATED


def test_batch_requests_weigh_their_harm_to_others_more():
    p, d = worker("prefill"), worker("decode", running=2)
    prompt = 400
    assert place(request(prompt), p, d, BS, OPTS).where == LOCAL
    got = place(request(prompt, priority=1), p, d, BS, OPTS)
    assert (got.where, got.inputs.slo_class, got.inputs.weight) == (DISAGGREGATED, "batch", 4.0)


def test_the_short_prompt_threshold_and_unmeasured_workers():
    short = PlacementOptions(short_prompt_tokens=64)
    busy = worker("decode", running=500)
    assert place(request(64), worker("prefill"), busy, BS, short).reason == "short"
    # After D's cached prefix: 300 tokens, 16 blocks (256) cached, 44 to run.
    cached = worker("decode", running=500, cached=16)
    assert place(request(300), worker("prefill"), cached, BS, short).where == LOCAL
    assert place(request(65), worker("prefill"), busy, BS, short).where == DISAGGREGATED
    # A worker that has not stepped yet: as without placement.
    got = place(request(10), worker("prefill", step=0.0), worker("decode"), BS, OPTS)
    assert (got.where, got.reason, got.inputs) == (DISAGGREGATED, "unmeasured", None)


def test_the_trace_attributes_name_the_decision_and_its_inputs():
    attrs = place(request(40), worker("prefill"), worker("decode"), BS, OPTS).attributes()
    assert attrs["tandem.placement"] == LOCAL
    assert attrs["tandem.placement.reason"] == "cheaper_local"
    for key in ("uncached_decode_tokens", "transfer_s", "local_s", "disaggregated_s",
                "harm_local_s", "slo_class"):
        assert f"tandem.placement.{key}" in attrs


def test_slo_classes_follow_priority():
    assert [slo_class(p) for p in (-3, 0, 2)] == ["interactive", "standard", "batch"]


def test_cost_placement_is_registered_and_takes_its_flags():
    assert POLICIES["cost-placement"].places
    policy = make("cost-placement", PlacementOptions(short_prompt_tokens=32))
    assert policy.options.short_prompt_tokens == 32
    assert make("cost-placement").options == PlacementOptions()
    with pytest.raises(InvalidArgument, match="--placement"):
        make("prefix-affinity", PlacementOptions(short_prompt_tokens=32))
    for bad, field in ((dict(short_prompt_tokens=-1), "--placement-short-prompt"),
                       (dict(interference=-1.0), "--placement-interference"),
                       (dict(kv_bandwidth=0.0), "--placement-kv-bandwidth")):
        with pytest.raises(ValueError, match=field):
            PlacementOptions(**bad)


def test_prompts_already_sent_to_the_decode_worker_count_before_a_new_one():
    # A long prompt beside an idle decode worker runs there: no transfer, nobody delayed...
    p, d = worker("prefill"), worker("decode")
    assert place(request(2000), p, d, BS, OPTS).where == LOCAL
    # ...but not behind three such prompts this router placed there a moment ago, which D's
    # polls do not show yet (no first token from them): each waits for the ones before it.
    busy = WorkerLoad("decode:1", "decode", 3, 0, 0, 1000, 0, step_seconds=0.02,
                      prompt_token_seconds=1e-4, local_prefill_tokens=6000)
    got = place(request(2000), p, busy, BS, OPTS)
    assert (got.where, got.reason) == (DISAGGREGATED, "cheaper_disaggregated")
    assert got.inputs.local_s == pytest.approx((6000 + 2000) * 1e-4)
