"""Request state, plain Python. One Sequence per sample: a request with n > 1 is prefilled as
one sequence and forked into n after its first token (they share the prompt's blocks).

Token ranges of a sequence (block_size 4 here):

    token_ids:  p p p p | p p o o | o
                └ prompt (num_prompt_tokens = 6) ┘└ outputs ┘
    computed:   ←──── num_computed_tokens = 8 ────→   the last token's KV is written next step
    block_ids:  [ 12    |  3      | 40 ]
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from tandem.engine.block_pool import hash_block, salt_root
from tandem.engine.sampling_params import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from tandem.engine.grammar import GrammarState

_seq_counter = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's max length
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed (e.g. its KV could not be pulled)
    HANDOFF = "handoff"  # prefill role: prompt done, blocks handed to a decode worker


@dataclass(frozen=True)
class RemoteKV:
    """Where a request's prompt KV (or a prefix of it: `prefix`) lives before it is pulled, as the prefill
    worker answered the lease's claim (never as the request's caller said). The one shape of a
    KV location inside a process; `KVLocation` is its wire form."""

    address: str  # the prefill worker (its pool mapped first: MapPool)
    lease_id: str  # the lease's token: a capability, never logged
    deadline: float  # time.monotonic() (one clock host-wide) after which blocks may be reused
    block_ids: tuple[int, ...]  # from the claim
    first_token_ids: tuple[int, ...]  # one per sample
    first_logprobs: tuple[TokenLogprobs | None, ...]
    # A request moved here mid-stream: per sample, its outputs after the first token (empty:
    # none). Their KV is recomputed after the pull, as a preempted sequence's is.
    resume_token_ids: tuple[tuple[int, ...], ...] = ()
    # The prefill worker process that granted the lease: its pool is the one MapPool mapped
    # for that instance; a lease of an earlier instance (restarted since) cannot be pulled.
    instance_id: str = ""
    # Live migration: the lease is a decode worker's on a running sequence, holding the KV of
    # its first num_tokens tokens (prompt and outputs; 0: a prefill lease, the prompt's). The
    # request waits, pulled, for its HandOver (the tokens made on the source since) before it
    # decodes (`handover`).
    num_tokens: int = 0
    handover: bool = False
    # A prompt's prefix (its first num_tokens tokens, whole blocks) lent from another worker's
    # prefix cache or host tier: pulled in place of computing it, the rest of the prompt is
    # computed here and the first tokens sampled here (none come with it). A pull that fails
    # costs only time: those blocks are computed instead.
    prefix: bool = False

    @property
    def mid_stream(self) -> bool:
        """A request that was already decoding elsewhere (live migration, or moved with its
        outputs): its client waits on its next token, so its admission is never paced."""
        return self.handover or bool(self.resume_token_ids)


class PendingPull(Protocol):
    """Decode role: a pull of a prompt's KV that completes outside the engine's stream (NIXL),
    as a KVPuller returns it (engine/kv_connector.py)."""

    def done(self) -> bool:
        """Whether the blocks are in place, without waiting; raises if the pull failed (and
        then nothing writes into them any more)."""

    def cancel(self) -> None:
        """The request ended first: stop the pull; returns once nothing writes the blocks."""


@dataclass(frozen=True)
class Lent:
    """Live migration, source side: a lease on a running request's KV, for another decode
    worker to claim and pull while this one decodes on. It holds the blocks of the first
    `num_tokens` tokens: its prompt and the outputs whose KV is written (n > 1: the prompt's
    only)."""

    lease_id: str  # the capability: never logged
    block_ids: tuple[int, ...]
    num_tokens: int
    digest: bytes  # kvtransfer.lease.prompt_digest of those tokens
    deadline: float  # time.monotonic()


@dataclass(frozen=True)
class Replay:
    """A request moved here mid-stream whose prompt is prefilled here (no prefill worker was
    up to hand its KV over): once the prompt is computed, each sample's tokens the client has
    are recorded, not sampled again, and their KV computed as a preempted sequence's is. The
    same fields as RemoteKV's, which engine/llm_engine.py's `_start_decoding` reads."""

    first_token_ids: tuple[int, ...]  # one per sample
    first_logprobs: tuple[TokenLogprobs | None, ...]
    resume_token_ids: tuple[tuple[int, ...], ...] = ()  # per sample, outputs after the first


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 sample_index: int = 0, arrival_time: float | None = None) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.sample_index = sample_index
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full blocks
        self.num_cached_blocks = 0  # leading blocks already published to the prefix cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.status = Status.WAITING
        self.finish_reason: FinishReason | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None  # first token sampled on this worker
        self.finish_time: float | None = None
        self.num_prefill_chunks = 0  # forward passes that computed prompt tokens
        # Each of those passes: (start, end) time.monotonic() and the prompt tokens it computed.
        self.prefill_chunks: list[tuple[float, float, int]] = []
        self.logprobs: list[TokenLogprobs | None] = []
        # params.prompt_logprobs: per prompt token after the first (engine/prompt_logprobs.py)
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs_sent = False
        self.remote: RemoteKV | None = None
        # Its outputs so far, recorded once its prompt is computed here (Replay).
        self.replay: Replay | None = None
        # Decode role: a pull of this sequence's prompt KV still in flight outside the engine's
        # stream (PendingPull, engine/kv_connector.py); not scheduled until it is done.
        self.kv_pull: PendingPull | None = None
        # Its prefix being copied back from the host KV tier beside the steps (RestoreTicket,
        # engine/host_kv_tier.py); not scheduled until the copies are done.
        self.restoring = None
        self.num_preemptions = 0
        # Samples still to fork off this sequence when its first token is sampled (n > 1).
        self.pending_forks = params.n - 1
        # Structured output: the grammar's matcher, advanced with every output token appended.
        self.grammar: GrammarState | None = None
        # Speculative decoding (engine/spec_decode/): draft tokens after token_ids that the
        # next step scores (never in token_ids: only accepted tokens join them), and this
        # sample's drafts proposed and accepted so far.
        self.spec_token_ids: list[int] = []
        self.spec_proposed = 0
        self.spec_accepted = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_samples(self) -> int:
        """Rows this sequence samples at its next token: all n when it forks."""
        return 1 + self.pending_forks

    def full_block_hashes(self, block_size: int, num_tokens: int) -> list[int]:
        """Hashes of the full blocks among the first num_tokens tokens, extending the cache."""
        full = num_tokens // block_size
        hashes = self.block_hashes
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if hashes else salt_root(self.params.cache_salt)
            hashes.append(hash_block(parent, self.token_ids[i * block_size:(i + 1) * block_size]))
        return hashes[:full]

    def fork(self, sample_index: int) -> Sequence:
        """A sibling sample sharing everything so far. The caller takes block references."""
        child = Sequence(self.request_id, self.token_ids[:self.num_prompt_tokens], self.params,
                         sample_index, self.arrival_time)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_ids = list(self.block_ids)
        child.block_hashes = list(self.block_hashes)
        child.num_cached_blocks = self.num_cached_blocks
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.first_scheduled_time = self.first_scheduled_time
        child.first_token_time = self.first_token_time
        child.num_prefill_chunks = self.num_prefill_chunks
        child.prefill_chunks = list(self.prefill_chunks)
        child.pending_forks = 0
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        return child

    def timing(self) -> RequestTiming:
        assert self.finish_time is not None, "timing() is for finished sequences"
        return RequestTiming(self.arrival_time, self.first_scheduled_time,
                             self.first_token_time, self.finish_time, self.num_prefill_chunks,
                             self.num_preemptions, tuple(self.prefill_chunks),
                             self.spec_proposed, self.spec_accepted)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}#{self.sample_index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids}, {self.status.value})")


@dataclass
class SeqOutput:
    """What one engine step (or, when a stream lags, several merged) produced for one sample of
    one request."""

    request_id: str
    sample_index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    handoff: Handoff | None = None
    error: str | None = None
    timing: RequestTiming | None = None  # on a sample's last output only
    # params.prompt_logprobs: the prompt's (tokens 1..), on the request's first output only
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass
class StopCheck:
    """Whether a sample stops at the token it just took: an end-of-sequence token (unless the
    request ignores them) or one of its stop tokens, else its length (max_tokens, or the
    longest sequence the engine serves). Stop strings are the detokenizer's. One object, the
    engine's, which its pipelined steps share."""

    eos_token_ids: frozenset[int]
    max_model_len: int

    def __call__(self, params: SamplingParams, token: int, num_output_tokens: int,
                 num_tokens: int) -> FinishReason | None:
        """`num_output_tokens`, `num_tokens`: the sample's counts with `token` taken."""
        if token in params.stop_token_ids or (token in self.eos_token_ids
                                              and not params.ignore_eos):
            return FinishReason.STOP
        if num_output_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


