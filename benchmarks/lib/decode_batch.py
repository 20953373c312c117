"""A steady decode batch on an offline engine, for scripts that time decode steps
(benchmarks/engine/decode_step.py, benchmarks/engine/tensor_parallel.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


@contextmanager
def decode_batch(engine, batch: int, context: int, graphs: bool) -> Iterator[None]:
    """`batch` greedy sequences of `context` random prompt tokens (seeded by `batch`),
    prefilled and three steps into decoding, with room to decode to the model's length; CUDA
    graphs off unless `graphs`. After the block: every request aborted, the graphs restored."""
    from tandem.engine.sampling_params import SamplingParams

    runner = engine.runner
    saved = runner.graphs
    if not graphs:
        runner.graphs = None
    try:
        params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - context,
                                ignore_eos=True)
        g = torch.Generator().manual_seed(batch)
        vocab = engine.model_config.vocab_size
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}-{graphs}",
                               torch.randint(1, vocab, (context,), generator=g).tolist(), params)
        while engine.scheduler.waiting or any(
                s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
            engine.step()
        for _ in range(3):
            engine.step()
        yield
    finally:
        for rid in list(engine.requests):
            engine.abort(rid)
        runner.graphs = saved


def step_times(engine, steps: int, check: Callable[[], None] | None = None) -> list[float]:
    """Wall seconds of each of `steps` engine steps (`check` runs after each, untimed)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        if check is not None:
            check()
    return times
