"""The scheduler: one token budget per step, shared by decodes and prefill chunks.

Each step, oldest first:
  1. running sequences take what they need (a decode 1 token, a prefilling sequence the next
     chunk); when blocks run out, the newest running sequence is preempted (its blocks freed,
     recomputed later with the same output) until the older one fits;
  2. if nothing was preempted, waiting sequences are admitted in arrival order (FCFS) while
     budget, sequence slots and blocks last; a prompt may start with a partial chunk.
Decode role: a waiting sequence whose KV lives on a prefill worker is admitted with fresh blocks
and listed in `pulls`; the engine copies its KV in before the step runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_manager import KVCacheManager
from engine.sequence import Sequence, Status


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

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_seqs(self) -> int:
        return len(self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:  # KV pulled this step; decodes from the next
                i += 1
                continue
            while not self.kv.allocate_slots(seq, n, copies=batch.copies):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                picked.append((seq, n))
                budget -= n
                i += 1
                continue
            break

        num_seqs = sum(s.num_samples for s in self.running)
        while self.waiting and budget > 0 and not batch.preempted:
            seq = self.waiting[0]
            if num_seqs + seq.num_samples > self.config.max_num_seqs:
                break
            if seq.remote is not None:
                if not self.kv.allocate_blocks(seq, seq.num_prompt_tokens):
                    break
                batch.pulls.append(seq)
            else:
                hits = self.kv.prefix_hits(seq)
                computed = len(hits) * self.kv.block_size
                n = min(seq.num_tokens - computed, budget)
                if not self.kv.allocate_slots(seq, n, hits, copies=batch.copies):
                    break
                picked.append((seq, n))
                budget -= n
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            num_seqs += seq.num_samples

        # One-token sequences first: the attention backend runs them as a decode batch.
        picked.sort(key=lambda p: p[1] != 1)
        batch.seqs = [s for s, _ in picked]
        batch.num_new_tokens = [n for _, n in picked]
        return batch

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
