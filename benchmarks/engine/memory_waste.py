"""KV memory waste of paged allocation against per-sequence max-length slabs.

Runs a ShareGPT-like workload through the real scheduler and block pool (the model is replaced
by a token source: memory behaviour depends only on lengths), and reports, averaged over steps:
- paged: KV slots allocated but not (yet) holding a token, as a share of allocated slots;
- slabs: the same share if each running sequence reserved max_model_len slots up front;
and the peak number of sequences a pool of fixed size held, against how many max-length slabs
fit in it.

    python benchmarks/engine/memory_waste.py --requests 1000 --num-blocks 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.workloads import sharegpt_like
from tandem.engine.block_pool import BlockPool
from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence, Status


def simulate(num_requests: int, num_blocks: int, block_size: int, max_model_len: int,
             max_num_seqs: int, budget: int, seed: int) -> dict:
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching=False)
    kv = KVCacheManager(pool)
    sched = Scheduler(SchedulerConfig(budget, max_num_seqs, max_model_len), kv)
    reqs = sharegpt_like(num_requests, 32000, seed=seed, max_len=max_model_len // 2)
    for i, r in enumerate(reqs):
        sched.add(Sequence(str(i), r.prompt, SamplingParams(max_tokens=r.max_tokens)))
    paged_waste, slab_waste, running = [], [], []
    steps = 0
    while sched.has_work():
        batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(7)
                if s.num_output_tokens >= s.params.max_tokens:
                    kv.free(s)
                    s.status = Status.FINISHED
        live = [s for s in sched.running if not s.is_finished]
        if live:
            allocated = pool.num_used * block_size
            filled = sum(s.num_computed_tokens for s in live)
            paged_waste.append(1 - filled / allocated)
            slab_waste.append(1 - filled / (len(live) * max_model_len))
            running.append(len(live))
        sched.remove_finished()
        steps += 1
    assert pool.is_idle()
    return {
        "requests": num_requests, "steps": steps, "num_blocks": num_blocks,
        "block_size": block_size, "max_model_len": max_model_len,
        "paged_waste": statistics.fmean(paged_waste),
        "slab_waste": statistics.fmean(slab_waste),
        "peak_running": max(running), "mean_running": statistics.fmean(running),
        "slab_capacity": num_blocks * block_size // max_model_len,
        "preemptions": sched.num_preemptions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    a = ap.parse_args()
    r = simulate(a.requests, a.num_blocks, a.block_size, a.max_model_len, a.max_num_seqs,
                 a.max_num_batched_tokens, a.seed)
    print(f"{'':28}{'paged':>10}{'max-len slabs':>16}")
    print(f"{'KV slots wasted (mean)':28}{r['paged_waste']:>10.2%}{r['slab_waste']:>16.2%}")
    print(f"{'sequences held (peak)':28}{r['peak_running']:>10}{r['slab_capacity']:>16}")
    print(f"pool {r['num_blocks']} blocks x {r['block_size']} tokens, max_model_len "
          f"{r['max_model_len']}, {r['requests']} ShareGPT-like requests, {r['steps']} steps, "
          f"{r['preemptions']} preemptions")
    if a.out:
        a.out.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
