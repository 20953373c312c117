"""Sizing the KV pool: profile the largest step the scheduler can issue and the decode CUDA
graphs' largest batch before the pool exists, then give the pool `memory_fraction` of what is
left (as vLLM's profile run does), so any batch cap that starts also runs, and a setting that
cannot fit fails at start naming its flag."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.engine.config import CacheConfig, cdiv
from tandem.errors import InvalidArgument

log = logging.getLogger("tandem.engine.model_runner")


@dataclass(frozen=True)
class ProfileRuns:
    """What the pool leaves device memory for, as runs of the model runner to measure."""

    max_tokens: int  # the largest step the scheduler can issue: this many prompt tokens,
    rows: int  # sampling this many rows
    step: Callable[[], None]  # runs that step
    decode_graphs: Callable[[], None] | None  # runs the decode graphs' largest batch (or None)
    mixed_graphs: bool = False  # mixed-step graphs keep the activations of the largest step


def blocks_for_budget(device: torch.device, cache: CacheConfig, block_bytes: int,
                      block_size: int, max_model_len: int, runs: ProfileRuns) -> int:
    if device.type != "cuda":
        return max(1, cache.cpu_kv_bytes // block_bytes)
    # Profile before the pool takes its share, as everything below must fit beside it:
    # the largest step the scheduler can issue (the token budget as prompt chunks) with as
    # many rows sampled as it can finish (max_num_seqs, on the sampler's heaviest path:
    # top-k/top-p sort, penalties, logprobs over [rows, vocab]), and the decode CUDA
    # graphs, which keep their own memory: the activations of their largest batch.
    try:
        step = peak_bytes(device, runs.step)
        graphs = peak_bytes(device, runs.decode_graphs) if runs.decode_graphs else 0
        # The mixed-step graphs keep the activations of their largest step: at most the
        # profiled step's (engine/cuda_graphs.py).
        graphs += step if runs.mixed_graphs else 0
    except torch.cuda.OutOfMemoryError:
        raise InvalidArgument(
            "max_num_batched_tokens", f"one step of {runs.max_tokens} tokens sampling "
            f"{runs.rows} sequences does not fit in GPU memory beside the weights: lower "
            "--max-num-batched-tokens or --max-num-seqs") from None
    free, _ = torch.cuda.mem_get_info(device)
    num_blocks = kv_pool_blocks(free, step + graphs, cache.memory_fraction, block_bytes)
    needed = cdiv(max_model_len, block_size)
    if num_blocks < needed:
        raise InvalidArgument(
            "memory_fraction", f"a KV pool of {num_blocks} blocks cannot hold one sequence "
            f"of max_model_len {max_model_len} ({needed} blocks): GPU free "
            f"{free >> 20} MiB, step peak {step >> 20} MiB, CUDA graphs "
            f"{graphs >> 20} MiB; raise --memory-fraction or lower --max-num-seqs, "
            "--max-num-batched-tokens or --max-model-len")
    log.info("KV pool: %d blocks of %d tokens (%.2f GiB); reserved for steps %d MiB, "
             "for CUDA graphs %d MiB", num_blocks, block_size,
             num_blocks * block_bytes / 2**30, step >> 20, graphs >> 20)
    return num_blocks

def peak_bytes(device: torch.device, run: Callable[[], None]) -> int:
    """Device memory `run` needs beyond what is allocated before it (its peak)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def kv_pool_blocks(free_bytes: int, reserved_bytes: int, memory_fraction: float,
                   block_bytes: int) -> int:
    """Blocks of the KV pool: `memory_fraction` of the device memory left once the steps'
    and the CUDA graphs' peaks are set aside (the rest is headroom for the allocator)."""
    return max(0, int((free_bytes - reserved_bytes) * memory_fraction) // block_bytes)
