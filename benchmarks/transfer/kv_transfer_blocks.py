"""Pool blocks for benchmarks/transfer/kv_transfer.py and its NIXL part: the byte pattern a producer fills
its pool with and the check that the consumer's blocks hold it, and how a copy is timed and
summarized."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from typing import Any

import torch


def as_bytes(pool: torch.Tensor) -> torch.Tensor:
    """The pool as [num_blocks, block bytes] of uint8 (any KV dtype, FP8 included)."""
    return pool.view(pool.shape[0], -1).view(torch.uint8)


def fill_pattern(pool: torch.Tensor) -> None:
    """Block b holds byte (b * 1009 + i) % 251 at byte i: the same in every KV dtype."""
    flat = as_bytes(pool)
    i = torch.arange(flat.shape[1], device=pool.device, dtype=torch.int32)
    for start in range(0, flat.shape[0], 16):
        b = torch.arange(start, min(start + 16, flat.shape[0]), device=pool.device,
                         dtype=torch.int32)
        flat[start:start + 16] = ((b[:, None] * 1009 + i) % 251).to(torch.uint8)


def blocks_match(pool: torch.Tensor, dst_ids: list[int], src_ids: list[int]) -> bool:
    """Whether pool blocks dst_ids[k] hold the producer's pattern of blocks src_ids[k]."""
    flat = as_bytes(pool)
    i = torch.arange(flat.shape[1], device=pool.device, dtype=torch.int32)
    for start in range(0, len(src_ids), 16):
        s = torch.tensor(src_ids[start:start + 16], device=pool.device, dtype=torch.int32)
        d = torch.tensor(dst_ids[start:start + 16], device=pool.device)
        if not torch.equal(flat[d], ((s[:, None] * 1009 + i) % 251).to(torch.uint8)):
            return False
    return True


def time_op(op: Callable[[], object], device: torch.device, warmup: int,
            repeats: int) -> list[float]:
    """Seconds per call of `op`, by CUDA events on the current stream of `device`."""
    stream = torch.cuda.current_stream(device)
    for _ in range(warmup):
        op()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        op()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def summary(times: list[float], nbytes: int, correct: bool) -> dict[str, Any]:
    median = statistics.median(times)
    return {"median_ms": median * 1e3, "min_ms": min(times) * 1e3, "gbps": nbytes / median / 1e9,
            "correct": correct}


def run_ids(n: int, k: int, num_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    """n block pairs in k runs of n // k blocks, each run ascending on both sides, the runs at
    scattered places of pools of num_blocks blocks."""
    length = n // k
    rng = random.Random(seed + k)
    slots = num_blocks // length
    src = [b for r in rng.sample(range(slots), k) for b in range(r * length, (r + 1) * length)]
    dst = [b for r in rng.sample(range(slots), k) for b in range(r * length, (r + 1) * length)]
    return src, dst
