"""A decode engine whose pulls complete outside its stream (engine/kv_connector.py PendingPull, as
over NIXL): a pulling request is neither scheduled nor preempted until its pull is done, the
others decode meanwhile, and the tokens are those of a decode engine whose pulls are done at
once; a request that ends while its pull is in flight cancels it (once) before its blocks are
freed; a failed pull fails its request alone. Every pool ends idle.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from handoffs import prefill_all

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import RemoteKV

DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")
PROMPTS = [[5 + i, 17, 33 + i, 2 * i + 1] * (3 + 2 * i) for i in range(6)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
KW = {"max_model_len": 256, "device": DEVICE}


@pytest.fixture(scope="module")
def handoffs(tiny_models):
    model = str(tiny_models["llama"])
    prefill = LLMEngine(EngineConfig(model, role="prefill", **KW), progress=False)
    out = prefill_all(prefill, PROMPTS, PARAMS)
    yield model, prefill, out
    for h in out.values():
        assert prefill.kv_connector.release(h.lease_id)
    assert prefill.is_idle()
    prefill.shutdown()


class SlowPull:
    """Lands its blocks only when polled for the `polls`-th time (or fails then)."""

    def __init__(self, copy, polls: int, fail: bool = False) -> None:
        self.copy, self.left, self.fail = copy, polls, fail
        self.cancelled = 0
        self.landed = False

    def done(self) -> bool:
        assert not self.cancelled, "polled after it was cancelled"
        self.left -= 1
        if self.left > 0:
            return False
        if self.fail:
            raise RuntimeError("peer gone")
        if not self.landed:
            self.copy()
            self.landed = True
        return True

    def cancel(self) -> None:
        self.cancelled += 1


def _decode(handoffs, polls: dict[int, int], fail: frozenset[int] = frozenset(),
            abort_at: dict[int, int] | None = None):
    """Decode every request (r<i> pulled over `polls[i]` polls; None: at once); abort r<i> at
    step abort_at[i]. Returns (tokens by request, errors by request, the pulls made, the
    pulling requests each step)."""
    model, prefill, hs = handoffs
    eng = LLMEngine(EngineConfig(model, role="decode", **KW), progress=False)
    pulls: dict[str, SlowPull] = {}

    def puller(remote, src, dst):
        def copy():
            eng.runner.pool[torch.tensor(dst, dtype=torch.long)] = \
                prefill.runner.pool[torch.tensor(src, dtype=torch.long)]
        i = int(remote.lease_id[1:])
        if polls.get(i) is None:
            copy()
            return None
        pulls[f"r{i}"] = SlowPull(copy, polls[i], fail=i in fail)
        return pulls[f"r{i}"]

    eng.kv_connector.connect(puller)
    out, errors, pulling = {}, {}, []
    for i, prompt in enumerate(PROMPTS):
        h = hs[f"r{i}"]
        eng.add_remote_request(f"r{i}", prompt, PARAMS, RemoteKV(
            "src", f"L{i}", float("inf"), h.block_ids, h.first_token_ids, h.first_logprobs))
        out[f"r{i}"] = list(h.first_token_ids)
    step = 0
    while eng.has_work():
        for i, at in (abort_at or {}).items():
            if at == step:
                assert eng.abort(f"r{i}")
        waiting_on = {s.request_id for s, _ in eng.kv_connector.waiting}
        decoded = set()
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
            if o.new_token_ids:
                decoded.add(o.request_id)
            if o.error:
                errors[o.request_id] = o.error
        pulling.append((waiting_on, decoded))
        step += 1
    assert eng.is_idle() and eng.block_pool.is_idle() and not eng.kv_connector.waiting
    eng.shutdown()
    return out, errors, pulls, pulling


def test_pulling_requests_wait_while_the_others_decode_and_tokens_match(handoffs):
    at_once, _, _, _ = _decode(handoffs, {})
    slow, errors, pulls, pulling = _decode(handoffs, {1: 6, 4: 9})
    assert slow == at_once and not errors
    assert all(len(t) == PARAMS.max_tokens for t in slow.values())
    assert all(p.landed and not p.cancelled for p in pulls.values())
    # (polled twice a step) r1 and r4 were in flight for steps in which the others decoded
    beside = [decoded for waiting_on, decoded in pulling if "r4" in waiting_on]
    assert len(beside) >= 4 and sum(bool(d - {"r1", "r4"}) for d in beside) >= 3
    assert not any("r4" in d for d in beside)


def test_a_request_ending_mid_pull_cancels_it_once_and_frees_its_blocks(handoffs):
    out, errors, pulls, _ = _decode(handoffs, {2: 1000, 3: 4}, abort_at={2: 2})
    assert pulls["r2"].cancelled == 1 and not pulls["r2"].landed
    assert not pulls["r3"].cancelled and pulls["r3"].landed
    assert "r2" not in errors and len(out["r3"]) == PARAMS.max_tokens


def test_a_failed_pull_fails_its_request_alone(handoffs):
    at_once, _, _, _ = _decode(handoffs, {})
    out, errors, pulls, _ = _decode(handoffs, {0: 3, 5: 2}, fail=frozenset({5}))
    assert list(errors) == ["r5"] and "KV transfer failed: peer gone" in errors["r5"]
    assert not pulls["r5"].cancelled
    assert {k: v for k, v in out.items() if k != "r5"} == \
        {k: v for k, v in at_once.items() if k != "r5"}


def test_a_sample_done_by_its_first_token_is_not_scheduled(handoffs):
    """n = 2 whose sample 0 stops at its first token (handed over by the prefill worker): it
    ends as its pull is polled at a step's start, and that step must not schedule it (it did:
    a finished sample, its blocks freed, sent to the model). Sample 1 decodes on."""
    model, prefill, _ = handoffs
    params = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=6, ignore_eos=True)
    prefill.add_request("f", PROMPTS[1], params)
    (h,) = [o.handoff for o in _steps(prefill) if o.handoff is not None]
    first, other = h.first_token_ids
    assert first != other
    eng = LLMEngine(EngineConfig(model, role="decode", **KW), progress=False)

    def puller(remote, src, dst):
        def copy():
            eng.runner.pool[torch.tensor(dst, dtype=torch.long)] = \
                prefill.runner.pool[torch.tensor(src, dtype=torch.long)]
        return SlowPull(copy, 2)

    eng.kv_connector.connect(puller)
    eng.add_remote_request("f", PROMPTS[1], dataclasses.replace(params, stop_token_ids=[first]),
                           RemoteKV("src", "L", float("inf"), h.block_ids, h.first_token_ids,
                                    h.first_logprobs))
    outs = _steps(eng)
    assert all(o.error is None for o in outs)
    assert [len(o.new_token_ids) for o in outs if o.sample_index == 0] == [0]
    assert sum(len(o.new_token_ids) for o in outs if o.sample_index == 1) == 5
    assert eng.is_idle()
    eng.shutdown()
    assert prefill.kv_connector.release(h.lease_id)


def _steps(engine: LLMEngine) -> list:
    """Every output of `engine`'s steps until it has no work."""
    outs = []
    while engine.has_work():
        outs += engine.step()
    return outs
