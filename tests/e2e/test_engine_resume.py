"""A request moved to another decode engine mid-stream (RemoteKV.resume_token_ids): the decode
engine pulls the prompt's KV, recomputes the KV of the outputs the client already has, and
samples on at the same sample indices and output positions. Its full output equals an
uninterrupted run's, greedy and seeded, n = 1 and n = 2, penalties included, wherever the cut
falls; samples that had already finished stay finished; every pool ends idle. The same holds
for a request replayed on a decode engine that prefills its prompt itself (Replay: no prefill
worker was up when it moved)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.llm import LLM
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import RemoteKV, Replay
from tandem.errors import InvalidArgument

PROMPT = [7, 19, 3, 88, 41, 5, 16, 230, 9, 77, 12, 54, 6, 140, 33, 2, 90, 61, 8]  # 1 block + 3

CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=24,
                             ignore_eos=True),
    "seeded-n2": SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
    "penalties-n2": SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24,
                                   presence_penalty=1.0, frequency_penalty=0.5,
                                   repetition_penalty=1.2, ignore_eos=True),
    # Samples of different lengths: one ends (max_tokens) before the cut in some cases.
    "stops-n2": SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=24,
                               stop_token_ids=(5, 16, 33, 90)),
}


@pytest.fixture(scope="module")
def engines(tiny_models):
    model = str(tiny_models["llama"])
    offline = LLM(model, progress=False, max_model_len=256)
    prefill = LLMEngine(EngineConfig(model, role="prefill", max_model_len=256), progress=False)
    # Small steps: the recomputed outputs take several chunks.
    decode = LLMEngine(EngineConfig(model, role="decode", max_model_len=256,
                                    max_num_batched_tokens=8), progress=False)

    def pull(remote: RemoteKV, src: list[int], dst: list[int]) -> None:
        decode.runner.pool[torch.tensor(dst, dtype=torch.long)] = \
            prefill.runner.pool[torch.tensor(src, dtype=torch.long)]

    decode.kv_connector.connect(pull)
    yield offline, prefill, decode
    for e in (offline.engine, prefill, decode):
        assert e.is_idle()


def _until_done(engine: LLMEngine, rid: str) -> list:
    outs = []
    while rid in engine.requests:
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def resume(prefill: LLMEngine, decode: LLMEngine, rid: str, params: SamplingParams,
           expected: list[list[int]], cut: int) -> list[list[int]]:
    """Prefill the prompt again, then decode with each sample's first `cut` outputs (fewer
    where it had fewer) as the client's tokens so far; the client's full output."""
    prefill.add_request(rid, PROMPT, params)
    (handoff,) = [o.handoff for o in _until_done(prefill, rid)]
    # The first tokens travel from the first prefill (unseeded they could differ here).
    firsts = tuple(e[0] for e in expected)
    so_far = [e[:cut] for e in expected]
    remote = RemoteKV("src", "L", float("inf"), handoff.block_ids, firsts, (None,) * params.n,
                      tuple(tuple(s[1:]) for s in so_far))
    decode.add_remote_request(rid, PROMPT, params, remote)
    got = [list(s) for s in so_far]
    for o in _until_done(decode, rid):
        got[o.sample_index] += o.new_token_ids
    assert prefill.kv_connector.release(handoff.lease_id)
    return got


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_outputs_equal_an_uninterrupted_run(engines, case):
    offline, prefill, decode = engines
    params = CASES[case]
    (out,) = offline.generate([PROMPT], params)
    expected = [o.token_ids for o in out.outputs]
    if case == "stops-n2":
        assert len({len(e) for e in expected}) > 1, "samples of one length test less"
    for cut in (1, 2, 5, 13, max(len(e) for e in expected)):
        got = resume(prefill, decode, f"{case}-{cut}", params, expected, cut)
        assert got == expected, f"cut after {cut} tokens"


def test_resume_is_checked_before_any_block(engines):
    _, _, decode = engines
    params = SamplingParams(n=2, temperature=0, max_tokens=4)

    def add(resume):
        decode.add_remote_request("bad", PROMPT, params,
                                  RemoteKV("src", "L", float("inf"), (0, 1), (1, 2), (None, None),
                                           resume))

    with pytest.raises(InvalidArgument, match="resume"):
        add(((3,),))  # one sample of two
    with pytest.raises(InvalidArgument, match="resume"):
        add(((3,), (1 << 20,)))  # outside the vocabulary
    with pytest.raises(InvalidArgument, match="resume"):
        add(((3, 4, 5, 6), ()))  # 5 outputs, max_tokens 4
    assert decode.is_idle()


def replay(decode: LLMEngine, rid: str, params: SamplingParams, expected: list[list[int]],
           cut: int) -> list[list[int]]:
    """The prompt prefilled on the decode engine itself, each sample's first `cut` outputs
    replayed as the client's tokens so far; the client's full output."""
    so_far = [e[:cut] for e in expected]
    decode.add_replayed_request(rid, PROMPT, params, Replay(
        tuple(s[0] for s in so_far), (None,) * params.n, tuple(tuple(s[1:]) for s in so_far)))
    got = [list(s) for s in so_far]
    for o in _until_done(decode, rid):
        got[o.sample_index] += o.new_token_ids
    return got


@pytest.mark.parametrize("case", list(CASES))
def test_replayed_outputs_equal_an_uninterrupted_run(engines, case):
    offline, _, decode = engines
    params = CASES[case]
    (out,) = offline.generate([PROMPT], params)
    expected = [o.token_ids for o in out.outputs]
    for cut in (1, 3, 13, max(len(e) for e in expected)):
        assert replay(decode, f"replay-{case}-{cut}", params, expected, cut) == expected, \
            f"cut after {cut} tokens"
    assert decode.is_idle()


def test_replay_is_checked_before_any_block(engines):
    _, _, decode = engines
    params = SamplingParams(n=2, temperature=0, max_tokens=4)
    with pytest.raises(InvalidArgument, match="first_token_ids"):
        decode.add_replayed_request("bad", PROMPT, params, Replay((1,), (None,)))
    with pytest.raises(InvalidArgument, match="resume"):
        decode.add_replayed_request("bad", PROMPT, params,
                                    Replay((1, 2), (None, None), ((3, 4, 5, 6), ())))
    assert decode.is_idle()
