"""Teacher-forced scoring through the engine's own model runner and paged KV cache: how a
variant of a model (an FP8 cache, FP8 weights) changes its next-token log-probabilities over a
fixed text. The FP8 tests bound it; benchmarks/engine/fp8_accuracy.py reports it on real
checkpoints."""

from __future__ import annotations

from typing import NamedTuple

import torch

from tandem.engine.attention.base import forward_context
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence


class Accuracy(NamedTuple):
    mean_abs_dlogprob: float
    max_abs_dlogprob: float
    top1_agreement: float
    positions: int


def build(model: str, device: str, dtype: str, load_format: str, kv_cache_dtype: str = "auto",
          quantization: str | None = None, num_blocks: int = 256,
          max_model_len: int = 2048) -> LLMEngine:
    """An engine to score with: eager steps and no prefix cache, so every position is computed."""
    return LLMEngine(EngineConfig(
        model=model, device=device, dtype=dtype, load_format=load_format, num_blocks=num_blocks,
        max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype, quantization=quantization,
        cuda_graphs=False, enable_prefix_caching=False), progress=False)


@torch.inference_mode()
def score(engine: LLMEngine, token_ids: list[int], chunk: int = 64,
          decode_tail: int = 16) -> torch.Tensor:
    """fp32 [len - 1, vocab] log-probabilities of the token after each position, teacher-forced
    through the engine's runner: prefill chunks, then one token a step. The engine must be idle;
    its first blocks hold the text's KV afterwards."""
    runner = engine.runner
    n = len(token_ids)
    seq = Sequence("scoring", list(token_ids), SamplingParams())
    seq.block_ids = list(range(-(n // -runner.block_size)))
    if len(seq.block_ids) > runner.num_blocks:
        raise ValueError(f"token_ids: {n} tokens need {len(seq.block_ids)} blocks, the pool "
                         f"has {runner.num_blocks}")
    steps = [chunk] * ((n - decode_tail) // chunk)
    steps += [(n - decode_tail) % chunk] if (n - decode_tail) % chunk else []
    steps += [1] * (n - sum(steps))
    out = []
    try:
        for m in steps:
            batch = ScheduledBatch(seqs=[seq], num_new_tokens=[m])
            ids, pos, meta, _ = runner._inputs(batch, list(range(m)))
            with forward_context(runner.backend, meta):
                hidden = runner.model(ids, pos)
            out.append(runner.model.compute_logits(hidden).log_softmax(-1).cpu())
            seq.num_computed_tokens += m
    finally:
        runner.release(seq.seq_id)
    return torch.cat(out)[:-1]


def compare(base: torch.Tensor, test: torch.Tensor, token_ids: list[int]) -> Accuracy:
    """How far `test`'s log-probabilities of the text's next tokens are from `base`'s."""
    nxt = torch.tensor(token_ids[1:])[:, None]
    d = (test.gather(1, nxt) - base.gather(1, nxt)).abs()
    agree = (test.argmax(-1) == base.argmax(-1)).float().mean()
    return Accuracy(d.mean().item(), d.max().item(), agree.item(), len(nxt))
