"""Draft-model speculation (engine/spec_decode/draft.py) and the back-off by acceptance
(engine/spec_decode/backoff.py): the output is the same with and without them.

The draft checkpoints are built from the tiny llama (tests/tiny.py build_tiny_draft): the
target itself (every draft must be accepted), and the target with a little noise on its
weights (drafts accepted often but not always: every accept length from 0 to k happens, so
the draft's KV is rewound at every offset). After every step each pool holds exactly the
blocks its sequences' computed tokens need: the model's (check_blocks) and the draft's; both
end idle after every request.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
import torch
import transformers
from handoffs import hand_off_one_by_one
from test_spec_decode import GREEDY, PROMPTS, SAMPLED, Fixed, check_blocks, outputs

from cluster import Cluster
from tandem.engine.config import EngineConfig, cdiv
from tandem.engine.llm import LLM
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.errors import InvalidArgument
from tiny import build_tiny_draft

K = 3


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory) -> dict:
    """name -> draft checkpoint for the tiny llama: "self" (the target), "noisy"."""
    target = tiny_models["llama"]
    root = tmp_path_factory.mktemp("drafts")
    return {"self": target, "noisy": build_tiny_draft(target, root / "noisy", noise=0.05)}


@pytest.fixture(scope="module")
def base(tiny_models) -> list:
    return outputs(LLM(str(tiny_models["llama"]), progress=False), PROMPTS, GREEDY)


def check_draft_blocks(engine: LLMEngine) -> None:
    """The draft's pool: each draft sequence holds the blocks its computed tokens need, and
    the pool counts exactly the blocks they hold."""
    proposer = engine.spec.proposer
    held = 0
    for d in proposer._drafts.values():
        assert len(d.seq.block_ids) == cdiv(d.seq.num_computed_tokens, proposer.pool.block_size)
        held += len(d.seq.block_ids)
    assert proposer.pool.num_used == held


def draft_llm(target, draft, **kwargs) -> LLM:
    kwargs.setdefault("speculative_min_acceptance", 0)
    llm = LLM(str(target), progress=False, speculative_method="draft", draft_model=str(draft),
              num_speculative_tokens=K, **kwargs)
    e = llm.engine
    e.on_step = lambda outs: (check_blocks(e), check_draft_blocks(e))
    return llm


def test_target_as_its_own_draft_accepts_everything(tiny_models, drafts, base):
    """Every draft right, so every draft KV the draft computed was right too: with block size
    4, a token budget of 16 (a 33-token prompt's draft KV caught up over three steps) and a
    draft pool of 24 blocks (too few for every sequence's draft: drafts of sequences not
    proposing are dropped, some sequences get none in a step)."""
    llm = draft_llm(tiny_models["llama"], drafts["self"], block_size=4,
                    max_num_batched_tokens=16, draft_num_blocks=24)
    assert outputs(llm, PROMPTS, GREEDY) == base
    c = llm.engine.spec.counters
    assert c.num_draft_tokens > len(PROMPTS) * K
    assert c.num_accepted_tokens == c.num_draft_tokens  # acceptance 1.0
    assert llm.engine.spec.proposer.is_idle()


@pytest.mark.parametrize("target,draft", [("qwen2", "qwen2"), ("qwen3", "qwen3"),
                                          ("granite", "granite"), ("mistral", "qwen3")])
def test_other_architectures(tiny_models, target, draft):
    """Each model as its own draft accepts every draft (tied embeddings and biases, q/k
    norms, Granite's multipliers in the draft's runner too); a draft of another architecture
    with the same tokenizer gives the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = outputs(LLM(str(tiny_models[target]), progress=False), PROMPTS[:3], params)
    llm = draft_llm(tiny_models[target], tiny_models[draft])
    assert outputs(llm, PROMPTS[:3], params) == want
    c = llm.engine.spec.counters
    assert c.num_draft_tokens > 0
    if target == draft:
        assert c.num_accepted_tokens == c.num_draft_tokens


def test_noisy_draft_same_tokens_every_accept_length(tiny_models, drafts, base):
    """Drafts rejected at every position (the draft's KV rewound at every offset), block
    size 4, and steps without speculation between verifies (a back-off quick to pause and to
    probe again): the same tokens; and every draft is the draft model's own greedy
    continuation of the sequence (transformers' forward pass of the draft checkpoint over the
    sequence's tokens), so no KV of a rejected guess was ever read."""
    llm = draft_llm(tiny_models["llama"], drafts["noisy"], block_size=4,
                    speculative_min_acceptance=0.6, speculative_probe_interval=2)
    reference = transformers.AutoModelForCausalLM.from_pretrained(drafts["noisy"]).eval()
    proposer = llm.engine.spec.proposer
    propose = proposer.propose
    checked, wrong = [], []  # (a failed assert inside propose would only cost drafts)

    def greedy(tokens: list[int], k: int) -> list[int]:
        tokens = list(tokens)
        with torch.no_grad():
            for _ in range(k):
                tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
        return tokens[-k:]

    def checked_propose(inp):
        got = propose(inp)
        for seq, k, draft in zip(inp.seqs, inp.max_tokens, got):
            want = greedy(seq.token_ids, k)
            if draft != want:
                wrong.append((list(seq.token_ids), draft, want))
            checked.append(k)
        return got

    proposer.propose = checked_propose
    prompts = PROMPTS[2:6]  # 15 to 33 tokens (a block size of 4: many block boundaries)
    assert outputs(llm, prompts, GREEDY) == base[2:6]
    assert not wrong, wrong[0]
    assert len(checked) > 20  # fewer as failed probes pause longer
    assert llm.engine.spec.backoff.counters.num_pauses > 10
    c = llm.engine.spec.counters
    for j in range(K):  # drafts kept and rejected at every position
        assert 0 < c.accepted_at[j] < c.drafted_at[j]
    assert llm.engine.spec.proposer.is_idle()


def test_noisy_draft_seeded_sampling_identical(tiny_models, drafts):
    """Sampled requests take the draft's greedy guesses as point drafts: seeded ones give the
    same tokens as without speculation."""
    path = tiny_models["llama"]
    params = [SAMPLED[i % len(SAMPLED)] for i in range(4)]
    want = outputs(LLM(str(path), progress=False), PROMPTS[:4], params)
    llm = draft_llm(path, drafts["noisy"])
    assert outputs(llm, PROMPTS[:4], params) == want
    assert llm.engine.spec.counters.num_accepted_tokens > 0


def test_decode_role_prefills_the_draft_itself(tiny_models, drafts, base):
    """P/D: the prefill engine has no draft model (first tokens only); the decode engine
    computes the draft's KV of each prompt at its first proposal and gives the colocated
    tokens; every pool ends idle."""
    model, draft = str(tiny_models["llama"]), str(drafts["noisy"])
    prefill = LLMEngine(EngineConfig(model, role="prefill", speculative_method="draft",
                                     draft_model=draft), progress=False)
    assert prefill.spec is None
    decode = LLMEngine(EngineConfig(model, role="decode", speculative_method="draft",
                                    draft_model=draft, num_speculative_tokens=K,
                                    speculative_min_acceptance=0), progress=False)
    decode.kv_connector.connect(lambda remote, src, dst: decode.runner.pool.__setitem__(
        torch.tensor(dst, dtype=torch.long), prefill.runner.pool[torch.tensor(src)]))
    decode.on_step = lambda outs: (check_blocks(decode), check_draft_blocks(decode))
    got = hand_off_one_by_one(prefill, decode, PROMPTS[:4], GREEDY,
                              after=lambda: _idle(decode))  # the draft's pool too
    assert got == base[:4]
    assert decode.spec.counters.num_accepted_tokens > 0
    assert prefill.is_idle()


def test_disaggregated_stack_with_a_draft_model(tiny_models, drafts, base, tmp_path):
    """A router, a prefill worker and a decode worker started with --speculative-method draft
    (real processes): the colocated tokens; drafts accepted; the decode worker's pools, the
    draft's included, back to idle."""
    stack = Cluster(tmp_path, str(tiny_models["llama"]), metrics=True,
                    decode_args=["--speculative-method", "draft", "--draft-model",
                                 str(drafts["noisy"]), "--num-speculative-tokens", str(K),
                                 "--speculative-min-acceptance", "0"]).start()
    try:
        assert [[t] for t in stack.generate(PROMPTS[:4], GREEDY)] == base[:4]
        asyncio.run(stack.wait_idle())
        (decode,) = stack.workers("decode")
        metrics = {line.split()[0].split("{")[0]: float(line.split()[-1])
                   for line in httpx.get(decode.metrics_url, timeout=5).text.splitlines()
                   if line.startswith("tandem:spec_decode")}
        assert metrics["tandem:spec_decode_num_accepted_tokens_total"] > 0, metrics
        assert metrics["tandem:spec_decode_draft_kv_usage_perc"] == 0.0, metrics
    finally:
        codes = stack.stop()
    assert all(code == 0 for code in codes.values()), codes


def test_draft_with_another_tokenizer_is_refused(tiny_models, drafts, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(drafts["noisy"], other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(InvalidArgument, match=r"draft_model.*tokenizer"):
        LLM(str(tiny_models["llama"]), progress=False, speculative_method="draft",
            draft_model=str(other))


def test_a_failing_proposer_costs_only_drafts(tiny_models, drafts, base, caplog):
    """The draft model's pass raising (say, out of memory) in some steps: those steps decode
    without drafts, the others speculate; the same tokens, both pools idle."""
    llm = draft_llm(tiny_models["llama"], drafts["noisy"])
    runner = llm.engine.spec.proposer.runner
    forward, calls = runner.forward, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) % 7 == 0:
            raise RuntimeError("draft forward failed")
        return forward(*args, **kwargs)

    runner.forward = flaky
    assert outputs(llm, PROMPTS[:4], GREEDY) == base[:4]
    assert llm.engine.spec.counters.num_accepted_tokens > 0
    assert "proposer failed" in caplog.text


# -- back-off by acceptance ----------------------------------------------------------------
def test_back_off_spares_a_sample_that_accepts_nothing(tiny_models):
    """A proposer that is never right: with the back-off, the sample verifies far fewer
    drafts than without; the tokens are the same."""
    path = str(tiny_models["llama"])
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = {}
    for min_acceptance in (0, 0.3):
        llm = LLM(path, progress=False, speculative_method="ngram", num_speculative_tokens=K,
                  speculative_min_acceptance=min_acceptance, speculative_probe_interval=8)
        llm.engine.spec.proposer = Fixed([0, 0, 0])  # token 0 is never sampled here
        runs[min_acceptance] = (outputs(llm, PROMPTS[:1], params), llm.engine.spec)
    (plain, off), (backed, on) = runs[0], runs[0.3]
    assert plain == backed
    assert off.counters.num_accepted_tokens == on.counters.num_accepted_tokens == 0
    # Without: a verify in every step with room for a draft (outputs 1 .. 46 of 48).
    assert off.counters.num_verifies == 46
    # With: four verifies (steps 2-5) bring the average to 0.24: paused at least 8 steps, to
    # step 16 on the grid of 8; the probe there keeps nothing: at least 16 steps, to 40; that
    # probe fails too: at least 32 steps, past the request's end (step 48).
    assert on.counters.num_verifies == 4 + 2
    assert on.backoff.counters.num_pauses == 3
    assert on.backoff.counters.num_paused_steps == 10 + 23 + 8  # steps 6-15, 17-39, 41-48


def test_paused_samples_keep_steps_pipelined(tiny_models):
    """Pipelined steps: a step in which every sample is paused does not resolve the step in
    flight for drafts (only probes do), and the tokens are the same."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = outputs(LLM(str(tiny_models["llama"]), progress=False), PROMPTS[:1], params)
    llm = LLM(str(tiny_models["llama"]), progress=False, speculative_method="ngram",
              num_speculative_tokens=K, speculative_probe_interval=8, async_scheduling=True)
    e = llm.engine
    e.spec.proposer = Fixed([0, 0, 0])
    speculate, resolved = e._speculate, []  # steps resolved for drafts

    def counted():
        ran = speculate()
        resolved.append(len(ran))
        return ran

    e._speculate = counted
    assert outputs(llm, PROMPTS[:1], params) == want
    assert e.spec.backoff.counters.num_pauses >= 3  # longer each time: fewer probes
    assert 0 < sum(resolved) <= e.spec.counters.num_verifies < 10



def _idle(engine) -> None:
    assert engine.is_idle()
