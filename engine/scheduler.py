"""The scheduler: one token budget per step, shared by decodes and prefill chunks.

Each step, oldest first:
  1. running sequences take what they need (a decode 1 token, a prefilling sequence the next
     chunk); when blocks run out, the newest running sequence is preempted (its blocks freed,
     recomputed later with the same output) until the older one fits;
  2. if nothing was preempted, waiting sequences are admitted in arrival order (FCFS) while
     budget, sequence slots and blocks last, keeping a watermark of free blocks (1% of the pool)
     for the running sequences to grow into; a prompt may start with a partial chunk.
Decode role: a waiting sequence whose KV lives on a prefill worker is admitted with the full
prompt blocks this worker's prefix cache holds and fresh blocks for the rest, and listed in
`pulls`; the engine copies the rest in before the step runs, or, over NIXL, starts a pull the
sequence waits for (not scheduled, never preempted) while the others go on; while MAX_PULLING
wait so, no more such requests are admitted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_manager import KVCacheManager
from engine.sequence import Sequence, Status

# Decode role: requests whose KV is still arriving (over NIXL, engine/kv_handoff.py) hold their
# blocks and cannot be preempted; with this many at the start of a step, no request whose KV
# is remote is admitted in it (a slow link fails fewer leases, and running requests keep blocks).
MAX_PULLING = 32


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)  # one-token sequences first
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    pulls: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_decodes(self) -> int:
        return sum(1 for n in self.num_new_tokens if n == 1)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Blocks that admissions leave free so running sequences rarely need preempting.
        self.watermark = kv.pool.num_blocks // 100

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_seqs(self) -> int:
        return len(self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        # One-token sequences first: the attention backend runs them as one decode batch.
        decodes: list[Sequence] = []
        chunks: list[tuple[Sequence, int]] = []

        bs = self.kv.block_size
        ref_counts = self.kv.pool.ref_counts
        running = self.running
        i = 0
        pulling = 0  # sequences whose KV is still arriving
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            n = len(seq.token_ids) - computed
            if n == 1 and computed % bs and ref_counts[seq.block_ids[-1]] == 1:
                # A decode with room in its own last block: nothing to allocate (hot path).
                decodes.append(seq)
                budget -= 1
                i += 1
                continue
            if n <= 0 or seq.kv_pull is not None:  # KV pulled this step, or still arriving
                pulling += seq.kv_pull is not None
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
                i += 1
                continue
            break

        num_seqs = sum(s.num_samples for s in running) if self.waiting else 0
        while self.waiting and budget > 0 and not batch.preempted:
            seq = self.waiting[0]
            # The watermark protects running sequences; alone, a request may use every block.
            reserve = self.watermark if running else 0
            if num_seqs + seq.num_samples > self.config.max_num_seqs:
                break
            if seq.remote is not None:
                if pulling >= MAX_PULLING:  # each holds its blocks until its KV is in
                    break
                hits = self.kv.pulled_prefix_hits(seq)
                if not self.kv.allocate_for_pull(seq, hits, reserve):
                    break
                batch.pulls.append(seq)
            else:
                hits = self.kv.prefix_hits(seq)
                n = min(seq.num_tokens - len(hits) * bs, budget)
                if not self.kv.allocate_slots(seq, n, hits, batch.copies, reserve):
                    break
                if n == 1:
                    decodes.append(seq)
                else:
                    chunks.append((seq, n))
                budget -= n
            self.waiting.popleft()
            seq.status = Status.RUNNING
            running.append(seq)
            num_seqs += seq.num_samples

        batch.seqs = decodes + [s for s, _ in chunks]
        batch.num_new_tokens = [1] * len(decodes) + [n for _, n in chunks]
        return batch

    def _pop_victim(self) -> Sequence:
        """The newest running sequence whose KV is not still arriving (a pull in flight writes
        its blocks: they cannot be freed under it)."""
        running = self.running
        j = len(running) - 1
        while running[j].kv_pull is not None:
            j -= 1
        return running.pop(j)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the blocks (full ones stay in the prefix cache), requeue
        at the front. Prompt and outputs so far are recomputed, so the output continues the
        same."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def insert_after(self, parent: Sequence, children: list[Sequence]) -> None:
        """Forked samples join the running batch right after their parent."""
        i = self.running.index(parent)
        self.running[i + 1:i + 1] = children

    def remove_finished(self) -> None:
        self.running = [s for s in self.running if not s.is_finished]
        if any(s.is_finished for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
