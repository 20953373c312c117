"""Sampling with speculation draws from the model's own distribution: a chi-square test on a
model with an 8-token vocabulary. The first output token is sampled alone; the next two come
from one verify step whose fixed drafts are sometimes right, sometimes wrong. The observed
joint distribution of output tokens 2 and 3 over 3,000 samples (unseeded, from a fixed torch
seed: the test cannot flake) is compared with the exact one computed from transformers'
logits of the same checkpoint, at significance 0.001."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.spec_decode.proposer import ProposeInput

VOCAB = 8
PROMPT = [1, 4, 2, 6]
SAMPLES = 3000
DRAFT = [4, 6]  # likely tokens: drafts often kept
PARAMS = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)


class Fixed:
    def propose(self, inp: ProposeInput) -> list[list[int]]:
        return [DRAFT[:k] for k in inp.max_tokens]

    def release(self, seq) -> None:
        pass


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64,
                                      initializer_range=0.2, bos_token_id=0, eos_token_id=7)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("vocab8")
    model.save_pretrained(out)
    return out, model


def exact_joint(model) -> torch.Tensor:
    """p(x2, x3) = sum over x1 of p(x1) p(x2 | x1) p(x3 | x1, x2), float64 [VOCAB, VOCAB]."""

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        return logits.double().softmax(-1)

    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p1 = probs(PROMPT)
    for x1 in range(VOCAB):
        p2 = probs([*PROMPT, x1])
        for x2 in range(VOCAB):
            joint[x2] += p1[x1] * p2[x2] * probs([*PROMPT, x1, x2])
    return joint


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Wilson-Hilferty: the chi-square quantile whose upper tail is that of z (3.0902: 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_distribution_matches_the_model(tiny_vocab):
    path, model = tiny_vocab
    llm = LLM(str(path), progress=False, speculative_method="ngram", num_speculative_tokens=2,
              speculative_max_batch=1024)
    llm.engine.spec.proposer = Fixed()
    torch.manual_seed(1234)
    # In groups one step admits whole: no step speculates while a prompt waits or prefills.
    group = 200
    outs = [o for i in range(0, SAMPLES, group)
            for o in llm.generate([PROMPT] * min(group, SAMPLES - i), PARAMS)]
    assert llm.engine.is_idle()
    c = llm.engine.spec.counters
    # Every sample's second and third tokens came from a verify step, drafts both kept and not.
    assert c.num_verifies >= SAMPLES
    assert 0 < c.accepted_at[0] < c.drafted_at[0] and c.accepted_at[1] > 0
    observed = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for o in outs:
        toks = o.outputs[0].token_ids
        observed[toks[1], toks[2]] += 1
    expected = exact_joint(model) * SAMPLES
    keep = expected >= 5  # cells expected under 5 pooled into one
    obs = torch.cat([observed[keep], observed[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    assert stat < chi2_critical(df), f"chi-square {stat:.1f} over {df} degrees of freedom"
