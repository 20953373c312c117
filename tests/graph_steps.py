"""What the CPU tests of the CUDA graphs' steps share (tests/unit/kernels/test_mixed_steps.py,
test_decode_graph_steps.py, test_verify_steps.py): three prompts of different lengths, and the
Triton attention backend put on an engine built for the CPU, as a CUDA engine has it."""

from __future__ import annotations

from tandem.engine.attention.triton_backend import TritonAttentionBackend

PROMPTS = [[(31 * i + 7 * j) % 250 + 1 for j in range(3 + 29 * i)] for i in range(3)]


def use_triton(runner) -> None:  # type: ignore[no-untyped-def]
    """Give a model runner the Triton attention backend over its own KV pool."""
    runner.backend = TritonAttentionBackend(runner.pool, runner.num_heads,
                                            runner.config.head_dim ** -0.5)
    runner.prefill_block_q = runner.backend.prefill_block_q
