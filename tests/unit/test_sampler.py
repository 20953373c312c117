"""Sampler: truncation never lets a disallowed token through, seeds are reproducible and
independent of the batch, penalties move the right logits."""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tandem.engine.sampler import Sampler, SampleRow
from tandem.engine.sampling_params import SamplingParams

VOCAB = 32


def allowed_set(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                min_p: float) -> set[int]:
    """Straightforward reference of which tokens may be drawn."""
    scaled = logits / temperature
    order = sorted(range(len(scaled)), key=lambda i: -float(scaled[i]))
    keep = order[:top_k] if top_k else order
    probs = torch.softmax(scaled[keep].double(), 0)
    mass, kept = 0.0, []
    for tok, p in zip(keep, probs.tolist()):
        if top_p < 1 and kept and mass >= top_p:
            break
        # Within rounding of the cut-off, float32 and float64 may disagree: not a fair case.
        assume(top_p >= 1 or abs(mass - top_p) > 1e-4)
        kept.append(tok)
        mass += p
    full = torch.softmax(scaled.masked_fill(
        torch.tensor([i not in kept for i in range(len(scaled))]), float("-inf")), 0)
    top = float(full.max())
    for t in kept:
        assume(abs(float(full[t]) - min_p * top) > 1e-6)
    return {t for t in kept if float(full[t]) >= min_p * top}


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-8, 8, allow_nan=False), min_size=VOCAB, max_size=VOCAB),
    temperature=st.floats(0.2, 2.0),
    top_k=st.integers(0, VOCAB),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**32),
)
def test_truncation_never_emits_a_disallowed_token(logits, temperature, top_k, top_p, min_p,
                                                   seed):
    x = torch.tensor(logits, dtype=torch.float32)
    # Ties at a cut-off make "the allowed set" ambiguous; spread equal values apart.
    x = x + torch.arange(VOCAB) * 1e-4
    allowed = allowed_set(x, temperature, top_k, top_p, min_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            seed=seed)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    rows = [SampleRow(params, 0, pos) for pos in range(64)]
    out = sampler(x.repeat(64, 1), rows)
    assert set(out.token_ids) <= allowed
    probs = Sampler.filtered_probs(x[None] / temperature, torch.tensor([top_k]),
                                   torch.tensor([top_p]), torch.tensor([min_p]))[0]
    assert {i for i in range(VOCAB) if probs[i] > 0} == allowed
    # The same, decided from the params on the host (what the sampler does: no device sync).
    hosted = Sampler.filtered_probs(x[None] / temperature, torch.tensor([top_k]),
                                    torch.tensor([top_p]), torch.tensor([min_p]),
                                    sort=top_k > 0 or top_p < 1, min_p_on=min_p > 0)[0]
    assert torch.equal(probs, hosted)


def test_seeded_rows_ignore_batch_composition():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    seeded = SamplingParams(temperature=1.0, seed=42)
    free = SamplingParams(temperature=1.0)
    alone = sampler(logits[1:2], [SampleRow(seeded, 0, 5)]).token_ids
    for _ in range(5):
        batch = sampler(logits, [SampleRow(free, 0, 0), SampleRow(seeded, 0, 5),
                                 SampleRow(free, 0, 0)]).token_ids
        assert batch[1] == alone[0]


def test_seed_streams_differ_by_sample_and_position():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = torch.zeros(1, VOCAB)  # uniform: the draw is all noise
    p = SamplingParams(temperature=1.0, seed=7)
    draws = {(i, pos): sampler(logits, [SampleRow(p, i, pos)]).token_ids[0]
             for i in range(4) for pos in range(8)}
    assert len(set(draws.values())) > 8
    assert draws == {(i, pos): sampler(logits, [SampleRow(p, i, pos)]).token_ids[0]
                     for i in range(4) for pos in range(8)}


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = torch.randn(4, VOCAB)
    rows = [SampleRow(SamplingParams(temperature=0), 0, 0),
            SampleRow(SamplingParams(temperature=1.5, top_k=3), 0, 0)] * 2
    out = sampler(logits, rows).token_ids
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert out[1] in logits[1].topk(3).indices.tolist()


def test_penalties():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 2.0
    logits[0, 4] = 1.9
    greedy = SamplingParams(temperature=0)
    assert sampler(logits, [SampleRow(greedy, 0, 0, [], [])]).token_ids == [3]
    rep = SamplingParams(temperature=0, repetition_penalty=1.2)
    # Token 3 appeared in the prompt: 2.0 / 1.2 < 1.9.
    assert sampler(logits, [SampleRow(rep, 0, 0, [3], [])]).token_ids == [4]
    freq = SamplingParams(temperature=0, frequency_penalty=0.06)
    # Token 3 appeared twice in the output: 2.0 - 0.12 < 1.9; once is not enough.
    assert sampler(logits, [SampleRow(freq, 0, 0, [], [3, 3])]).token_ids == [4]
    assert sampler(logits, [SampleRow(freq, 0, 0, [], [3])]).token_ids == [3]
    pres = SamplingParams(temperature=0, presence_penalty=0.2)
    assert sampler(logits, [SampleRow(pres, 0, 0, [3], [])]).token_ids == [3]  # prompt only
    assert sampler(logits, [SampleRow(pres, 0, 0, [], [3])]).token_ids == [4]


def test_logprobs_are_raw_and_sorted():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = torch.randn(1, VOCAB)
    out = sampler(logits, [SampleRow(SamplingParams(temperature=0, logprobs=3), 0, 0)])
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits[0], 0)
    assert lp.sampled.token_id == int(ref.argmax())
    assert abs(lp.sampled.logprob - float(ref.max())) < 1e-6
    assert [t.token_id for t in lp.top] == ref.topk(3).indices.tolist()
