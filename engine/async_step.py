"""Pipelined ("asynchronous") scheduling: StepPipeline, which LLMEngine owns, launches step N+1
while the device runs step N and owns the step in flight until its tokens are applied.

    call k:   schedule N+1 ─ launch N+1 (inputs, forward, sample: launches only) ─ wait for N's
              tokens (a copy to pinned memory + an event) ─ apply them ─ return N's outputs

Placeholders. Launching step N appends PLACEHOLDER to each sampling sequence's token_ids (so
num_tokens, block allocation and the scheduler's arithmetic stay right) and records which row
of N's sampled-token device tensor holds the real token (`InFlight.rows`). Step N+1 feeds that
token: its host id is the placeholder, replaced on the device from N's tensor before the
forward pass (`TokenFill`). When N's tokens reach the host they replace the placeholders
before anything reads them; the full blocks a sequence fed a placeholder filled are hashed
for the prefix cache only then (a block is never hashed with a placeholder in it).

Stops. A sequence whose placeholder makes it reach max_tokens or max_model_len will finish
for sure: it leaves the running list at launch, so no step is scheduled for it before its
token is known. One that turns out to stop (EOS, a stop token), or is aborted or stopped by a
stop string while a step that holds it is in flight, has that step's row discarded: it emits
nothing more. Its blocks are freed at once: every later step runs after the in-flight one on
the same stream (the device never reads a freed block before the in-flight step's writes to
it are done, and nothing on the host reads the sequence's blocks or tokens again).

Grammars. A row's token mask for step N+1 needs step N's token in its matcher, so a step with
a grammar row waits for N's tokens (and applies them) between launching its forward pass and
launching its sampling: the host's mask fill overlaps N+1's forward pass on the device. A row
whose sequence N's token ended is sampled without a mask (its row is discarded).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.engine import prompt_logprobs
from tandem.engine.sampler import SampleRow
from tandem.engine.sequence import FinishReason, SeqOutput, Sequence, StepResult, StopCheck
from tandem.engine.step_tokens import PendingTokens, TokenFill

if TYPE_CHECKING:
    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.scheduler import ScheduledBatch, Scheduler

# A token id not yet known on the host (never a real one: ids are checked to be >= 0).
PLACEHOLDER = -1


@dataclass
class InFlight:
    """A launched step whose tokens the host has not seen: one row per sampling sequence."""

    pending: PendingTokens
    seqs: list[Sequence]
    positions: list[int]  # index of each sequence's placeholder in its token_ids
    rows: dict[int, int]  # seq_id -> row of `pending`
    num_prompt_tokens: int  # prompt tokens of the sequences sampling their first token
    resolved: StepResult | None = None  # resolve's result, once taken


class StepPipeline:
    """The engine's pipelined steps: launches a batch behind the step in flight (`launch`) and
    applies a launched step's tokens (`resolve`). It owns the step in flight; the sequences, the
    scheduler and the runner are the engine's, and a sequence that stops ends through the
    engine's `finish` (its blocks freed, its request told)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, stops: StopCheck,
                 finish: Callable[[Sequence, FinishReason], None], enabled: bool) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.stops = stops
        self.finish = finish
        # Static conditions, the engine's: on (by default on CUDA), not in role prefill (its
        # requests end at their first token), not under tensor parallelism (steps are
        # broadcast to the other ranks as host lists).
        self.enabled = enabled
        self.inflight: InFlight | None = None

    def take_inflight(self) -> InFlight | None:
        """The step in flight, which the caller now resolves or launches behind."""
        prev, self.inflight = self.inflight, None
        return prev

    def can_launch(self, batch: ScheduledBatch) -> bool:
        """Whether this batch may run while the previous step's tokens are unknown: not with
        preemption (a victim's placeholder is resolved before it is ever recomputed), nor a
        row that needs its sample's tokens on the host (penalties, logprobs), forks its
        samples (n > 1, first token) or records tokens instead of sampling (a replay), nor a
        prompt chunk whose prompt logprobs are still to compute (their logits are read on the
        host). A grammar's row takes the previous step's tokens before its sampling is launched
        (the module's doc). The engine also asks its KV pulls: one that writes the pool outside
        this stream at once must find no step in flight (it may still write blocks freed
        since)."""
        if batch.preempted:
            return False
        for seq in batch.seqs:
            p = seq.params
            # spec_token_ids: drafts, of which a verify step keeps 1 to k + 1 tokens
            if (seq.pending_forks or p.logprobs is not None or p.has_penalties
                    or prompt_logprobs.pending(seq) or seq.spec_token_ids
                    or seq.replay is not None):
                return False
        return True

    def launch(self, batch: ScheduledBatch, prev: InFlight | None) -> StepResult:
        """Launch `batch` with no host sync; it becomes the step in flight. `prev`: the step
        in flight until now, whose tokens this one reads on the device (resolved after).
        Nothing is output or sampled yet (as resolve counts)."""
        fill = TokenFill(prev.pending.device) if prev is not None else None
        rows: list[SampleRow] = []
        row_index: list[int] = []
        samplers: list[Sequence] = []
        fed: set[int] = set()  # seq_ids fed a placeholder: their blocks are hashed later
        offset = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if prev is not None:
                r = prev.rows.get(seq.seq_id)
                if r is not None:  # its token at num_computed_tokens is still a placeholder
                    fill.dst.append(offset)
                    fill.src.append(r)
                    fed.add(seq.seq_id)
            offset += n
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end samples nothing
            samplers.append(seq)
            rows.append(SampleRow(seq.params, seq.sample_index, seq.num_output_tokens,
                                  grammar=seq.grammar))
            row_index.append(offset - 1)
        started = time.monotonic()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = started

        def take_previous() -> None:
            """Before sampling under a grammar: the previous step's tokens into the matchers;
            rows whose sequence they ended are sampled unmasked (and discarded)."""
            self.resolve(prev)  # type: ignore[arg-type]
            for row, seq in zip(rows, samplers):
                if seq.is_finished:
                    row.grammar = None

        grammar = prev is not None and any(r.grammar is not None for r in rows)
        t = time.perf_counter()
        pending = self.runner.execute(batch, rows, row_index, fill if fill else None,
                                      defer=True, before_sample=take_previous if grammar else None)
        execute_s = time.perf_counter() - t
        now = time.monotonic()

        # Sequences the previous step's tokens ended (taken before a grammar row's sampling):
        # their blocks are freed, their row here is discarded.
        ended = {s.seq_id for s in samplers if s.is_finished} if grammar else set()
        self.scheduler.advance(batch, started, now, fed | ended)
        positions = []
        num_prompt_tokens = 0
        done: set[int] = set()
        max_model_len = self.stops.max_model_len
        for seq in samplers:
            if seq.seq_id in ended:
                positions.append(-1)
                continue
            if seq.num_tokens == seq.num_prompt_tokens:
                num_prompt_tokens += seq.num_prompt_tokens
            positions.append(seq.num_tokens)
            seq.token_ids.append(PLACEHOLDER)
            if seq.num_output_tokens >= seq.params.max_tokens \
                    or seq.num_tokens >= max_model_len:
                done.add(seq.seq_id)  # finishes with this token: schedule nothing more
        if done:
            self.scheduler.retire(done)
        self.inflight = InFlight(pending, samplers, positions,
                                 {s.seq_id: i for i, s in enumerate(samplers)},
                                 num_prompt_tokens)
        return StepResult([], execute_s=execute_s)

    def resolve(self, f: InFlight) -> StepResult:
        """Wait for a launched step, apply its tokens: its outputs, tokens sampled, and prompt
        tokens of the sequences sampling their first. Once: a later call (the step that took
        them before its grammar rows' sampling, then the engine) returns the same result."""
        if f.resolved is None:
            f.resolved = self._apply_tokens(f)
        return f.resolved

    def _apply_tokens(self, f: InFlight) -> StepResult:
        t = time.perf_counter()
        tokens = f.pending.tolist()
        execute_s = time.perf_counter() - t  # the runner's share, as in a synchronous step
        now = time.monotonic()
        kv = self.scheduler.kv
        bs = kv.block_size
        outputs = []
        for seq, pos, tok in zip(f.seqs, f.positions, tokens):
            if seq.is_finished:  # stopped or aborted while in flight: the row is discarded
                continue
            seq.token_ids[pos] = tok
            seq.logprobs.append(None)
            if seq.grammar is not None:  # sampled under its mask: taken at the next fill
                seq.grammar.defer(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            # A block filled by a step that fed this placeholder is all known now (a later
            # placeholder sits at num_computed_tokens, outside it).
            if seq.num_computed_tokens // bs > seq.num_cached_blocks:
                kv.cache_full_blocks(seq)
            num_out = pos + 1 - seq.num_prompt_tokens
            reason = self.stops(seq.params, tok, num_out, pos + 1)
            if reason is not None:
                del seq.token_ids[pos + 1:]  # the next step's placeholder: never known
                self.finish(seq, reason)
            outputs.append(SeqOutput(seq.request_id, seq.sample_index, [tok], [None],
                                     seq.finish_reason, seq.num_prompt_tokens,
                                     seq.num_cached_tokens, num_out,
                                     timing=seq.timing() if reason is not None else None))
        # Rows discarded are not counted.
        return StepResult(outputs, len(outputs), f.num_prompt_tokens, execute_s)
