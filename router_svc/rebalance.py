"""Rebalance: move a running request off a decode worker whose KV pool is nearly full to one
with room, by live migration (router_svc/live_migration.py), before the full one preempts.

    every poll round (router_svc/workers.py):
      source S: a decode worker this router routes to whose Load shows pressure
                (requests waiting or preempted there, or free blocks below --rebalance-free-fraction
                of its pool), with fewer than --rebalance-max-moves of its moves in flight
      destination D: another one with no request waiting that keeps at least that fraction free
                after taking the request (the most free blocks wins)
      request: one of this router's requests decoding on S (tokens came from there since the
               last round: not waiting or preempted, so it has KV to lend), the one with the
               most tokens still to make (a move pays for the tokens after it)
      ──▶ StreamRequest.lend to S ──▶ S lends the request's KV (RequestUpdate.move + rebalance)
      ──▶ the live migration's handover to D; S's blocks come free once D has released the lease

Token replay is never used here: a request S cannot lend (waiting, preempted) stays on
S, and a move whose destination fails before it pulled leaves the request where it was. Every
ask ends with one outcome on tandem:rebalance_moves{outcome}: moved, not_lent (S had no KV to
lend), failed (D failed before its pull), ended (the request finished or left first).

Plain Python over the router's loads: no torch.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter

from tandem.errors import InvalidArgument
from tandem.router_svc.workers import Worker, WorkerSet

log = logging.getLogger(__name__)

OUTCOMES = ("moved", "not_lent", "failed", "ended")


@dataclass(frozen=True)
class RebalanceConfig:
    """--rebalance, --rebalance-free-fraction, --rebalance-max-moves."""

    enabled: bool = False
    free_fraction: float = 0.1  # a pool with fewer free blocks than this share is under pressure
    max_moves: int = 1  # moves in flight off one source worker at a time

    def __post_init__(self) -> None:
        if not 0.0 < self.free_fraction < 1.0:
            raise InvalidArgument("--rebalance-free-fraction",
                                  f"must be in (0, 1), got {self.free_fraction}")
        if self.max_moves < 1:
            raise InvalidArgument("--rebalance-max-moves", f"must be >= 1, got {self.max_moves}")


@dataclass(frozen=True)
class Candidate:
    """What a running request tells the rebalancer about itself."""

    blocks: int  # KV blocks it holds now (prompt and tokens so far)
    remaining: int  # tokens it may still make (max_tokens left, summed over its samples)


class Movable(Protocol):
    """A request's decode legs (router_svc/decode_legs.py) as the rebalancer moves them."""

    def rebalance_candidate(self, block_size: int) -> Candidate | None: ...

    def ask_move(self, dst: Worker, reason: str) -> bool: ...


@dataclass(eq=False)
class _Pending:
    src: Worker
    dst: Worker
    blocks: int  # reserved on dst until the move ends


class Rebalancer:
    def __init__(self, workers: WorkerSet, config: RebalanceConfig,
                 registry: CollectorRegistry | None = None) -> None:
        self.workers = workers
        self.config = config
        self.moves = Counter("tandem:rebalance_moves", "Requests the router asked to move off a "
                             "decode worker under KV pressure (rebalance), by outcome: moved "
                             "(live migration), not_lent (no KV to lend there: it stayed), "
                             "failed (the destination failed before its pull: it stayed), "
                             "ended (it finished first)", ["outcome"],
                             registry=registry or workers.metrics.registry)
        for outcome in OUTCOMES:
            self.moves.labels(outcome)
        self._running: dict[str, set[Movable]] = {}  # worker address -> requests decoding there
        self._pending: dict[Movable, _Pending] = {}
        self._task: asyncio.Task | None = None

    # -- what the legs report ------------------------------------------------------------------
    def track(self, w: Worker, legs: Movable) -> None:
        self._running.setdefault(w.address, set()).add(legs)

    def untrack(self, w: Worker, legs: Movable) -> None:
        on = self._running.get(w.address)
        if on is not None:
            on.discard(legs)
            if not on:
                del self._running[w.address]

    def done(self, legs: Movable, outcome: str) -> None:
        """The move asked of `legs` ended so."""
        pending = self._pending.pop(legs, None)
        if pending is not None:
            self.moves.labels(outcome).inc()

    # -- deciding ------------------------------------------------------------------------------
    def pressure(self, w: Worker) -> str | None:
        """Why w's pool is nearly full (its last poll), or None: `waiting` (requests wait or
        were preempted there) or `free_blocks`."""
        ld = w.load
        if ld.num_waiting:
            return "waiting"
        if ld.num_blocks and ld.num_free_blocks < self.config.free_fraction * ld.num_blocks:
            return "free_blocks"
        return None

    def step(self) -> int:
        """One round of decisions over the loads just polled: the moves asked."""
        decode = self.workers.by_role("decode")
        asked = 0
        for src in decode:
            # Asked once a round, whether or not src is under pressure: a request is a
            # candidate when it made tokens since the last round.
            candidates = self._candidates(src)
            reason = self.pressure(src)
            if reason is None:
                continue
            room = self.config.max_moves - sum(p.src is src for p in self._pending.values())
            for legs, c in candidates:
                if room <= 0:
                    break
                if self._ask(src, legs, c, reason, decode):
                    asked += 1
                    room -= 1
        return asked

    def _candidates(self, src: Worker) -> list[tuple[Movable, Candidate]]:
        """src's requests that may move now, the most tokens still to make first."""
        got = []
        for legs in list(self._running.get(src.address, ())):
            c = legs.rebalance_candidate(self.workers.block_size)
            if c is not None and legs not in self._pending:
                got.append((legs, c))
        return sorted(got, key=lambda lc: -lc[1].remaining)

    def _ask(self, src: Worker, legs: Movable, c: Candidate, reason: str,
             decode: list[Worker]) -> bool:
        dst = self._destination(src, c.blocks, decode)
        if dst is None:
            return False
        self._pending[legs] = _Pending(src, dst, c.blocks)
        if not legs.ask_move(dst, reason):
            self._pending.pop(legs, None)
            return False
        log.info("rebalance: asked %s to lend a request (%d blocks, %s) for %s", src.address,
                 c.blocks, reason, dst.address)
        return True

    def _destination(self, src: Worker, blocks: int, decode: list[Worker]) -> Worker | None:
        """The decode worker with the most free blocks that keeps the free fraction after
        taking `blocks` more (those already reserved by moves in flight counted)."""
        best: Worker | None = None
        best_free = 0
        for w in decode:
            ld = w.load
            if w is src or not w.healthy or ld.num_waiting or not ld.num_blocks:
                continue
            free = ld.num_free_blocks - sum(p.blocks for p in self._pending.values()
                                            if p.dst is w)
            if free - blocks < self.config.free_fraction * ld.num_blocks:
                continue
            if best is None or free > best_free:
                best, best_free = w, free
        return best

    # -- running -------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rebalance")

    async def _run(self) -> None:
        while True:
            await self.workers.next_round()
            try:
                self.step()
            except Exception:  # a decision gone wrong must not stop the next rounds
                log.exception("rebalance round failed")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
