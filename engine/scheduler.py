"""The scheduler: one token budget per step, shared by decodes and prefill chunks.

Each step, oldest first:
  1. running sequences take what they need (a decode 1 token, a prefilling sequence the next
     chunk); when blocks run out, the newest running sequence is preempted (its blocks freed,
     recomputed later with the same output) until the older one fits;
  2. if nothing was preempted, waiting sequences are admitted in the wait queue's order
     (engine/wait_queue.py: priority, then FCFS or the critical-path order) while budget,
     sequence slots and blocks last, keeping a watermark of free blocks (1% of the pool) for
     the running sequences to grow into; a prompt may start with a partial chunk.

Policy `critical-path` also paces the work off the critical path. The run of the requests known
now cannot take fewer steps than the longest remaining output (the horizon); a step of fewer
tokens than the model's weights are worth in compute (min_step_tokens, ~256 on an H100 for bf16)
costs about what reading the weights costs. So prompts off that path get at most the work left
divided by the horizon per step (never under min_step_tokens): their prefill is spread over
steps that would otherwise run nearly empty at the end, instead of crowding the first steps
while the longest requests wait. Prompts on the path (their chunks plus their outputs reach the
horizon: a request alone, a long generation) get the whole budget. Running decodes are never
paced. In role decode, a request whose prompt KV is pulled from a prefill worker only decodes
here: it is admitted while the step's decodes are under the paced budget (or it is on the path,
or has waited the queue's max_wait_s; a request moved here mid-stream is never held), so that a
run's decodes spread over the horizon's steps in batches whose matmuls cost about the weights'
read, instead of crowding the first steps into large compute-bound batches that the longest
request decodes in. In role prefill nothing is paced, only ordered: the prompts of the longest
generations first, so that the decode worker starts the run's critical path at once.

    steps:   0 ─────────────────────────────── horizon
    longest  ██████████████████████████████████           (its outputs: the critical path)
    others   ▓▓▓ ▓▓▓▓ ▓▓ ▓▓▓▓▓ ▓▓▓ ▓▓▓▓ ▓▓▓ ▓▓▓▓ ▓▓       (paced, spread along it)

Host KV tier (engine/host_kv_tier.py) on CUDA: a waiting sequence whose prefix is copied back
from the tier is admitted with its blocks but not scheduled until the copies, issued beside the
steps, are done (`restoring`, never preempted meanwhile): the other requests' steps never wait
for them.

Decode role: a waiting sequence whose KV lives on a prefill worker is admitted with the full
prompt blocks this worker's prefix cache holds and fresh blocks for the rest, and listed in
`pulls`; the engine copies the rest in before the step runs, or, over NIXL, starts a pull the
sequence waits for (not scheduled, never preempted) while the others go on; while MAX_PULLING
wait so, no more such requests are admitted. A prompt whose leading blocks another worker lent
(RemoteKV.prefix, any role) is admitted the same way with blocks for those alone, and computes
the rest once they are in; when its own caches hold as much as the lent prefix, it is admitted
as any prompt and the lease let go (`unpulled`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.sequence import Sequence, Status
from tandem.engine.wait_queue import WaitQueue, remaining_outputs

# Decode role: requests whose KV is still arriving (over NIXL, engine/kv_connector.py) hold their
# blocks and cannot be preempted; with this many at the start of a step, no request whose KV
# is remote is admitted in it (a slow link fails fewer leases, and running requests keep blocks).
MAX_PULLING = 32


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)  # one-token sequences first
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    pulls: list[Sequence] = field(default_factory=list)
    # Admitted with a lent prefix their own caches hold as much of: its lease is let go unpulled
    unpulled: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_decodes(self) -> int:
        return sum(1 for n in self.num_new_tokens if n == 1)

    def drop_finished(self) -> None:
        """Sequences that finished after this batch was scheduled (a pipelined step in flight
        resolved since) leave it."""
        if any(s.is_finished for s in self.seqs):
            keep = [i for i, s in enumerate(self.seqs) if not s.is_finished]
            self.seqs = [self.seqs[i] for i in keep]
            self.num_new_tokens = [self.num_new_tokens[i] for i in keep]

    @property
    def num_verifies(self) -> int:
        """Sequences whose draft tokens this step scores (engine/spec_decode/)."""
        return sum(1 for s in self.seqs if s.spec_token_ids)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = WaitQueue(config.policy, config.max_model_len)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model, all told
        # Blocks that admissions leave free so running sequences rarely need preempting.
        self.watermark = kv.pool.num_blocks // 100
        self._step_paced = config.max_num_batched_tokens

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def reconfigure(self, config: SchedulerConfig) -> None:
        """Schedule by `config` from now on (an engine changing role: its policy and pacing);
        only while nothing waits, since a queue's order is built as requests join it."""
        assert not self.waiting, "the waiting queue is not empty"
        self.config = config
        self.waiting = WaitQueue(config.policy, config.max_model_len)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.kv.held)

    def num_running_seqs(self) -> int:
        return len(self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        horizon, paced = self._pace()
        self._step_paced = paced  # _on_path measures prompts in this step's chunks
        # One-token sequences first: the attention backend runs them as one decode batch.
        decodes: list[Sequence] = []
        chunks: list[tuple[Sequence, int]] = []

        bs = self.kv.block_size
        ref_counts = self.kv.pool.ref_counts
        running = self.running
        i = 0
        pulling = 0  # sequences whose KV is still arriving
        self.kv.settle()
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            n = len(seq.token_ids) - computed
            if (n == 1 and computed % bs and ref_counts[seq.block_ids[-1]] == 1
                    and not seq.spec_token_ids):
                # A decode with room in its own last block: nothing to allocate (hot path).
                decodes.append(seq)
                budget -= 1
                paced -= 1
                i += 1
                continue
            if seq.restoring is not None and not self.kv.restored(seq):
                i += 1  # its prefix still being copied back from the host tier
                continue
            if n <= 0 or seq.kv_pull is not None:  # KV pulled this step, or still arriving
                pulling += seq.kv_pull is not None
                i += 1
                continue
            if seq.spec_token_ids:  # a decode with drafts to verify: 1 + k positions
                n = self._fit_draft(seq, budget, batch.copies)
            elif n > 1 and not self._on_path(seq, horizon, paced):
                n = min(n, paced)
                if n <= 0:  # this step's paced share is spent: the next step goes on
                    i += 1
                    continue
            n = min(n, budget)
            while not self.kv.allocate_slots(seq, n, copies=batch.copies):
                victim = self._pop_victim()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                if n == 1:
                    decodes.append(seq)
                else:
                    chunks.append((seq, n))
                budget -= n
                paced -= n
                i += 1
                continue
            break

        num_seqs = sum(s.num_samples for s in running) if self.waiting else 0
        while self.waiting and budget > 0 and not batch.preempted:
            seq = self.waiting.head(horizon, self._step_paced)
            # The watermark protects running sequences; alone, a request may use every block.
            reserve = self.watermark if running else 0
            if num_seqs + seq.num_samples > self.config.max_num_seqs:
                break
            remote = seq.remote
            if remote is not None and pulling >= MAX_PULLING:  # each holds its blocks until
                break                                            # its KV is in
            # A prefill worker's handoff: it only decodes here, paced with the other decodes.
            handoff = remote is not None and not remote.prefix and not remote.mid_stream
            if (handoff and paced <= 0 and not self._on_path(seq, horizon, paced)
                    and not self.waiting.overdue(seq)):
                break  # this step's paced share of decodes is taken
            hits = None
            if remote is not None and remote.prefix:  # a prefix lent by another worker
                hits = self.kv.prefix_hits(seq)
                if len(hits) >= len(remote.block_ids):  # its own caches hold as much
                    batch.unpulled.append(seq)
                    remote = None
            if remote is not None:
                if hits is None:
                    hits = self.kv.pulled_prefix_hits(seq)
                if not self.kv.allocate_for_pull(seq, hits, reserve):
                    break
                batch.pulls.append(seq)
                if handoff:
                    paced -= seq.num_samples
            else:
                if hits is None:
                    hits = self.kv.prefix_hits(seq)
                limit = budget if self._on_path(seq, horizon, paced) else min(budget, paced)
                n = min(seq.num_tokens - len(hits) * bs, limit)
                if n <= 0 or not self.kv.allocate_slots(seq, n, hits, batch.copies, reserve):
                    break
                if seq.restoring is None:  # else: its blocks held, it runs once they are in
                    if n == 1:
                        decodes.append(seq)
                    else:
                        chunks.append((seq, n))
                    budget -= n
                    paced -= n
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            running.append(seq)
            num_seqs += seq.num_samples

        batch.seqs = decodes + [s for s, _ in chunks]
        batch.num_new_tokens = [1] * len(decodes) + [n for _, n in chunks]
        return batch

    def _fit_draft(self, seq: Sequence, budget: int, copies: list[tuple[int, int]]) -> int:
        """A speculating decode's tokens this step: its last token and as many of its drafts
        as the budget and the free blocks allow (the drafts cut to fit; speculation never
        preempts anyone, nor takes the watermark's blocks)."""
        draft = seq.spec_token_ids
        del draft[max(budget - 1, 0):]
        reserve = self.watermark if self.waiting else 0
        while draft and not self.kv.allocate_slots(seq, 1 + len(draft), (), copies, reserve):
            draft.pop()
        return 1 + len(draft)

    def _pace(self) -> tuple[int, int]:
        """(horizon, paced budget) for this step; policy fcfs, or nothing to pace: (0, the
        whole budget), which puts every sequence on the path. The horizon is the longest
        remaining output of any request; the paced budget spreads the work left (tokens to
        compute here: prompts, and outputs to generate) over that many steps. Without pacing
        (role prefill): (the horizon, the whole budget), which orders prompts only."""
        cfg = self.config
        full = cfg.max_num_batched_tokens
        if not self.waiting.critical_path:
            return 0, full
        max_len = cfg.max_model_len
        work = self.waiting.tokens
        horizon = self.waiting.longest_outputs()
        prefilling = False
        for seq in self.running:
            out = remaining_outputs(seq, max_len)
            # A prompt whose KV is still being pulled is not computed here: it only decodes.
            todo = len(seq.token_ids) - seq.num_computed_tokens if seq.kv_pull is None else 1
            prefilling |= todo > 1
            work += todo + out - 1
            if out > horizon:
                horizon = out
        if not cfg.pace:
            return horizon, full
        if not self.waiting and not prefilling:
            return 0, full
        floor = min(cfg.min_step_tokens, full)
        return horizon, max(floor, min(full, -(-work // max(horizon, 1))))

    def _on_path(self, seq: Sequence, horizon: int, paced: int) -> bool:
        """Whether seq's own remaining steps (its prompt in paced chunks, then its outputs)
        reach the horizon: it then gets the whole budget."""
        if horizon == 0 or seq.num_preemptions:  # nothing paced; recomputed at full speed
            return True
        return self.waiting.is_critical(seq, horizon, self._step_paced)

    def _pop_victim(self) -> Sequence:
        """The newest running sequence whose KV is not still arriving (a pull in flight writes
        its blocks: they cannot be freed under it)."""
        running = self.running
        j = len(running) - 1
        while running[j].kv_pull is not None or running[j].restoring is not None:
            j -= 1
        return running.pop(j)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the blocks (full ones stay in the prefix cache), requeue
        at the front. Prompt and outputs so far are recomputed, so the output continues the
        same."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(seq)

    def advance(self, batch: ScheduledBatch, started: float, now: float,
                fed: set[int] | frozenset[int] = frozenset()) -> None:
        """After a batch ran (or was launched) from `started` to `now`: its prefill chunks
        recorded, its tokens computed, and the prefix cache's blocks just filled hashed, except
        those of sequences in `fed` (fed a placeholder: hashed once its token is known,
        engine/async_step.py)."""
        bs = self.kv.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.spec_token_ids:  # a verify row: what it keeps is known once its drafts
                continue  # are checked (LLMEngine._verified), its length set then
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                seq.num_prefill_chunks += 1
                k = min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
                seq.prefill_chunks.append((started, now, k))
                self.num_prompt_tokens_computed += k
            seq.num_computed_tokens += n
            if seq.seq_id not in fed and seq.num_computed_tokens // bs > seq.num_cached_blocks:
                self.kv.cache_full_blocks(seq)

    def retire(self, seq_ids: set[int]) -> None:
        """These sequences will finish with the token in flight: no step is scheduled for them
        before it is known (engine/async_step.py)."""
        self.running = [s for s in self.running if s.seq_id not in seq_ids]

    def insert_after(self, parent: Sequence, children: list[Sequence]) -> None:
        """Forked samples join the running batch right after their parent."""
        i = self.running.index(parent)
        self.running[i + 1:i + 1] = children

    def remove_finished(self) -> None:
        self.running = [s for s in self.running if not s.is_finished]
        self.waiting.remove_finished()
