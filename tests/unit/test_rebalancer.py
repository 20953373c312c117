"""The rebalancer's decisions over polled loads (router_svc/rebalance.py): which worker is under
pressure, which request is asked to move and where, the bound on moves in flight per worker,
and one outcome counted per ask. Plain objects, no stack."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from tandem.errors import InvalidArgument
from tandem.router_svc.rebalance import Candidate, RebalanceConfig, Rebalancer
from tandem.v1 import worker_pb2


@dataclass(eq=False)
class W:
    address: str
    load: worker_pb2.Load
    healthy: bool = True
    leaving: bool = False


@dataclass
class Workers:
    decode: list[W]
    block_size: int = 16

    def by_role(self, role: str) -> list[W]:
        return [w for w in self.decode if w.healthy and not w.leaving]


@dataclass(eq=False)
class Legs:
    candidate: Candidate | None
    asked: list[tuple[str, str]] = field(default_factory=list)

    def rebalance_candidate(self, block_size: int) -> Candidate | None:
        return self.candidate

    def ask_move(self, dst: W, reason: str) -> bool:
        self.asked.append((dst.address, reason))
        return True


def load(free: int, blocks: int = 100, waiting: int = 0) -> worker_pb2.Load:
    return worker_pb2.Load(num_free_blocks=free, num_blocks=blocks, num_waiting=waiting)


def make(config: RebalanceConfig, *workers: W) -> tuple[Rebalancer, CollectorRegistry]:
    reg = CollectorRegistry()
    return Rebalancer(Workers(list(workers)), config, reg), reg  # type: ignore[arg-type]


def moved(reg: CollectorRegistry, outcome: str) -> float:
    return reg.get_sample_value("tandem:rebalance_moves_total", {"outcome": outcome})


def test_moves_the_request_with_most_tokens_left_to_the_worker_with_most_room():
    full, roomy, roomier = W("a", load(5)), W("b", load(60)), W("c", load(80))
    r, reg = make(RebalanceConfig(True, 0.1, 1), full, roomy, roomier)
    short, long = Legs(Candidate(10, 20)), Legs(Candidate(10, 300))
    r.track(full, short)
    r.track(full, long)
    assert r.step() == 1
    assert long.asked == [("c", "free_blocks")] and short.asked == []
    assert r.step() == 0  # one move in flight off `full` at most
    r.done(long, "moved")
    r.untrack(full, long)  # it decodes on `c` now
    assert moved(reg, "moved") == 1
    assert r.step() == 1 and short.asked == [("c", "free_blocks")]


def test_waiting_requests_are_pressure_and_no_destination_is_left_below_the_fraction():
    busy = W("a", load(50, waiting=2))
    tight = W("b", load(25))  # 5 free after taking 20 blocks: below 10% of its pool
    r, reg = make(RebalanceConfig(True, 0.1, 2), busy, tight)
    legs = Legs(Candidate(20, 100))
    r.track(busy, legs)
    assert r.pressure(busy) == "waiting" and r.pressure(tight) is None
    assert r.step() == 0 and legs.asked == []
    tight.load = load(40)
    assert r.step() == 1 and legs.asked == [("b", "waiting")]
    r.done(legs, "not_lent")
    r.done(legs, "moved")  # a second report of the same ask is not counted
    assert moved(reg, "not_lent") == 1 and moved(reg, "moved") == 0


def test_nothing_moves_without_pressure_or_without_a_candidate():
    a, b = W("a", load(50)), W("b", load(90))
    r, _ = make(RebalanceConfig(True, 0.1, 1), a, b)
    legs = Legs(Candidate(4, 100))
    r.track(a, legs)
    assert r.step() == 0
    a.load = load(2)
    r.untrack(a, legs)
    assert r.step() == 0
    r.track(a, Legs(None))  # not decoding there yet, or asked already
    assert r.step() == 0


@pytest.mark.parametrize("fraction,moves,field", [(0.0, 1, "--rebalance-free-fraction"),
                                                  (1.0, 1, "--rebalance-free-fraction"),
                                                  (0.1, 0, "--rebalance-max-moves")])
def test_bad_flags_name_the_flag(fraction, moves, field):
    with pytest.raises(InvalidArgument, match=field):
        RebalanceConfig(True, fraction, moves)
