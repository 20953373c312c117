"""Engines that change role in place (LLMEngine.switch_role, what a worker's SwitchRole does to
its engine core): a prefill and a decode engine joined by an in-process pull run a turn, trade
roles, and run the next turn the other way. The tokens equal those of a pair that never
switched, each engine's prefix cache serves its new role (the new decode engine pulls only what
it did not prefill itself), a switch is refused while anything is held (and changes nothing
then), and every pool ends idle."""

from __future__ import annotations

import pytest
from test_decode_prefix_reuse import FIRST, GREEDY, NEW_TURNS, Link

from tandem.engine.config import EngineConfig, cdiv
from tandem.engine.llm_engine import LLMEngine
from tandem.errors import InvalidArgument


@pytest.fixture(scope="module")
def model(tiny_models):
    return str(tiny_models["llama"])


def test_engines_that_trade_roles_give_the_same_tokens_and_keep_their_caches(model):
    want = Link(model).turns("conv", [FIRST, NEW_TURNS[0]], GREEDY)
    link = Link(model)
    (p1, o1), = link.turns("conv", [FIRST], GREEDY)
    a, b = link.prefill, link.decode
    # Not while a request is held: refused, and nothing changed.
    a.add_request("busy", [5, 6, 7], GREEDY)
    with pytest.raises(RuntimeError, match="not idle"):
        a.switch_role("decode")
    assert a.config.role == "prefill" and "busy" in a.requests
    a.abort("busy")
    a.step()
    a.switch_role("decode")
    b.switch_role("prefill")
    assert (a.config.role, b.config.role) == ("decode", "prefill")
    assert b.scheduler.config.policy == "fcfs" and not b.pipeline.enabled
    link.prefill, link.decode = b, a
    a.kv_connector.connect(link._pull)  # the new decode connector, wired as a core wires it
    p2 = p1 + o1 + NEW_TURNS[0]
    hits = b.block_pool.prefix_hits
    assert [(p1, o1), (p2, link.run("conv-1", p2, GREEDY))] == want
    # a prefilled turn 1 and kept its blocks: it pulls the rest only; b decoded turn 1 and
    # prefills turn 2 from what it cached then.
    src, _ = link.pulls[-1]
    assert len(src) == cdiv(len(p2), 16) - len(p1) // 16
    assert b.block_pool.prefix_hits - hits >= (len(p1) + len(o1) - 1) // 16
    link.assert_idle()
    link.close()


def test_only_prefill_and_decode_engines_without_speculation_trade_roles(model):
    spec = LLMEngine(EngineConfig(model, role="decode", max_model_len=256,
                                  speculative_method="ngram"), progress=False)
    both = LLMEngine(EngineConfig(model, max_model_len=256), progress=False)
    try:
        with pytest.raises(InvalidArgument, match="speculative") as e:
            spec.switch_role("prefill")
        assert e.value.field == "role" and spec.config.role == "decode"
        with pytest.raises(InvalidArgument, match="only prefill and decode"):
            both.switch_role("decode")
        with pytest.raises(InvalidArgument):
            spec.switch_role("decode")  # what it is already
    finally:
        spec.shutdown()
        both.shutdown()
