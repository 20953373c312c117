"""Routing policies (router_svc/routing/) on plain data, the registry behind
`tandem router --routing-policy`, and the WorkerSet that hands a policy its candidates.

The default policy makes the picks WorkerSet made before policies were objects of their own:
`_picks_before` below is that code, kept as the reference, and a property test holds the two
equal over random worker sets, loads, caches and exclusions."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.errors import InvalidArgument
from tandem.router_svc.routing import (
    DEFAULT_POLICY,
    POLICIES,
    RouteRequest,
    RoutingPolicy,
    WorkerLoad,
    make_policy,
)
from tandem.router_svc.routing.least_loaded import LeastLoaded
from tandem.router_svc.routing.prefix_affinity import PrefixAffinity
from tandem.router_svc.workers import Worker, WorkerSet
from tandem.v1 import worker_pb2

REQUEST = RouteRequest(list(range(1, 65)))


def load(address: str, queued: int = 0, *, in_flight: int = 0, running: int = 0,
         free: int = 0, cached: int = 0, role: str = "prefill") -> WorkerLoad:
    """A worker with `queued` requests waiting in its engine (besides `in_flight`) and
    `running` of other routers' running there."""
    return WorkerLoad(address, role, in_flight, queued, running, free, cached,
                      other_running=running, other_waiting=queued)


# -- prefix-affinity (the default) ----------------------------------------------------------
def test_prefix_affinity_prefill_follows_the_longest_prefix_within_the_slack():
    policy = PrefixAffinity(balance_slack=2)
    a, b, c = load("a", 0, cached=0), load("b", 2, cached=2), load("c", 1, cached=5)
    assert policy.pick_prefill(REQUEST, [a, b, c]) is c
    c = load("c", 3, cached=5)  # 3 more than the least busy: past the slack
    assert policy.pick_prefill(REQUEST, [a, b, c]) is b
    b = load("b", 2, cached=0)  # no prefix anywhere near: the least busy
    assert policy.pick_prefill(REQUEST, [a, b, c]) is a
    tied = [load("x", 1, cached=3), load("y", 0, cached=3)]
    assert policy.pick_prefill(REQUEST, tied) is tied[1]  # equal prefixes: the least busy


def test_prefix_affinity_decode_follows_the_conversation_then_free_blocks_per_request():
    policy = PrefixAffinity()
    a = load("a", free=100, role="decode")
    b = load("b", free=60, running=1, role="decode")  # 30 a request
    c = load("c", free=40, role="decode")
    assert policy.pick_decode(REQUEST, [a, b, c]) is a
    held = load("c", free=40, cached=1, role="decode")
    assert policy.pick_decode(REQUEST, [a, b, held]) is held
    # Equal free blocks per request: the one with fewer of this router's requests in flight.
    x, y = load("x", in_flight=1, free=20, role="decode"), load("y", free=10, role="decode")
    assert policy.pick_decode(REQUEST, [x, y]) is y


def test_prefix_affinity_refuses_a_negative_slack():
    with pytest.raises(ValueError, match="balance_slack"):
        PrefixAffinity(balance_slack=-1)


# -- least-loaded ---------------------------------------------------------------------------
def test_least_loaded_is_blind_to_caches():
    policy = LeastLoaded()
    holder, idle = load("holder", 1, cached=4), load("idle", 0)
    assert policy.pick_prefill(REQUEST, [holder, idle]) is idle
    assert policy.pick_decode(REQUEST, [load("h", 1, cached=4, free=9, role="decode"),
                                        d := load("d", 0, free=1, role="decode")]) is d


def test_least_loaded_ties_take_turns_per_leg():
    policy = LeastLoaded()
    ps = [load("p0"), load("p1"), load("p2", 1)]
    ds = [load("d0", free=8, role="decode"), load("d1", free=8, role="decode")]
    prefills = [policy.pick_prefill(REQUEST, ps).address for _ in range(4)]
    decodes = [policy.pick_decode(REQUEST, ds).address for _ in range(3)]
    assert prefills == ["p0", "p1", "p0", "p1"]  # p2 has a request queued: never
    assert decodes == ["d0", "d1", "d0"]  # the prefill leg's turns are its own


def test_least_loaded_decode_prefers_free_blocks_among_the_least_busy():
    policy = LeastLoaded()
    ds = [load("full", free=2, role="decode"), load("roomy", free=50, role="decode"),
          load("busy", 1, free=500, role="decode")]
    assert [policy.pick_decode(REQUEST, ds).address for _ in range(2)] == ["roomy", "roomy"]


# -- every registered policy ----------------------------------------------------------------
worker_loads = st.lists(st.builds(
    WorkerLoad, st.sampled_from(["a", "b", "c", "d"]), st.sampled_from(["prefill", "decode"]),
    st.integers(0, 9), st.integers(0, 9), st.integers(0, 9), st.integers(0, 300),
    st.integers(0, 8)), min_size=1, max_size=6)


