"""Sampling with speculation draws from the model's own distribution: a chi-square test on a
model with an 8-token vocabulary. The first output token is sampled alone; the next ones come
from verify steps whose fixed drafts are sometimes right, sometimes wrong. The observed joint
distributions of output tokens 2 and 3, and of 3 and 4, over 3,000 samples (unseeded, from a
fixed torch seed: the test cannot flake) are compared with the exact ones computed from
transformers' logits of the same checkpoint, at significance 0.001 each, with and without
pipelined steps."""

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


def exact_joints(model) -> tuple[torch.Tensor, torch.Tensor]:
    """p(x1, x2) and p(x2, x3) of output tokens 1..3 (0 is the first), summed over the tokens
    before: float64 [VOCAB, VOCAB] each."""

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        return logits.double().softmax(-1)

    j12 = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    j23 = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p0 = probs(PROMPT)
    for x0 in range(VOCAB):
        p1 = probs([*PROMPT, x0])
        for x1 in range(VOCAB):
            p2 = probs([*PROMPT, x0, x1])
            for x2 in range(VOCAB):
                w = p0[x0] * p1[x1] * p2[x2]
                j12[x1, x2] += w
                j23[x2] += w * probs([*PROMPT, x0, x1, x2])
    return j12, j23


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Wilson-Hilferty: the chi-square quantile whose upper tail is that of z (3.0902: 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("pipelined", [False, True])
def test_sampled_distribution_matches_the_model(tiny_vocab, pipelined):
    """Pipelined steps too (resolved before each step that may verify drafts)."""
    path, model = tiny_vocab
    llm = LLM(str(path), progress=False, speculative_method="ngram", num_speculative_tokens=2,
              speculative_max_batch=1024, async_scheduling=pipelined)
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
    j12, j23 = exact_joints(model)
    for first, exact in ((1, j12), (2, j23)):
        observed = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        for o in outs:
            toks = o.outputs[0].token_ids
            observed[toks[first], toks[first + 1]] += 1
        stat, df = chi2(observed, exact * SAMPLES)
        assert stat < chi2_critical(df), \
            f"tokens {first}, {first + 1}: chi-square {stat:.1f} over {df} degrees of freedom"


def chi2(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """The statistic and its degrees of freedom, cells expected under 5 pooled into one."""
    keep = expected >= 5
    obs = torch.cat([observed[keep], observed[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
