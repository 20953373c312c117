"""The handoff halves of LLMEngine, the engine it mixes into (engine/llm_engine.py):

    prefill  `_handoff`: a request's prompt blocks pinned under a lease when its first token(s)
             are sampled, the request ending here; `release` and `expire_leases` free them.
    decode   `add_remote_request` checks a request whose prompt KV lives on a prefill worker;
             once scheduled, `_pull` has `kv_puller` copy in the blocks this worker's prefix
             cache does not hold, and `_start_decoding` records the first token(s) it came
             with (and, after a move, each sample's tokens since).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from engine.block_pool import BlockPool
from engine.config import ModelConfig, cdiv
from engine.kv_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Handoff, RemoteKV, SeqOutput, Sequence
from kvtransfer.lease import LeaseTable
from tandem.errors import InvalidArgument

log = logging.getLogger(__name__)

# How long an engine with nothing to run but pulls in flight waits before looking again.
PULL_POLL_S = 1e-4

class PendingPull(Protocol):
    """A pull that completes outside the engine's stream (NIXL), as a KVPuller returns it."""

    def done(self) -> bool:
        """Whether the blocks are in place, without waiting; raises if the pull failed (and
        then nothing writes into them any more)."""

    def cancel(self) -> None:
        """The request ended first: stop the pull; returns once nothing writes the blocks."""


# Copies blocks src[i] of a request's prompt KV at its source into local blocks dst[i] (the
# prompt's blocks this worker does not hold already; possibly none); raises if it cannot.
# Returns None when the blocks are in place or ordered before the engine's next step on the
# device, or a PendingPull to poll.
KVPuller = Callable[[RemoteKV, list[int], list[int]], "PendingPull | None"]
# Told when a request whose KV was never pulled ends (so its source can be released).
KVDropper = Callable[[RemoteKV], None]


