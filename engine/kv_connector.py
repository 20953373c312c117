"""The scheduler side of a KV handoff: one `KVConnector` per engine, chosen by its role
(`connector_for`), which the engine loop (engine/llm_engine.py) calls the same way whatever
the role:

    prefill       PrefillConnector: hold a finished prompt's blocks under a lease (`hold`) until
                  the decode side releases it (`release`) or it expires (`renew`, `expire`);
                  its blocks go back to the pool then. The lease table lives here
                  (LeaseHolder, which a decode connector is too: it lends running
                  sequences' blocks the same way, for live migration).
    decode, both  DecodeConnector: a request whose prompt KV lives on a prefill worker is
                  checked on arrival (`check`); the scheduler allocates its blocks at admission
                  (KVCacheManager.allocate_for_pull: the prompt's blocks its prefix cache holds,
                  fresh ones for the rest); `start` has the transport side pull the fresh ones;
                  one that completes outside the engine's stream (NIXL) is polled (`poll`); a
                  request that ends first has its lease let go or its pull stopped (`drop`).

The transport side (which pool, which transport, the copies and their leases' LeaseDone) is
the engine core's (engine/serving/kv_pulls.py), plugged in with `connect`; without it no
remote prompt's pull can start (a "both" worker's engine). Each reports what happened; the
engine turns it into outputs (a Handoff at the end of a prefill, the first token(s) recorded
once a pull is done, an error for a pull that failed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

from tandem.engine.block_pool import BlockPool
from tandem.engine.config import cdiv
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import PendingPull, RemoteKV, Replay, Sequence
from tandem.errors import InvalidArgument
from tandem.kvtransfer.lease import LeaseTable

log = logging.getLogger(__name__)

# Copies blocks src[i] of a request's prompt KV at its source into local blocks dst[i] (the
# prompt's blocks this worker does not hold already; possibly none); raises if it cannot.
# Returns None when the blocks are in place or ordered before the engine's next step on the
# device, or a PendingPull to poll.
KVPuller = Callable[[RemoteKV, list[int], list[int]], "PendingPull | None"]
# Told when a request whose KV was never pulled ends (so its source can be released).
KVDropper = Callable[[RemoteKV], None]


class KVConnector:
    """What the engine loop asks of its handoff, whatever the role. The defaults are a role's
    that holds no leases and pulls nothing."""

    # Requests whose pull the engine polls (completes outside the stream): none
    waiting: list[tuple[Sequence, RemoteKV]] | tuple[()] = ()

    def __len__(self) -> int:
        """Leases held (each pins a prompt's blocks)."""
        return 0

    # -- prefill: a finished prompt's blocks ---------------------------------------------------
    def hold(self, block_ids: list[int], now: float) -> tuple[str, float]:
        """Pin these blocks (their references pass to a new lease): its id and time to live."""
        raise RuntimeError(f"{type(self).__name__} holds no prompts for a decode worker")

    def release(self, lease_id: str) -> bool:
        """A decode worker has its copy: the lease's blocks go back. Unknown ids: False."""
        return False

    def renew(self, lease_ids: Iterable[str], now: float | None = None) -> list[float]:
        """Seconds each lease has left after a renewal, 0.0 for one not live."""
        return [0.0 for _ in lease_ids]

    def expire(self, now: float | None = None) -> int:
        """Let go of leases past their deadline: how many."""
        return 0

    # -- decode: a remote prompt's blocks ------------------------------------------------------
    def check(self, prompt: list[int], params: SamplingParams, remote: RemoteKV) -> None:
        raise InvalidArgument("kv", "this engine takes no prompt computed elsewhere")

    def check_outputs(self, prompt: list[int], params: SamplingParams,
                      handed: RemoteKV | Replay) -> None:
        raise InvalidArgument("first_token_ids", "this engine takes no request that has "
                              "outputs already")

    def ordered(self, seqs: list[Sequence]) -> bool:
        """Whether these admitted requests' pulls are all ordered with the steps on the device
        (a step may be in flight while they start)."""
        return not seqs

    def start(self, seqs: list[Sequence]) -> list[PullDone]:
        """Pull admitted requests' KV into the blocks the scheduler allocated them."""
        return []

    def poll(self) -> list[PullDone]:
        """Pulls outside the stream that ended, without waiting."""
        return []

    def drop(self, seq: Sequence) -> None:
        """A request ends: what it still holds at its source is let go."""


def connector_for(role: str, block_pool: BlockPool, block_size: int, vocab_size: int,
                  max_model_len: int) -> KVConnector:
    if role == "prefill":
        return PrefillConnector(block_pool)
    return DecodeConnector(block_pool, block_size, vocab_size, max_model_len)


class PullDone(NamedTuple):
    """A pull that ended: the blocks are in place, or `error` says why they are not."""

    seq: Sequence
    remote: RemoteKV
    error: str | None = None


class LeaseHolder(KVConnector):
    """Leases on blocks of this pool, one reference on each block while its lease lives
    (kvtransfer/lease.py's LeaseTable); granted, released and expired here. A prefill
    worker's are on finished prompts; a decode worker's on running sequences it lends to
    another decode worker (live migration); either's on a cached prefix it lends to a worker
    that computes the rest of a prompt (LLMEngine.lend_prefix).

    And the pulls into this pool from peers' pools (a decode worker's of prompts and moving
    sequences, either role's of a lent prefix): the puller, dropper and `in_stream` come from
    the serving core (`connect`)."""

    def __init__(self, block_pool: BlockPool, ttl_s: float = 30.0,
                 max_life_s: float | None = None) -> None:
        self.block_pool = block_pool
        self.table = LeaseTable()
        self.ttl_s = ttl_s  # how long a lease's blocks stay pinned without a renewal
        self.max_life_s = max_life_s  # renewals never pin them longer (None: no cap)
        self.puller: KVPuller | None = None
        self.dropper: KVDropper | None = None
        # Whether a request's pull is ordered with the steps on the device (pipelined steps go
        # on beside it); None: no pull is (engine/async_step.py).
        self.in_stream: Callable[[RemoteKV], bool] | None = None
        # Sequences (and their KV's source) whose pull completes outside the stream (NIXL)
        self.waiting = []

    def __len__(self) -> int:
        return len(self.table)

    def hold(self, block_ids: list[int], now: float) -> tuple[str, float]:
        return self.table.grant(block_ids, self.ttl_s, now, self.max_life_s), self.ttl_s

    def lease_blocks(self, lease_id: str) -> tuple[int, ...] | None:
        """A live lease's blocks (None if it is not live); a transport's server thread asks."""
        return self.table.blocks(lease_id)

    def release(self, lease_id: str) -> bool:
        blocks = self.table.release(lease_id)
        if blocks is None:
            return False
        self.block_pool.free(blocks)
        return True

    def renew(self, lease_ids: Iterable[str], now: float | None = None) -> list[float]:
        """Each live lease's deadline moved to a full time to live from now; the seconds each
        has left, 0.0 for one that is not live (released, expired, unknown)."""
        now = time.monotonic() if now is None else now
        return [(d - now) if (d := self.table.renew(i, self.ttl_s, now)) is not None
                else 0.0 for i in lease_ids]

    def expire(self, now: float | None = None) -> int:
        expired = self.table.expire(time.monotonic() if now is None else now)
        for blocks in expired:
            self.block_pool.free(blocks)
        if expired:  # nobody took these blocks' KV in time (never the lease ids)
            log.warning("%d KV lease(s) expired unreleased; %d blocks returned", len(expired),
                        sum(len(b) for b in expired))
        return len(expired)

    # -- pulls into this pool ------------------------------------------------------------------
    def connect(self, puller: KVPuller, dropper: KVDropper | None = None,
                in_stream: Callable[[RemoteKV], bool] | None = None) -> None:
        self.puller, self.dropper, self.in_stream = puller, dropper, in_stream

    def check_prefix(self, prompt: list[int], params: SamplingParams, remote: RemoteKV) -> None:
        """A lent prefix (RemoteKV.prefix): whole blocks of the prompt, at least one token
        left to compute here (its logits give the first token), no first tokens with it."""
        bs = self.block_pool.block_size
        n = remote.num_tokens
        if self.puller is None:
            raise InvalidArgument("prefix_kv", "this engine pulls no KV")
        if not 0 < n < len(prompt) or n % bs or len(remote.block_ids) != n // bs:
            raise InvalidArgument("prefix_kv.num_tokens", f"a prefix of {n} tokens in "
                                  f"{len(remote.block_ids)} blocks of {bs} for a prompt of "
                                  f"{len(prompt)}")
        if remote.first_token_ids or remote.handover:
            raise InvalidArgument("prefix_kv", "a lent prefix brings no outputs")
        if params.prompt_logprobs is not None:
            raise InvalidArgument("prefix_kv", "prompt_logprobs are computed at every position")

    # -- in the loop ---------------------------------------------------------------------------
    def ordered(self, seqs: list[Sequence]) -> bool:
        return not seqs or (self.in_stream is not None
                            and all(self.in_stream(s.remote) for s in seqs))

    def start(self, seqs: list[Sequence]) -> list[PullDone]:
        """They decode from the next step; those whose pull completes outside the stream wait
        (`poll`), unscheduled."""
        done = []
        for seq in seqs:
            remote, seq.remote = seq.remote, None
            seq.first_scheduled_time = time.monotonic()  # admitted: queue time ends here
            # The leading blocks came from this worker's prefix cache (allocate_for_pull).
            kept = seq.num_cached_blocks
            try:
                pending = self.puller(remote, list(remote.block_ids[kept:]),
                                      seq.block_ids[kept:])
            except Exception as e:  # noqa: BLE001 - any transport failure fails this pull
                log.warning("KV pull failed for %s: %s", seq.request_id, e)
                done.append(PullDone(seq, remote, f"KV transfer failed: {e}"))
                continue
            if pending is not None:  # not scheduled until it is done (poll)
                seq.kv_pull = pending
                self.waiting.append((seq, remote))
                continue
            done.append(PullDone(seq, remote))
        return done

    def poll(self) -> list[PullDone]:
        done: list[PullDone] = []
        still = []
        for seq, remote in self.waiting:
            pull = seq.kv_pull
            if pull is None:  # ended meanwhile (drop cancelled the pull)
                continue
            try:
                if not pull.done():
                    still.append((seq, remote))
                    continue
            except Exception as e:  # noqa: BLE001 - any transport failure fails this pull
                seq.kv_pull = None
                log.warning("KV pull failed for %s: %s", seq.request_id, e)
                done.append(PullDone(seq, remote, f"KV transfer failed: {e}"))
                continue
            seq.kv_pull = None
            done.append(PullDone(seq, remote))
        self.waiting = still
        return done

    def drop(self, seq: Sequence) -> None:
        """A lease never pulled is let go, a pull in flight stopped (nothing may write its
        blocks once they are freed)."""
        if seq.remote is not None:
            remote, seq.remote = seq.remote, None
            if self.dropper is not None:
                self.dropper(remote)
        if seq.kv_pull is not None:
            pull, seq.kv_pull = seq.kv_pull, None
            pull.cancel()


class PrefillConnector(LeaseHolder):
    """Prefill role: the leases pinning handed-off prompts' blocks (and the pulls of lent
    prefixes)."""


class DecodeConnector(LeaseHolder):
    """Decode role: the pulls of remote prompts' KV (and of running sequences moving here),
    checked on arrival here, and the leases on running sequences this worker lends to another
    decode worker (live migration): LeaseHolder's, as are the pulls themselves."""

    def __init__(self, block_pool: BlockPool, block_size: int, vocab_size: int,
                 max_model_len: int) -> None:
        super().__init__(block_pool)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    # -- arrival -------------------------------------------------------------------------------
    def check(self, prompt: list[int], params: SamplingParams, remote: RemoteKV) -> None:
        """A remote request's first tokens, block count and resumed outputs, named when wrong
        (its prompt and parameters are the engine's to check)."""
        self.check_outputs(prompt, params, remote)
        num_tokens = remote.num_tokens or len(prompt)
        if remote.num_tokens:  # a running sequence's KV (live migration): prompt and outputs
            outputs = 1 + len(remote.resume_token_ids[0]) if remote.resume_token_ids else 1
            if not len(prompt) <= num_tokens < len(prompt) + outputs or (
                    params.n > 1 and num_tokens != len(prompt)):
                raise InvalidArgument("kv.num_tokens", f"a lease on {num_tokens} tokens for "
                                      f"a prompt of {len(prompt)} and {outputs} outputs")
        if len(remote.block_ids) != cdiv(num_tokens, self.block_size):
            raise InvalidArgument("kv.block_ids", f"{len(remote.block_ids)} blocks do not hold "
                                  f"{num_tokens} tokens")

    def check_outputs(self, prompt: list[int], params: SamplingParams,
                      handed: RemoteKV | Replay) -> None:
        """The outputs a request arrives with (first tokens, and each sample's since after a
        move), named when wrong: a pulled request's, and a replayed one's (prefilled here,
        engine/llm_engine.py `add_replayed_request`), by the same rules."""
        if len(handed.first_token_ids) != params.n:
            raise InvalidArgument("first_token_ids", f"expected {params.n}, got "
                                  f"{len(handed.first_token_ids)}")
        vocab = self.vocab_size
        bad = next((t for t in handed.first_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument("first_token_ids", f"token id {bad} is outside [0, {vocab})")
        if handed.resume_token_ids:
            self._check_resume(prompt, params, handed.resume_token_ids)

    def _check_resume(self, prompt: list[int], params: SamplingParams,
                      resume: tuple[tuple[int, ...], ...]) -> None:
        if len(resume) != params.n:
            raise InvalidArgument("resume", f"expected {params.n} samples, got {len(resume)}")
        vocab = self.vocab_size
        for tokens in resume:
            bad = next((t for t in tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidArgument("resume", f"token id {bad} is outside [0, {vocab})")
            # The first token and these: no more than the request may have.
            if 1 + len(tokens) > params.max_tokens or \
                    len(prompt) + 1 + len(tokens) > self.max_model_len:
                raise InvalidArgument("resume", f"{1 + len(tokens)} output tokens exceed "
                                      "max_tokens or the model's length")
