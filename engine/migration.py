"""Live migration of a running request between decode workers, as each engine sees it.

    source engine                                    destination engine
    ─────────────                                    ──────────────────
    lend(request): a lease on the blocks of the
    KV written so far (its first K tokens) ────────▶ add_remote_request(remote: the lease,
    decodes on meanwhile (its last block is                 num_tokens K, handover): admitted,
    copied on write: the lease's stays as lent)             pulled like a prompt's KV, parked
                                                     hand_over(request, tokens made since):
    aborted by its worker once the router has              tokens recorded (not sampled), the
    switched (the lease still pins its blocks ─────▶       KV past K recomputed, decodes on
    until the destination's Release, or expiry)

What moves: the KV (pulled), the position (K, then the recorded tokens), and everything the
sampler reads, rebuilt from the tokens: a seeded sample's noise is a function of (seed, sample
index, output position), penalties count the tokens, a grammar's matcher accepts them again,
and stop strings are the router's (it holds the text). Speculative drafts are not moved: the
destination proposes afresh (drafts never change what is accepted).

This object keeps the destination's parked requests between their pull and their HandOver.
Plain Python, no torch.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from tandem.engine.config import cdiv
from tandem.engine.kv_connector import LeaseHolder
from tandem.engine.sequence import Lent, RemoteKV, Sequence, Status
from tandem.kvtransfer.lease import prompt_digest

Tokens = tuple[tuple[int, ...], ...]  # per sample


@dataclass
class Resumed:
    """A moved request at the destination, from its pull to its first token sampled here:
    when each part of the switch happened (time.monotonic(): one clock for every process of
    a host, so a client on the same host can line these up with its own; 0: not known), and
    how its tail (the tokens its source made after lending its KV) was computed."""

    parked: float = 0.0  # its KV pulled: waiting for the HandOver
    received: float = 0.0  # the worker got the HandOver
    applied: float = 0.0  # the engine recorded its tokens (between two steps)
    scheduled: float = 0.0  # the start of the step that computed its tail
    first_token: float = 0.0  # the end of the step whose outputs carry its first token here
    tail_tokens: int = 0  # tokens whose KV that step computed (the last one's sampled from)
    decode_rows: bool = False  # ... as decode rows (engine/model_runner.py _as_decode_rows)
    steps: int = 0  # engine steps from the HandOver to that first token

    def log_fields(self) -> str:
        """`timing={...}`: what benchmarks/serving/migration_stall.py reads from the log."""
        return "timing=" + json.dumps(asdict(self), separators=(",", ":"))


class Migrations:
    def __init__(self, connector: LeaseHolder, block_size: int) -> None:
        self.connector = connector
        self.block_size = block_size
        # Destination: requests pulled and waiting for their HandOver, by request id.
        self.parked: dict[str, tuple[Sequence, RemoteKV]] = {}
        # Destination: HandOvers that came before their request's pull was done.
        self.early: dict[str, Tokens] = {}
        # Destination: requests handed over whose first token here is still to come.
        self.resumed: dict[str, Resumed] = {}
        self.num_lent = 0

    def busy(self) -> bool:
        """Whether a move into this engine is under way (a request parked or resuming)."""
        return bool(self.parked or self.early or self.resumed)

    # -- source --------------------------------------------------------------------------------
    def lend(self, seqs: list[Sequence], step_in_flight: bool) -> Lent | None:
        """A lease on the KV of a running request's tokens written so far, or None when it
        has none to lend (waiting, prefilling, preempted, its own KV still arriving, forking):
        it then moves by token replay. `step_in_flight`: a pipelined step writes the KV of each
        sequence's last computed token now; the lease stops before it."""
        if any(s.status is not Status.RUNNING or s.remote is not None or s.kv_pull is not None
               or s.restoring is not None or s.replay is not None or s.pending_forks for s in seqs):
            return None
        seq = seqs[0]
        if len(seqs) > 1 or seq.params.n > 1:
            # Forked samples: their outputs' KV lies in blocks of their own, and a lease holds
            # one list of blocks; it holds the prompt's (sample 0's, shared by all until a
            # sample writes its last one: copied on write), and the destination forks the
            # samples off it and recomputes each one's outputs, as after a preemption.
            num_tokens = seq.num_prompt_tokens
        else:
            num_tokens = min(seq.num_computed_tokens - step_in_flight, seq.num_tokens - 1)
        if num_tokens < seq.num_prompt_tokens or any(
                s.num_computed_tokens < seq.num_prompt_tokens for s in seqs):
            return None
        blocks = seq.block_ids[:cdiv(num_tokens, self.block_size)]
        now = time.monotonic()
        self.connector.block_pool.incref(blocks)  # the lease's references
        lease_id, ttl = self.connector.hold(blocks, now)
        self.num_lent += 1
        return Lent(lease_id, tuple(blocks), num_tokens,
                    prompt_digest(seq.token_ids[:num_tokens]), now + ttl)

    # -- destination ---------------------------------------------------------------------------
    def park(self, seq: Sequence, remote: RemoteKV) -> Tokens | None:
        """A moving request's KV is in: it waits for its HandOver, unscheduled; the HandOver's
        tokens if they came first."""
        early = self.early.pop(seq.request_id, None)
        if early is None:
            self.parked[seq.request_id] = (seq, remote)
        self.resumed.setdefault(seq.request_id, Resumed()).parked = time.monotonic()
        return early

    def take(self, request_id: str, tokens: Tokens, known: bool
             ) -> tuple[Sequence, RemoteKV] | None:
        """The parked request a HandOver resumes; None while its pull runs (the tokens kept
        for `park`) or once it is gone (`known`: the engine still holds it)."""
        got = self.parked.pop(request_id, None)
        if got is None and known:
            self.early[request_id] = tokens
        return got

    def forget(self, request_id: str) -> None:
        """The request ended (aborted, failed) whatever its state."""
        self.parked.pop(request_id, None)
        self.early.pop(request_id, None)
        self.resumed.pop(request_id, None)