class KVHandoff:
    """Mixed into LLMEngine, whose state and methods (below) these use."""

    block_pool: BlockPool
    kv: KVCacheManager
    model_config: ModelConfig
    max_model_len: int
    requests: dict[str, list[Sequence]]
    num_requests_added: int
    leases: LeaseTable
    lease_ttl_s: float  # prefill: how long a handed-off prompt's blocks stay pinned
    lease_max_life_s: float | None  # prefill: renewals never pin them longer (None: no cap)
    kv_puller: KVPuller | None
    kv_dropper: KVDropper | None
    pulling: list[tuple[Sequence, RemoteKV]]

    if TYPE_CHECKING:  # LLMEngine's, for the type checker
        def validate(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams) -> None: ...
        def _admit(self, seq: Sequence) -> None: ...
        def fail(self, request_ids: Iterable[str], message: str) -> list[SeqOutput]: ...
        def _fork(self, parent: Sequence, tokens: list[int], lps: list) -> list[Sequence]: ...
        def _append(self, seq: Sequence, token: int, lp: Any,
                    sampled_here: bool = True) -> SeqOutput: ...
        def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None: ...
        def _finish(self, seq: Sequence, reason: FinishReason) -> None: ...
        def _output(self, seq: Sequence, tokens: list[int], lps: list) -> SeqOutput: ...

    # -- requests ----------------------------------------------------------------------------
    def add_remote_request(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams, remote: RemoteKV) -> None:
        """Decode role: the prompt's KV and first token(s) come from a prefill worker."""
        self.validate(request_id, prompt_token_ids, params)
        if len(remote.first_token_ids) != params.n:
            raise InvalidArgument("first_token_ids", f"expected {params.n}, got "
                                  f"{len(remote.first_token_ids)}")
        vocab = self.model_config.vocab_size
        bad = next((t for t in remote.first_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument("first_token_ids", f"token id {bad} is outside [0, {vocab})")
        if len(remote.block_ids) != cdiv(len(prompt_token_ids), self.block_pool.block_size):
            raise InvalidArgument("kv.block_ids", f"{len(remote.block_ids)} blocks do not hold "
                                  f"{len(prompt_token_ids)} tokens")
        if remote.resume_token_ids:
            self._validate_resume(prompt_token_ids, params, remote.resume_token_ids)
        seq = Sequence(request_id, prompt_token_ids, params)
        seq.remote = remote
        self.requests[request_id] = [seq]
        self._admit(seq)
        self.num_requests_added += 1

    def _validate_resume(self, prompt: list[int], params: SamplingParams,
                         resume: tuple[tuple[int, ...], ...]) -> None:
        if len(resume) != params.n:
            raise InvalidArgument("resume", f"expected {params.n} samples, got {len(resume)}")
        vocab = self.model_config.vocab_size
        for tokens in resume:
            bad = next((t for t in tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidArgument("resume", f"token id {bad} is outside [0, {vocab})")
            # The first token and these: no more than the request may have.
            if 1 + len(tokens) > params.max_tokens or \
                    len(prompt) + 1 + len(tokens) > self.max_model_len:
                raise InvalidArgument("resume", f"{1 + len(tokens)} output tokens exceed "
                                      "max_tokens or the model's length")

    # -- leases (prefill role) ---------------------------------------------------------------
    def release(self, lease_id: str) -> bool:
        """Prefill role: the decode side has its copy. Unknown or late releases are ignored."""
        blocks = self.leases.release(lease_id)
        if blocks is None:
            return False
        self.block_pool.free(blocks)
        return True

    def renew(self, lease_ids: Iterable[str], now: float | None = None) -> list[float]:
        """Prefill role: each live lease's deadline moved to a full time to live from now;
        the seconds each has left, 0.0 for one that is not live (released, expired, unknown)."""
        now = time.monotonic() if now is None else now
        return [(d - now) if (d := self.leases.renew(i, self.lease_ttl_s, now)) is not None
                else 0.0 for i in lease_ids]

    def expire_leases(self, now: float | None = None) -> int:
        expired = self.leases.expire(time.monotonic() if now is None else now)
        for blocks in expired:
            self.block_pool.free(blocks)
        if expired:  # no decode worker took these prompts' KV in time (never the lease ids)
            log.warning("%d KV lease(s) expired unreleased; %d blocks returned", len(expired),
                        sum(len(b) for b in expired))
        return len(expired)

    # -- in the loop ---------------------------------------------------------------------------
    def _handoff(self, seq: Sequence, tokens: list[int], lps: list) -> SeqOutput:
        """Prefill role: pin the prompt's blocks under a lease and end the request here."""
        now = time.monotonic()
        lease = self.leases.grant(seq.block_ids, self.lease_ttl_s, now, self.lease_max_life_s)
        reasons = []
        for tok in tokens:
            seq.token_ids.append(tok)  # as the decode side will see it
            reasons.append(self._stop_reason(seq, tok))
            seq.token_ids.pop()
        handoff = Handoff(tuple(seq.block_ids), seq.num_tokens, tuple(tokens), tuple(lps),
                          lease, self.lease_ttl_s, tuple(reasons), seq.num_cached_tokens,
                          now + self.lease_ttl_s)
        seq.block_ids = []  # now owned by the lease
        seq.pending_forks = 0
        self._finish(seq, FinishReason.HANDOFF)
        out = self._output(seq, [], [])
        out.handoff = handoff
        return out

    def _pull(self, seqs: list[Sequence]) -> list[SeqOutput]:
        """Decode role: copy admitted requests' KV in, then they decode from the next step."""
        outputs = []
        for seq in seqs:
            remote, seq.remote = seq.remote, None
            seq.first_scheduled_time = time.monotonic()  # admitted: queue time ends here
            # The leading blocks came from this worker's prefix cache (allocate_for_pull).
            kept = seq.num_cached_blocks
            try:
                pending = self.kv_puller(remote, list(remote.block_ids[kept:]),
                                         seq.block_ids[kept:])
            except Exception as e:  # noqa: BLE001 - any transport failure fails this request
                log.warning("KV pull failed for %s: %s", seq.request_id, e)
                outputs += self.fail([seq.request_id], f"KV transfer failed: {e}")
                continue
            if pending is not None:  # not scheduled until it is done (_poll_pulls)
                seq.kv_pull = pending
                self.pulling.append((seq, remote))
                continue
            outputs += self._decode_pulled(seq, remote)
        return outputs

    def _poll_pulls(self, idle: bool = False) -> list[SeqOutput]:
        """Start decoding the sequences whose pull is done; fail those whose pull failed.
        `idle`: nothing else to run, so wait a little for one instead of spinning."""
        outputs: list[SeqOutput] = []
        still = []
        for seq, remote in self.pulling:
            pull = seq.kv_pull
            if pull is None:  # ended meanwhile (_finish cancelled the pull)
                continue
            try:
                if not pull.done():
                    still.append((seq, remote))
                    continue
            except Exception as e:  # noqa: BLE001 - any transport failure fails this request
                seq.kv_pull = None
                log.warning("KV pull failed for %s: %s", seq.request_id, e)
                outputs += self.fail([seq.request_id], f"KV transfer failed: {e}")
                continue
            seq.kv_pull = None
            outputs += self._decode_pulled(seq, remote)
        self.pulling = still
        if idle and still and not outputs:
            time.sleep(PULL_POLL_S)
        return outputs

    def _drop_kv(self, seq: Sequence) -> None:
        """A request ends: a lease never pulled is let go, a pull in flight stopped (nothing may
        write its blocks once they are freed)."""
        if seq.remote is not None:
            remote, seq.remote = seq.remote, None
            if self.kv_dropper is not None:
                self.kv_dropper(remote)
        if seq.kv_pull is not None:
            pull, seq.kv_pull = seq.kv_pull, None
            pull.cancel()

    def _decode_pulled(self, seq: Sequence, remote: RemoteKV) -> list[SeqOutput]:
        try:
            return self._start_decoding(seq, remote)
        except Exception:  # this request's own state: it fails alone
            log.exception("request %s failed after its KV pull", seq.request_id)
            return self.fail([seq.request_id], "internal error after the KV pull")

    def _start_decoding(self, seq: Sequence, remote: RemoteKV) -> list[SeqOutput]:
        """A pulled request's prompt is computed; its first token(s) came with the handoff, and
        after a move from another decode worker each sample's outputs since."""
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.kv.cache_full_blocks(seq)
        firsts, lps = remote.first_token_ids, remote.first_logprobs
        resume = remote.resume_token_ids or ((),) * len(firsts)
        children = self._fork(seq, list(firsts[1:]), list(lps[1:]))
        outputs = []
        for s, tok, lp, more in zip([seq, *children], firsts, lps, resume):
            # These went to the client already: record (grammar and stop checks included), do
            # not re-emit. The tokens after the prompt have no KV here yet: the next steps
            # compute them as a prompt chunk, then sample the next one.
            self._append(s, tok, lp, sampled_here=False)
            for t in more:
                if s.is_finished:
                    break
                self._append(s, t, None, sampled_here=False)
            if s.is_finished:  # a sample that had finished before the move
                outputs.append(self._output(s, [], []))
        return outputs