@pytest.mark.parametrize("name", sorted(POLICIES))
@given(workers=worker_loads, priority=st.integers(-5, 5))
def test_every_policy_picks_one_of_the_workers_it_is_given(name, workers, priority):
    policy = make_policy(name)
    request = RouteRequest(list(range(40)), list(range(2)), priority)
    for pick in (policy.pick_prefill, policy.pick_decode):
        chosen = pick(request, workers)
        assert any(chosen is w for w in workers)


def test_the_registry_is_the_flags_choices():
    assert DEFAULT_POLICY == "prefix-affinity" and set(POLICIES) >= {"prefix-affinity",
                                                                     "least-loaded"}
    for name, cls in POLICIES.items():
        assert cls.name == name and isinstance(make_policy(name), cls) and cls.summary
    from tandem.router_svc.server import add_router_args

    p = argparse.ArgumentParser()
    add_router_args(p)
    flag = next(a for a in p._actions if "--routing-policy" in a.option_strings)
    assert (sorted(flag.choices), flag.default) == (sorted(POLICIES), DEFAULT_POLICY)
    assert p.parse_args(["--model", "m", "--routing-policy", "least-loaded"]).routing_policy \
        == "least-loaded"


def test_an_unknown_policy_is_refused_naming_the_flag():
    with pytest.raises(InvalidArgument) as e:
        make_policy("random")
    assert e.value.field == "--routing-policy" and "least-loaded" in e.value.message


# -- the WorkerSet that feeds a policy ------------------------------------------------------
def _worker_set(specs, policy: RoutingPolicy | None = None) -> WorkerSet:
    """specs: (role, healthy, draining, in_flight, waiting, running, free) per worker."""
    ws = WorkerSet([], [], [], policy=policy)
    for i, (role, healthy, draining, in_flight, waiting, running, free) in enumerate(specs):
        w = Worker(f"w{i}", role, None, None, None, healthy=healthy, slot=i,
                   in_flight=in_flight, draining=draining)
        w.polled(worker_pb2.Load(num_waiting=waiting, num_running=running,
                                 num_free_blocks=free))
        ws.workers.append(w)
    return ws


def _picks_before(ws: WorkerSet, leg: str, role: str, prompt: list[int], exclude: set[str],
                  cache_salt: str, slack: int = 4) -> Worker | None:
    """WorkerSet.pick_prefill / pick_decode as they were before routing policies, verbatim
    but for their names and their counts of requests ahead (this router's in flight, exact,
    plus other routers' waiting: Worker.queued) and in the decode tie-break (the same with
    other routers' running: Worker.other_running): the reference the default policy must match
    pick for pick."""
    candidates = [w for w in ws.by_role(role) if w.address not in exclude]
    if not candidates:
        return None

    def score_load(w: Worker) -> int:
        return w.queued

    least = min(score_load(w) for w in candidates)
    near = [w for w in candidates if score_load(w) - least <= slack]
    hashes = ws.prefix_hashes(prompt, cache_salt)
    hits = ws.cached_blocks(near, hashes)
    if leg == "prefill":
        return max(near, key=lambda w: (hits[w.address], -score_load(w)))
    return max(near, key=lambda w: (hits[w.address],
                                    w.load.num_free_blocks / (1 + max(w.in_flight,
                                                                      w.load.num_running)),
                                    -w.in_flight))


# Mostly routable workers (healthy, not draining), so that most examples have several
# candidates of a role to choose from.
worker_specs = st.lists(st.tuples(
    st.sampled_from(["prefill", "decode", "both"]), st.sampled_from([True, True, True, False]),
    st.sampled_from([False, False, False, True]), st.integers(0, 8), st.integers(0, 8),
    st.integers(0, 8), st.integers(0, 64)), min_size=1, max_size=8)


@settings(max_examples=300)
@given(specs=worker_specs, prompt_len=st.integers(0, 100), salt=st.sampled_from(["", "t"]),
       cached=st.lists(st.tuples(st.integers(0, 6), st.sampled_from(["", "t"])), min_size=8,
                       max_size=8),
       exclude=st.sets(st.sampled_from([f"w{i}" for i in range(8)]), max_size=2))
def test_the_default_policy_picks_as_the_router_did_before(specs, prompt_len, salt, cached,
                                                           exclude):
    ws = _worker_set(specs)
    prompt = [(13 * i) % 250 + 1 for i in range(prompt_len)]
    for w, (blocks, their_salt) in zip(ws.workers, cached):
        ws.kv_index.apply(w.slot, ws.prefix_hashes(prompt, their_salt)[:blocks], [])
    request = RouteRequest(prompt, ws.prefix_hashes(prompt, salt))
    assert ws.pick_prefill(request, exclude) is _picks_before(ws, "prefill", "prefill", prompt,
                                                              exclude, salt)
    for role in ("decode", "both"):
        assert ws.pick_decode(request, role, exclude) is _picks_before(ws, "decode", role,
                                                                       prompt, exclude, salt)


