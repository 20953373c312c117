"""Decode-side prefix reuse, engine to engine in one process: a conversation's next turn pulls
from the prefill worker's lease only the prompt blocks the decode engine's prefix cache does
not hold (counted), outputs are token-identical to a decode engine with reuse off (greedy,
float32), a decode engine with an empty cache pulls everything, preemption of a request that
shares cached blocks recomputes it correctly, and every pool ends idle."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.config import EngineConfig, cdiv
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import RemoteKV

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
FIRST = [(7 * i + 3) % 250 + 1 for i in range(40)]  # 2 full blocks + 8
NEW_TURNS = [[(11 * i + 5) % 250 + 1 for i in range(30)],
             [(13 * i + 9) % 250 + 1 for i in range(25)]]


class Link:
    """A prefill and a decode engine joined by an in-process pull that records each pull's
    (src, dst) block lists."""

    def __init__(self, model: str, *, reuse: bool = True, num_blocks: int | None = None,
                 max_num_batched_tokens: int = 2048) -> None:
        self.prefill = LLMEngine(EngineConfig(model, role="prefill", max_model_len=512),
                                 progress=False)
        self.decode = LLMEngine(EngineConfig(model, role="decode", max_model_len=512,
                                             enable_prefix_caching=reuse, num_blocks=num_blocks,
                                             max_num_batched_tokens=max_num_batched_tokens),
                                progress=False)
        self.pulls: list[tuple[list[int], list[int]]] = []
        self.decode.kv_connector.connect(self._pull)

    def _pull(self, remote: RemoteKV, src: list[int], dst: list[int]) -> None:
        self.pulls.append((list(src), list(dst)))
        self.decode.runner.pool[torch.tensor(dst, dtype=torch.long)] = \
            self.prefill.runner.pool[torch.tensor(src, dtype=torch.long)]

    def turns(self, rid: str, prompts: list[list[int]], params: SamplingParams
              ) -> list[tuple[list[int], list[int]]]:
        """Run each prompt (after the first: the conversation so far + its new tokens) through
        prefill then decode; per turn, (prompt, output)."""
        done, history = [], []
        for t, new in enumerate(prompts):
            prompt = history + new
            out = self.run(f"{rid}-{t}", prompt, params)
            done.append((prompt, out))
            history = prompt + out
        return done

    def run(self, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
        self.prefill.add_request(rid, prompt, params)
        (handoff,) = [o.handoff for o in _until_done(self.prefill, rid)]
        remote = RemoteKV("src", "L", float("inf"), handoff.block_ids, handoff.first_token_ids,
                          handoff.first_logprobs)
        self.decode.add_remote_request(rid, prompt, params, remote)
        out = list(handoff.first_token_ids)
        for o in _until_done(self.decode, rid):
            out += o.new_token_ids
        assert self.prefill.kv_connector.release(handoff.lease_id)  # exactly once: a second is refused
        assert not self.prefill.kv_connector.release(handoff.lease_id)
        return out

    def assert_idle(self) -> None:
        for e in (self.prefill, self.decode):
            assert e.is_idle(), e.block_pool.ref_counts

    def close(self) -> None:
        self.prefill.shutdown()
        self.decode.shutdown()


def _until_done(engine: LLMEngine, rid: str) -> list:
    outs = []
    while rid in engine.requests:
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.fixture(scope="module")
def model(tiny_models):
    return str(tiny_models["llama"])


def test_second_turn_pulls_only_its_new_blocks(model):
    link = Link(model)
    (p1, o1), (p2, _), (p3, _) = link.turns("conv", [FIRST, *NEW_TURNS], GREEDY)
    first, second, third = link.pulls
    assert len(first[0]) == cdiv(len(p1), BS)  # nothing cached yet: the whole prompt
    # Turn 1 computed KV for its prompt and every output but the last (never fed back): the
    # full blocks of that stay cached here, and turn 2 starts with them.
    kept = (len(p1) + len(o1) - 1) // BS
    assert p2[:kept * BS] == (p1 + o1)[:kept * BS]
    assert len(second[0]) == cdiv(len(p2), BS) - kept
    assert 0 < len(second[0]) < cdiv(len(p2), BS)
    assert len(third[0]) < cdiv(len(p3), BS) // 2
    # The prefill side computes only what its own cache lacks: turn 1's prompt blocks hit.
    assert link.prefill.block_pool.prefix_hits >= len(p1) // BS
    link.assert_idle()
    link.close()


def test_outputs_equal_with_and_without_reuse(model):
    on, off = Link(model, reuse=True), Link(model, reuse=False)
    with_reuse = on.turns("conv", [FIRST, *NEW_TURNS], GREEDY)
    without = off.turns("conv", [FIRST, *NEW_TURNS], GREEDY)
    assert with_reuse == without
    assert sum(len(s) for s, _ in on.pulls) < sum(len(s) for s, _ in off.pulls)
    # Reuse off: every turn pulls its whole prompt.
    assert [len(s) for s, _ in off.pulls] == [cdiv(len(p), BS) for p, _ in without]
    for link in (on, off):
        link.assert_idle()
        link.close()


def test_empty_cache_pulls_everything_and_gives_the_same_tokens(model):
    warm = Link(model)
    turns = warm.turns("conv", [FIRST, *NEW_TURNS], GREEDY)
    # A decode engine started afresh (a restarted worker): turn 3's prompt, nothing cached.
    cold = Link(model)
    prompt, expected = turns[-1]
    assert cold.run("again", prompt, GREEDY) == expected
    assert [len(s) for s, _ in cold.pulls] == [cdiv(len(prompt), BS)]
    for link in (warm, cold):
        link.assert_idle()
        link.close()


def test_shared_blocks_survive_preemption(model):
    """Requests sharing a conversation's cached blocks on a decode pool too small for all of
    them: the newest are preempted (recomputed locally, their shared blocks dropped once each)
    and give the same tokens as on a roomy pool."""
    roomy = Link(model)
    (p1, o1), = roomy.turns("conv", [FIRST], GREEDY)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    branches = [p1 + o1 + [(17 * i + k) % 250 + 1 for i in range(20)] for k in range(5)]
    expected = [roomy.run(f"b{k}", p, params) for k, p in enumerate(branches)]

    small = Link(model, num_blocks=22, max_num_batched_tokens=32)
    small.turns("conv", [FIRST], GREEDY)
    handoffs = []
    for k, p in enumerate(branches):
        small.prefill.add_request(f"b{k}", p, params)
        (h,) = [o.handoff for o in _until_done(small.prefill, f"b{k}")]
        handoffs.append(h)
        small.decode.add_remote_request(f"b{k}", p, params, RemoteKV(
            "src", "L", float("inf"), h.block_ids, h.first_token_ids, h.first_logprobs))
    got = {f"b{k}": list(h.first_token_ids) for k, h in enumerate(handoffs)}
    while small.decode.requests:
        for o in small.decode.step():
            got[o.request_id] += o.new_token_ids
    assert small.decode.scheduler.num_preemptions > 0
    assert [got[f"b{k}"] for k in range(5)] == expected
    # Each branch kept the conversation's cached blocks: pulls skipped them.
    kept = (len(p1) + len(o1) - 1) // BS
    for src, _ in small.pulls[1:]:
        assert len(src) == cdiv(len(branches[0]), BS) - kept
    for h in handoffs:
        assert small.prefill.kv_connector.release(h.lease_id)
    for link in (roomy, small):
        link.assert_idle()
        link.close()


def test_a_prompt_wholly_cached_pulls_nothing(model):
    """A prompt of whole blocks that the decode engine computed itself (here: an earlier point
    of the conversation, asked again): no block moves, the lease is still released once, and
    the tokens equal a decode engine's without reuse."""
    on, off = Link(model), Link(model, reuse=False)
    (p1, o1), = on.turns("conv", [FIRST], GREEDY)
    again = (p1 + o1)[:3 * BS]  # turn 1 computed 59 tokens here: 3 full blocks
    assert on.run("again", again, GREEDY) == off.run("again", again, GREEDY)
    assert on.pulls[-1] == ([], [])
    assert len(off.pulls[-1][0]) == 3
    for link in (on, off):
        link.assert_idle()
        link.close()
