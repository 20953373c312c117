"""Start-up compilation: every Triton kernel variant a step can launch is compiled (or loaded
from Triton's on-disk cache) before the worker takes requests, so no request's step pays for a
compile. On a fresh machine an unwarmed engine compiled ~30 variants during its first minute of
traffic, each stalling a step for a second or more (BENCHMARKS.md, "the first run").

The variants: the kernels take every step-varying size and address without specialising on it
(`do_not_specialize` in kernels/), so what is left is one variant per kernel and constexpr set:
  - the model's kernels (norms, rotary + store, activation, FP8 quantization) and both attention
    kernels (the decode kernel by a plan, as engine steps of two or more decodes run it),
    compiled by eager steps: a mixed step (decodes and a prefill chunk) and a pure prefill step of several
    chunks;
  - with FP8 weights, the weight-only matmul of steps of at most GEMV_MAX_M tokens (a batch-1
    decode, kernels/fp8_gemv.py), and the activation quantization and the scales applied after
    torch._scaled_mm (kernels/fp8_scale_product.py) of small decode batches, by eager decode
    steps of 1 and 3 sequences;
  - the decode kernel without a plan (one decode row, and an FP8 cache's launches), split
    once per power of two of splits (its merge is sized by it) and unsplit, launched on the
    pool's first block;
  - the block copy of KV pulls, copying the pool's first block onto its second.
The pool's contents are garbage at start-up and every block written here is overwritten before
it is read: nothing is allocated or cached by this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from tandem.engine.attention.base import AttentionBackend

log = logging.getLogger(__name__)


def has_fp8_linear(model: torch.nn.Module) -> bool:
    from tandem.engine.quantization.fp8 import Fp8Linear  # noqa: PLC0415 - FP8 models only

    return any(isinstance(m, Fp8Linear) for m in model.modules())


def warm_up(step: Callable[[list[int], list[int]], None], backend: AttentionBackend,
            pool: torch.Tensor, block_size: int, dtype: torch.dtype, fp8_weights: bool) -> None:
    """`step(lens, last)`: the model runner's eager step of sequences of `lens` new tokens on
    `backend`'s pool (its first blocks), the flattened tokens `last` computing logits."""
    from tandem.kernels.copy_blocks import copy_blocks  # noqa: PLC0415 - Triton, CUDA only
    from tandem.kernels.paged_decode_launch import MAX_SPLITS  # noqa: PLC0415 - Triton, CUDA only

    t = time.perf_counter()
    block, num_blocks = block_size, pool.shape[0]
    if num_blocks >= 6:  # below that (tests' tiny pools) requests compile on first use
        # Decodes (one token) and a chunk that is not a whole number of blocks, then prefill
        # chunks of several lengths; each fits in the pool's first blocks.
        step([1, 1, block + 1], [0, 1, block + 2])
        step([block, 3], [block - 1, block + 2])
        if fp8_weights:
            for n in (1, 3):
                step([1] * n, list(range(n)))
    if hasattr(backend, "warm_up_decode"):
        backend.warm_up_decode(dtype, splits_upto=MAX_SPLITS)
    if num_blocks >= 2:
        ids = torch.tensor([[0], [1]], dtype=torch.int64, device=pool.device)
        copy_blocks(pool, pool, ids[0], ids[1])
    torch.cuda.synchronize(pool.device)
    log.info("kernels compiled or loaded in %.1f s", time.perf_counter() - t)