def test_a_burst_after_a_burst_spreads_though_the_last_poll_still_counts_the_first():
    """Decode worker w0's last poll counted 6 running requests, all this router's; they have
    ended since (none in flight) and the next poll has not come. A burst of 6 spreads 3 and 3:
    w0 counts as idle, not as running 6 (which sent five of the six to w1). Had the 6 been another
    router's, w0 is busy: w1 takes five, until it is queued past the balance slack."""
    for in_flight_at_poll, spread in ((6, [3, 3]), (0, [1, 5])):
        ws = _worker_set([("decode", True, False, in_flight_at_poll, 0, 6, 100),
                          ("decode", True, False, 0, 0, 0, 100)])
        ws.workers[0].in_flight = 0
        picks = []
        for _ in range(6):
            w = ws.pick_decode(REQUEST)
            w.in_flight += 1  # as the router counts a request it sent
            picks.append(w.address)
        assert sorted(picks.count(a) for a in ("w0", "w1")) == spread, picks


@pytest.mark.parametrize("policy", [None, LeastLoaded()], ids=["prefix-affinity", "least-loaded"])
def test_a_burst_after_a_queue_drained_spreads_though_the_last_poll_still_counts_the_queue(
        policy):
    """Prefill worker w0's last poll counted 1 running and 7 waiting, all this router's; they
    have ended since and the next poll has not come. A burst of 6 prefills spreads 3 and 3: w0
    counts as idle, not as 7 queued (and the 7 of this router's in flight then, twice). Had the
    8 been another router's, w0 has 7 ahead of a new one and w1 takes the burst first."""
    for in_flight_at_poll, spread in ((8, [3, 3]), (0, [0, 6])):
        ws = _worker_set([("prefill", True, False, in_flight_at_poll, 7, 1, 100),
                          ("prefill", True, False, 0, 0, 0, 100)], policy)
        ws.workers[0].in_flight = 0
        picks = []
        for _ in range(6):
            w = ws.pick_prefill(REQUEST)
            w.in_flight += 1
            picks.append(w.address)
        assert sorted(picks.count(a) for a in ("w0", "w1")) == spread, picks


class Recording(RoutingPolicy):
    """Picks the last worker, and keeps what it was given."""

    name = "recording"
    summary = "for tests"

    def __init__(self, uses_prefix_cache: bool) -> None:
        self.uses_prefix_cache = uses_prefix_cache
        self.given: list[list[WorkerLoad]] = []

    def pick_prefill(self, request, workers):
        self.given.append(list(workers))
        return workers[-1]

    pick_decode = pick_prefill


@pytest.mark.parametrize("uses_cache", [True, False])
def test_a_policy_sees_only_routable_workers_and_the_caches_it_asks_for(uses_cache):
    policy = Recording(uses_cache)
    ws = _worker_set([("prefill", True, False, 1, 2, 3, 40), ("prefill", False, False, 0, 0, 0, 9),
                      ("prefill", True, True, 0, 0, 0, 9), ("prefill", True, False, 0, 0, 0, 9),
                      ("decode", True, False, 0, 0, 0, 9)], policy)
    prompt = list(range(1, 50))  # 3 full blocks
    request = asyncio.run(ws.route_request(prompt, priority=3))
    assert request.priority == 3
    assert list(request.block_hashes) == (ws.prefix_hashes(prompt) if uses_cache else [])
    ws.kv_index.apply(0, ws.prefix_hashes(prompt)[:2], [])
    assert ws.pick_prefill(request) is ws.workers[3]
    assert ws.pick_prefill(request, exclude={"w3"}) is ws.workers[0]
    assert ws.pick_prefill(request, exclude={"w0", "w3"}) is None  # the rest are out
    assert len(policy.given) == 2  # no candidate: the policy is not asked
    # Down (w1), draining (w2), excluded and other roles never reach the policy.
    assert [w.address for w in policy.given[0]] == ["w0", "w3"]
    assert policy.given[0][0] == WorkerLoad("w0", "prefill", 1, 2, 3, 40,
                                            2 if uses_cache else 0, other_running=3 - 1,
                                            other_waiting=2)


def test_a_policy_that_picks_a_stranger_is_a_bug_named():
    class Stranger(Recording):
        def pick_prefill(self, request, workers):
            return load(workers[0].address)  # equal, but not one of them

    ws = _worker_set([("prefill", True, False, 0, 0, 0, 0)], Stranger(False))
    with pytest.raises(TypeError, match="'recording' picked"):
        ws.pick_prefill(REQUEST)
