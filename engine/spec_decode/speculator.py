"""The engine's speculative decoding: drafts proposed before a step, scored in it, accepted
after it. One object, the engine's (`LLMEngine.spec`), which owns the proposer and the counters.

A step with drafts (a "verify" step) is an ordinary step in which a speculating decode carries
1 + k tokens instead of one, like a prefill chunk: its last token and its k drafts, at
positions L-1 .. L+k-1, KV written for all of them through the same paged attention:

    token_ids:   t0 t1 ... t(L-1) | d0 d1 d2        (drafts in spec_token_ids, not token_ids)
    rows:                 r0        r1 r2 r3         row j samples output position L+j
    sampled:              x0        x1 x2 x3

Each row j samples exactly as a one-token step at that position would (the same SampleRow:
penalties over the outputs with d0..d(j-1) taken, logit_bias, min_tokens at its position, the
grammar's matcher advanced over d0..d(j-1), temperature, top-k/p, min-p, and a seeded row's
noise drawn for that output position). Accepted: x0 .. xa, where a is the first j with
xj != dj (or k). Row j's context is the true one exactly when d0..d(j-1) were accepted, so
every kept token was sampled from the model's own distribution given the tokens before it:

  - greedy: the longest prefix of drafts equal to the model's argmax, plus the next argmax;
  - sampling: draft dj is kept with probability p(dj) (the chance xj == dj), and on rejection
    the token kept is xj given xj != dj, i.e. drawn from p with dj removed and renormalised:
    the standard rejection rule for a draft proposed with certainty (q(dj) = 1: accept with
    min(1, p/q), else sample the residual max(0, p - q)). The output's distribution is the
    model's; a seeded request's tokens are even the same as without speculation, whatever
    was drafted, since position P's noise is seeded by P alone (engine/sampler.py).

Logprobs are row j's raw log-softmax at the kept token, as a one-token step reports them. Stop
tokens, max_tokens and stop strings apply token by token to the kept tokens (the engine's
_append, the router's detokenizer); tokens after a stop are dropped.

Rejected positions' KV is dropped by moving the sequence's computed length back
(KVCacheManager.rewind): blocks allocated for them only are freed, nothing is copied.

Back-off: speculation costs compute that large batches need; no sequence speculates in a step
with more than `max_batch` running sequences (engine/config.py SpeculativeConfig), nor while a
prompt waits or is being prefilled (that step's budget goes to the prompt, and a verify row
would make it synchronous: on an H200 speculating through a batch of 64's admission cost 5%
of its throughput, benchmarks/engine/spec_decode.py throughput). And a sample
whose drafts are rarely accepted sits out a few steps before proposing again
(engine/spec_decode/backoff.py), so it does not pay for proposals and verify rows it gains
little from.

Pipelined steps: a verify step is synchronous, and so is proposing while a step is in flight
(the drafts continue its token). With a step in flight, `expects_draft` asks the proposer
whether a draft is expected once that token is known; if no sequence expects one, the step
stays pipelined without drafts (engine/llm_engine.py `_speculate`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from tandem.engine.async_step import PLACEHOLDER
from tandem.engine.block_pool import BlockPool
from tandem.engine.config import SpeculativeConfig
from tandem.engine.sampler import SampleRow
from tandem.engine.sequence import Sequence
from tandem.engine.spec_decode.backoff import AcceptanceBackOff
from tandem.engine.spec_decode.ngram import NgramProposer
from tandem.engine.spec_decode.proposer import ProposeInput, Proposer

log = logging.getLogger(__name__)


@dataclass
class SpecCounters:
    """What speculation did, engine-wide (metrics)."""

    num_verifies: int = 0  # (sequence, step) pairs that scored drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Per draft position j: drafts at j scored, and of them accepted.
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    # Steps with a pipelined step in flight in which some sample might have speculated: the
    # step resolved to propose (synchronous), or kept pipelined as no draft was expected.
    num_resolved_steps: int = 0
    num_pipelined_steps: int = 0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_verifies += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        while len(self.drafted_at) < num_drafts:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for j in range(num_drafts):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < num_accepted


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.counters = SpecCounters()
        self.backoff = AcceptanceBackOff(config.min_acceptance, config.probe_interval)
        # seq_id -> grammar states for rows 1..k (row j's advanced over drafts 0..j-1)
        self._grammars: dict[int, list] = {}
        self._drafted = False  # the last propose() gave some sequence a draft
        self._on = False  # begin_step's verdict: this step may speculate

    @classmethod
    def build(cls, config: SpeculativeConfig, draft: Proposer | None = None) -> Speculator:
        """The configured method's proposer: prompt lookup, or `draft`, the draft model's
        (engine/spec_decode/draft.py DraftProposer, loaded by the engine before its model so
        that the model's KV pool is sized from the memory the draft leaves)."""
        if config.method == "draft":
            assert draft is not None, "method draft needs the draft model's proposer"
            return cls(config, draft)
        return cls(config, NgramProposer(config.ngram_min, config.ngram_max))

    # -- before the step -----------------------------------------------------------------
    def active(self, num_running: int) -> bool:
        """The per-step back-off: speculate only in batches this small."""
        return 0 < num_running <= self.config.max_batch

    def begin_step(self, running: list[Sequence], prompts_waiting: bool) -> bool:
        """A new step: whether any running sequence may get a draft in it (the batch small
        enough, no prompt waiting or mid-prefill, and one sequence that neither opted out nor
        is paused for low acceptance). Counts the paused ones' steps. The answer also holds
        for this step's propose()."""
        backoff = self.backoff
        backoff.tick()
        self._on = self.active(len(running)) and not prompts_waiting and not any(
            s.num_computed_tokens < s.num_tokens - 1 and s.kv_pull is None for s in running)
        if not self._on:
            return False
        wanted = False
        for seq in running:
            if seq.params.speculative:
                if backoff.allows(seq.seq_id):
                    wanted = True
                else:
                    backoff.counters.num_paused_steps += 1
        return wanted

    def expects_draft(self, running: list[Sequence], max_model_len: int) -> bool:
        """With a pipelined step in flight, after begin_step said yes: whether a sequence that
        may speculate is expected to get a draft once the step's tokens are known (its
        proposer's `expects_draft`, from the tokens known; a proposer without one, the draft
        model's, always may). No: the step stays pipelined and proposes nothing, as
        resolving the step in flight would make it synchronous for no draft. Counted."""
        seqs = [s for s in running if self._limit(s, max_model_len) > 0]
        expects = getattr(self.proposer, "expects_draft", None)
        if seqs and (expects is None or expects(seqs)):
            self.counters.num_resolved_steps += 1
            return True
        self.counters.num_pipelined_steps += 1
        return False

    def propose(self, running: list[Sequence], max_model_len: int) -> int:
        """Drafts for the running sequences that may speculate (spec_token_ids set), or none
        at all when the batch is too large; the number of sequences given one."""
        if self._drafted:  # a draft left unscheduled last step is stale or unwanted now
            for seq in running:
                seq.spec_token_ids = []
            self._grammars.clear()
            self._drafted = False
        if not self._on:
            return 0
        seqs, room = [], []
        for seq in running:
            k = self._room(seq, max_model_len)
            if k > 0:
                seqs.append(seq)
                room.append(k)
        if not seqs:
            return 0
        try:
            drafts = self.proposer.propose(ProposeInput(seqs, room))
        except Exception:  # drafts only change the speed: the step goes on without them
            log.exception("the %s proposer failed; this step decodes without drafts",
                          self.config.method)
            return 0
        n = 0
        for seq, draft in zip(seqs, drafts):
            if seq.grammar is not None and draft:
                draft = self._vet(seq, draft)
            seq.spec_token_ids = list(draft)
            n += bool(draft)
        self._drafted = n > 0
        return n

    def _room(self, seq: Sequence, max_model_len: int) -> int:
        """Drafts seq may take: 0 unless it is decoding (its last token known, nothing else
        to compute, no samples to fork, its last token not in flight), at most k, and never
        past max_tokens or the model's length (the last kept token is sampled, not drafted:
        hence the - 1)."""
        if seq.token_ids[-1] == PLACEHOLDER:
            return 0
        return self._limit(seq, max_model_len)

    def _limit(self, seq: Sequence, max_model_len: int) -> int:
        """_room, the last token in flight or not."""
        p = seq.params
        if (not p.speculative or seq.pending_forks or seq.kv_pull is not None
                or seq.num_computed_tokens != seq.num_tokens - 1 or seq.num_output_tokens < 1):
            return 0
        if not self.backoff.allows(seq.seq_id):
            return 0
        return min(self.config.num_tokens, p.max_tokens - seq.num_output_tokens - 1,
                   max_model_len - seq.num_tokens - 1)

    def _vet(self, seq: Sequence, draft: list[int]) -> list[int]:
        """A structured output's drafts, cut before the first one its grammar refuses (it
        could never be accepted: the row's mask excludes it) or that ends it (no row may come
        after the end); the matcher states of rows 1..len(draft) kept for its rows."""
        states = []
        state = seq.grammar
        for j, tok in enumerate(draft):
            state = state.fork()
            if state.broken or not state.accept(tok) or state.terminated:
                draft = draft[:j]
                break
            states.append(state)
        self._grammars[seq.seq_id] = states
        return draft

    # -- the step ------------------------------------------------------------------------
    def rows(self, seq: Sequence, penalties: bool) -> list[SampleRow]:
        """The 1 + k rows a verify sequence samples, row j at output position
        num_output_tokens + j as if drafts 0..j-1 were its outputs already."""
        draft = seq.spec_token_ids
        prompt = seq.token_ids[:seq.num_prompt_tokens] if penalties else None
        outputs = seq.output_token_ids if penalties else None
        grammars = [seq.grammar, *self._grammars.pop(seq.seq_id, ())] \
            if seq.grammar is not None else [None] * (1 + len(draft))
        pos = seq.num_output_tokens
        return [SampleRow(seq.params, seq.sample_index, pos + j, prompt,
                          outputs + draft[:j] if outputs is not None else None, grammars[j])
                for j in range(1 + len(draft))]

    # -- after it ------------------------------------------------------------------------
    def accept(self, seq: Sequence, sampled: Seq[int]) -> int:
        """How many of the 1 + k sampled tokens seq keeps: the drafts the model sampled too,
        then its own next token. Clears the draft and counts."""
        draft, seq.spec_token_ids = seq.spec_token_ids, []
        a = 0
        while a < len(draft) and sampled[a] == draft[a]:
            a += 1
        self.counters.record(len(draft), a)
        self.backoff.record(seq.seq_id, len(draft), a)
        seq.spec_proposed += len(draft)
        seq.spec_accepted += a
        return a + 1

    def release(self, seq: Sequence) -> None:
        self._grammars.pop(seq.seq_id, None)
        self.backoff.release(seq.seq_id)
        self.proposer.release(seq)

    @property
    def draft_pool(self) -> BlockPool | None:
        """A draft model's own KV pool (engine/spec_decode/draft.py), None for other methods."""
        return getattr(self.proposer, "pool", None)

    def is_idle(self) -> bool:
        """Whether the proposer holds nothing (a draft model's KV pool back to idle)."""
        idle = getattr(self.proposer, "is_idle", None)
        return idle() if idle is not None else True