class StepResult(NamedTuple):
    """What running (or resolving) one batch produced, for LLMEngine.step to merge."""

    outputs: list[SeqOutput]
    num_sampled: int = 0  # tokens sampled (discarded rows not counted)
    num_prompt_tokens: int = 0  # prompt tokens of the sequences that sampled their first
    execute_s: float = 0.0  # of it, in the model runner (or waiting for its tokens)


@dataclass(frozen=True)
class RequestTiming:
    """Where one sample's time went on this worker (time.monotonic() seconds), for metrics and
    traces. Decode role: `scheduled` is the admission (blocks allocated, KV pull starts) and
    `first_token` the first token generated here, not the one handed over.

        arrival ── queue ──▶ scheduled ── prefill / pull ──▶ first_token ── decode ──▶ finished
    """

    arrival: float
    scheduled: float | None  # None: finished (aborted) before it was ever scheduled
    first_token: float | None
    finished: float
    num_prefill_chunks: int
    num_preemptions: int
    # Each forward pass that computed prompt tokens: (start, end, prompt tokens computed).
    prefill_chunks: tuple[tuple[float, float, int], ...] = ()
    # Speculative decoding: draft tokens proposed for this sample, and of them accepted.
    spec_proposed: int = 0
    spec_accepted: int = 0

    @property
    def queue_s(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def first_token_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e_s(self) -> float:
        return self.finished - self.arrival


@dataclass(frozen=True)
class Handoff:
    """Prefill role: a finished prompt whose blocks are pinned for a decode worker to pull."""

    block_ids: tuple[int, ...]
    num_tokens: int
    first_token_ids: tuple[int, ...]
    first_logprobs: tuple[TokenLogprobs | None, ...]
    lease_id: str  # the lease's secret token (kvtransfer/lease.py): never logged
    lease_ttl_s: float
    finish_reasons: tuple[FinishReason | None, ...]  # per sample: done at its first token?
    num_cached_tokens: int = 0
    lease_deadline: float = 0.0  # time.monotonic() at which the core reclaims the blocks


@dataclass
class StepStats:
    """What one engine step did (LLMEngine.last_step)."""

    num_seqs: int
    num_tokens: int
    num_decodes: int
    num_preempted: int
    seconds: float
    num_sampled: int = 0  # tokens sampled this step (first tokens included)
    num_prompt_tokens: int = 0  # prompts whose first token this step sampled
