"""The CPU backend's batched decode path equals its one-sequence-at-a-time path, and a lagging
stream's outputs merge per sample without losing or reordering tokens."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.torch_backend import paged_attention_torch, paged_decode_torch
from engine.sequence import FinishReason, SeqOutput
from engine.serving.async_engine import _merge_by_sample


@pytest.mark.parametrize("gqa", [1, 4])
def test_batched_decode_equals_per_sequence(gqa):
    rng = random.Random()
    seed = rng.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    num_blocks, bs, hkv, d = 64, 8, 2, 32
    pool = torch.randn(num_blocks, 3, 2, bs, hkv, d, generator=g)  # layer 1 is a strided view
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    lens = [rng.randint(1, 60) for _ in range(5)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), 8, dtype=torch.int32)
    for i, n in enumerate(lens):
        nb = -(n // -bs)
        tables[i, :nb] = torch.tensor(perm[i * 8:i * 8 + nb])
    q = torch.randn(len(lens), hkv * gqa, d, generator=g)
    ref = paged_attention_torch(q, k_cache, v_cache, tables, [1] * len(lens), lens, 0.2)
    got = paged_decode_torch(q, k_cache, v_cache, tables, torch.tensor(lens), max(lens), 0.2)
    torch.testing.assert_close(got, ref, msg=f"seed {seed}")


def out(sample, tokens, reason=None, n=0):
    return SeqOutput("r", sample, tokens, [None] * len(tokens), reason, 4, 0, n)


def test_merge_by_sample_keeps_order_and_latest_state():
    outs = [out(0, [1], n=1), out(1, [7], n=1), out(0, [2], n=2),
            out(1, [8, 9], FinishReason.STOP, 3), out(0, [3], FinishReason.LENGTH, 3)]
    merged = {o.sample_index: o for o in _merge_by_sample(outs)}
    assert merged[0].new_token_ids == [1, 2, 3] and merged[0].finish_reason is FinishReason.LENGTH
    assert merged[1].new_token_ids == [7, 8, 9] and merged[1].num_output_tokens == 3
    assert len(merged[0].new_logprobs) == 3
