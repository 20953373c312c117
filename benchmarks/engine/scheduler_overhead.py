"""CPU cost of one scheduler + block pool step with many running sequences: schedule() (token
budget, slot allocation, copy-on-write checks) plus the block pool's share of the step's
postprocessing (advancing computed tokens, publishing newly full blocks to the prefix cache).
The model and the sampled-token append are not included.

    python benchmarks/engine/scheduler_overhead.py --seqs 256 --steps 2000
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tandem.engine.block_pool import BlockPool
from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence


def measure(num_seqs: int, steps: int, prompt_len: int, block_size: int,
            prefix_caching: bool) -> list[float]:
    blocks_per_seq = (prompt_len + steps + 1) // block_size + 2
    pool = BlockPool(num_seqs * blocks_per_seq, block_size, prefix_caching)
    kv = KVCacheManager(pool)
    sched = Scheduler(SchedulerConfig(8192, num_seqs, prompt_len + steps + 16), kv)
    for i in range(num_seqs):
        prompt = [(i * 7919 + j) % 32000 for j in range(prompt_len)]
        sched.add(Sequence(str(i), prompt, SamplingParams(max_tokens=steps + 8)))
    # Prefill all (not timed), then time pure decode steps.
    while sched.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
        _advance(sched, kv, sched.schedule())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_new_tokens):  # as LLMEngine._run does
            s.num_computed_tokens += n
            if s.num_computed_tokens // block_size > s.num_cached_blocks:
                kv.cache_full_blocks(s)
        times.append(time.perf_counter() - t0)
        assert len(batch.seqs) == num_seqs
        for s in batch.seqs:  # the sampled token (engine work, not timed)
            s.token_ids.append(11)
    return times


def _advance(sched: Scheduler, kv: KVCacheManager, batch) -> None:
    """What LLMEngine does with a step's results, minus the model."""
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n
        kv.cache_full_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(11)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    rows = []
    for caching in (True, False):
        t = measure(a.seqs, a.steps, a.prompt_len, a.block_size, caching)
        t.sort()
        rows.append({"prefix_caching": caching, "median_us": statistics.median(t) * 1e6,
                     "p99_us": t[int(len(t) * 0.99)] * 1e6, "mean_us": statistics.fmean(t) * 1e6})
    print(f"{a.seqs} running sequences, {a.steps} decode steps, prompt {a.prompt_len}, "
          f"block size {a.block_size}; {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}")
    print(f"{'prefix cache':>14}{'median µs':>12}{'p99 µs':>10}{'mean µs':>10}")
    for r in rows:
        print(f"{'on' if r['prefix_caching'] else 'off':>14}{r['median_us']:>12.1f}"
              f"{r['p99_us']:>10.1f}{r['mean_us']:>10.1f}")
    if a.out:
        a.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
