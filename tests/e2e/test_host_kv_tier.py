"""The host KV tier in a whole engine (CPU, float32, a tiny random checkpoint): with more
conversations than the pool holds, turn after turn, outputs are identical with and without the
tier while the tier computes fewer prompt tokens (the scheduler's counter), and a decode engine
pulls fewer blocks from its prefill engine; a salted prefix is never served to another salt from
it; its bytes stay within the flag under many evictions; every pool ends idle."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import RemoteKV, Sequence
from tandem.errors import InvalidArgument
from tandem.kvtransfer.lease import prefix_digest

BLOCK_BYTES = 2 * 2 * 16 * 2 * 64 * 4  # tiny llama: layers x (K, V) x block x kv heads x dim x fp32
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(model: str, host_blocks: float, num_blocks: int = 24, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model, num_blocks=num_blocks, max_model_len=256,
                                  host_kv_cache_gb=host_blocks * BLOCK_BYTES / (1 << 30), **kw),
                     progress=False)


def _generate(engine: LLMEngine, rid: str, prompt: list[int],
              params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    """(output tokens, cached prompt tokens) of one request run alone."""
    engine.add_request(rid, prompt, params)
    tokens, cached = [], 0
    while rid in engine.requests:
        for o in engine.step():
            tokens += o.new_token_ids
            cached = o.num_cached_tokens
    return tokens, cached


def _check_slots(tier) -> None:
    """Every host slot is either free or holds exactly one hash: none leaked, none shared."""
    ix = tier.index
    held = list(ix.lru.values())
    assert len(held) + len(ix.free_slots) == ix.capacity
    assert set(held) | set(ix.free_slots) == set(range(ix.capacity))
    assert not ix.pinned and not tier.ops


def _conversations(engine: LLMEngine | _Disaggregated, num_convs: int = 6, turns: int = 4) -> list[list[int]]:
    """Round-robin turns of num_convs chats; each turn's prompt is the whole conversation so
    far plus a new user message of 20 tokens. 6 chats of up to ~7 blocks: more than 24 blocks."""
    history = [[(7 * c + 3) % 500 + 1] for c in range(num_convs)]
    outputs = []
    for t in range(turns):
        for c in range(num_convs):
            history[c] += [(31 * c + 17 * t + k) % 500 + 1 for k in range(20)]
            out, _ = _generate(engine, f"c{c}t{t}", history[c])
            history[c] += out
            outputs.append(out)
    return outputs


def test_conversations_outgrowing_the_pool_match_and_compute_less(tiny_models):
    model = str(tiny_models["llama"])
    plain = _engine(model, host_blocks=0)
    tiered = _engine(model, host_blocks=200)
    assert plain.host_tier is None and tiered.host_tier is not None
    want = _conversations(plain)
    got = _conversations(tiered)
    assert got == want
    stats = tiered.host_tier.stats()
    assert stats.hits > 0 and stats.stored > 0
    computed = tiered.scheduler.num_prompt_tokens_computed
    baseline = plain.scheduler.num_prompt_tokens_computed
    # Every restored block is a block of prompt not computed.
    assert computed == baseline - 16 * stats.hits, (computed, baseline, stats)
    for e in (plain, tiered):
        assert e.is_idle()
    _check_slots(tiered.host_tier)


def test_tensor_parallel_ranks_keep_and_restore_their_own_heads(tiny_models):
    """At tensor-parallel size 2 rank 0's tier decides and rank 1 replays its copies on its
    own heads: outputs equal the engine's without a tier (a rank restoring nothing would
    decode from stale heads), the flag sizes the worker's tier across both ranks."""
    model = str(tiny_models["llama"])
    tiered = LLMEngine(EngineConfig(model, num_blocks=24, max_model_len=256,
                                    tensor_parallel_size=2,
                                    host_kv_cache_gb=200 * BLOCK_BYTES / (1 << 30)),
                       progress=False)
    try:
        assert tiered.host_tier.index.capacity == 200  # half a block's bytes on each rank
        got = _conversations(tiered)
        stats = tiered.host_tier.stats()
        assert tiered.is_idle()
    finally:
        tiered.shutdown()
    plain = _engine(model, host_blocks=0)
    assert got == _conversations(plain)
    assert stats.hits > 0
    assert (tiered.scheduler.num_prompt_tokens_computed
            == plain.scheduler.num_prompt_tokens_computed - 16 * stats.hits)


def test_salted_prefix_is_never_served_to_another_salt(tiny_models):
    engine = _engine(str(tiny_models["llama"]), host_blocks=64, num_blocks=8)
    prompt = list(range(1, 50))  # 3 full blocks + 1 token
    a = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, cache_salt="tenant-a")
    b = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, cache_salt="tenant-b")
    first, _ = _generate(engine, "a1", prompt, a)
    # Other prompts take every block: tenant-a's prefix is now in the host tier alone.
    for i in range(3):
        _generate(engine, f"x{i}", [400 + i] * 120)
    hashes = set(engine.host_tier.index.lru)
    assert not hashes & set(engine.block_pool.cached)
    hits = engine.host_tier.stats().hits
    for rid, params in (("b", b), ("none", GREEDY)):
        _, cached = _generate(engine, rid, prompt, params)
        assert cached == 0
    assert engine.host_tier.stats().hits == hits
    again, cached = _generate(engine, "a2", prompt, a)
    assert cached == 48 and again == first
    assert engine.is_idle()


def test_tier_bytes_stay_within_the_flag(tiny_models):
    flag_blocks = 5.5
    engine = _engine(str(tiny_models["llama"]), host_blocks=flag_blocks, num_blocks=8)
    flag_bytes = flag_blocks * BLOCK_BYTES
    tier = engine.host_tier
    assert tier.capacity_bytes <= flag_bytes
    for i in range(20):
        _generate(engine, f"r{i}", [(13 * i + k) % 500 + 1 for k in range(40)])
        assert tier.stats().bytes_used <= flag_bytes and tier.allocated_bytes <= flag_bytes
    stats = tier.stats()
    assert stats.evictions > 0 and len(tier.index) == tier.index.capacity == 5
    _check_slots(tier)
    assert engine.is_idle()


class _Disaggregated:
    """A prefill engine and a decode engine driven as one engine (add_request, step,
    requests): the prompt's KV is pulled in-process, the lease released once the request ends."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine) -> None:
        self.prefill, self.decode = prefill, decode
        self.requests = decode.requests
        self.leases: dict[str, str] = {}
        self.pulled = 0
        decode.kv_connector.connect(self._pull)

    def _pull(self, remote: RemoteKV, src: list[int], dst: list[int]) -> None:
        self.pulled += len(dst)
        self.decode.runner.pool[torch.tensor(dst, dtype=torch.long)] = \
            self.prefill.runner.pool[torch.tensor(src, dtype=torch.long)]

    def add_request(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.prefill.add_request(rid, prompt, params)
        outs = []
        while rid in self.prefill.requests:
            outs += self.prefill.step()
        (h,) = [o.handoff for o in outs if o.handoff is not None]
        self.leases[rid] = h.lease_id
        self.decode.add_remote_request(rid, prompt, params, RemoteKV(
            "p", h.lease_id, float("inf"), h.block_ids, h.first_token_ids, h.first_logprobs))

    def step(self) -> list:
        outs = self.decode.step()
        for rid in [r for r in self.leases if r not in self.requests]:
            assert self.prefill.kv_connector.release(self.leases.pop(rid))
        return outs


def _disaggregated_conversations(model: str, host_blocks: float) -> tuple[list, int, LLMEngine]:
    """The conversations through a prefill engine and a decode engine of 24 blocks (the decode
    pool evicts); (outputs after each first token, blocks pulled, the decode engine)."""
    prefill = LLMEngine(EngineConfig(model, role="prefill", max_model_len=256), progress=False)
    decode = LLMEngine(EngineConfig(model, role="decode", num_blocks=24, max_model_len=256,
                                    host_kv_cache_gb=host_blocks * BLOCK_BYTES / (1 << 30)),
                       progress=False)
    both = _Disaggregated(prefill, decode)
    outputs = _conversations(both)
    assert prefill.is_idle() and decode.is_idle()
    return outputs, both.pulled, decode


def test_decode_role_pulls_less_with_the_tier(tiny_models):
    model = str(tiny_models["llama"])
    want, pulled_plain, _ = _disaggregated_conversations(model, host_blocks=0)
    got, pulled_tiered, decode = _disaggregated_conversations(model, host_blocks=200)
    assert got == want
    hits = decode.host_tier.stats().hits
    assert hits > 0 and pulled_tiered == pulled_plain - hits
    _check_slots(decode.host_tier)


@pytest.mark.parametrize("gb", [0, None])
def test_off_on_the_cpu_unless_asked(tiny_models, gb):
    engine = LLMEngine(EngineConfig(str(tiny_models["llama"]), num_blocks=8, max_model_len=128,
                                    host_kv_cache_gb=gb), progress=False)
    assert engine.host_tier is None and engine.block_pool.on_evict is None


# -- a prefix lent from another engine's host tier (engine/llm_engine.py lend_prefix) -------------

class _Lender:
    """Engine A's prefix lent to engine B in-process: B's puller copies A's pool blocks (or
    fails as `failure` says: at the start, or while the pull is pending), and counts them."""

    def __init__(self, lender: LLMEngine, borrower: LLMEngine, failure: str = "") -> None:
        self.lender, self.borrower, self.failure = lender, borrower, failure
        self.pulled = 0
        self.dropped: list[RemoteKV] = []
        borrower.kv_connector.connect(self._pull, self.dropped.append)

    def _pull(self, remote: RemoteKV, src: list[int], dst: list[int]):
        if self.failure == "start":
            raise RuntimeError("the lender is gone")
        if self.failure == "pending":
            return _FailingPull()
        self.pulled += len(dst)
        pool = self.borrower.runner.pool
        pool[torch.tensor(dst, dtype=torch.long)] = \
            self.lender.runner.pool[torch.tensor(src, dtype=torch.long)]
        return None


class _FailingPull:
    """A pull outside the stream (as NIXL's) whose peer dies: pending once, then failed."""

    def __init__(self) -> None:
        self.polls = 0

    def done(self) -> bool:
        self.polls += 1
        if self.polls > 1:
            raise RuntimeError("NIXL: the peer is gone")
        return False

    def cancel(self) -> None:
        pass


def _turn_one_in_the_tier(model: str, **kw) -> tuple[LLMEngine, list[int]]:
    """Engine A (a 24-block pool over a host tier) runs a conversation's first turn, then other
    prompts push it out of the pool into the tier; A and turn 2's prompt."""
    a = _engine(model, host_blocks=200, **kw)
    first = [(11 * i + 5) % 500 + 1 for i in range(50)]
    out, _ = _generate(a, "turn1", first)
    for i in range(3):
        _generate(a, f"fill{i}", [(13 * k + i) % 500 + 1 for k in range(120)])
    return a, [*first, *out, 7, 8, 9]


@pytest.mark.parametrize("failure,pool", [("", {}), ("start", {}), ("pending", {}),
                                          ("", {"kv_cache_dtype": "fp8"})])
def test_a_prefix_in_another_engines_tier_is_pulled_not_computed(tiny_models, failure, pool):
    """Turn 2 on engine B, whose prefix sits in engine A's host tier (A's pool evicted it):
    A lends it (restored into its pool, under a lease), B pulls those blocks and computes only
    the rest; outputs equal an engine's without any tier (float32 pools, and FP8 ones: their
    blocks move as bytes under the checkpoint's scales, as a bf16 pool's would). A
    pull that fails (the lender gone at the start, or mid-pull) has B compute the prefix
    instead, with the same output. Every pool and tier slot ends idle once the lease is
    released."""
    model = str(tiny_models["llama"])
    a, prompt = _turn_one_in_the_tier(model, **pool)
    want, _ = _generate(_engine(model, host_blocks=0, num_blocks=64, **pool), "ref", prompt)
    hashes = Sequence("", prompt, GREEDY).full_block_hashes(16, len(prompt))
    assert not a.block_pool.lookup(hashes) and hashes[0] in a.host_tier.index.lru
    restored = a.host_tier.stats().hits
    assert a.lend_prefix(prompt, "tenant-b") is None  # another salt's blocks: none held
    lent = a.lend_prefix(prompt)
    assert lent.num_tokens == 3 * 16 and len(lent.block_ids) == 3  # turn 1 computed 55 tokens
    assert a.host_tier.stats().hits == restored + 3  # copied back from the tier to lend
    assert lent.digest == prefix_digest(prompt[:48], "")
    b = _engine(model, host_blocks=0, num_blocks=64, **pool)
    link = _Lender(a, b, failure)
    b.add_remote_request("turn2", prompt, GREEDY, RemoteKV(
        "a", lent.lease_id, float("inf"), lent.block_ids, (), (), num_tokens=lent.num_tokens,
        prefix=True))
    got, cached = [], 0
    while "turn2" in b.requests:
        for o in b.step():
            got += o.new_token_ids
            cached = o.num_cached_tokens
    assert got == want
    if failure:
        assert link.pulled == 0 and cached == 0
        assert b.scheduler.num_prompt_tokens_computed == len(prompt)
    else:
        assert link.pulled == 3 and cached == 48
        assert b.scheduler.num_prompt_tokens_computed == len(prompt) - 48
        assert set(hashes[:3]) <= set(b.block_pool.cached)  # now in B's own prefix cache
    assert a.kv_connector.release(lent.lease_id)  # the worker's Release after LeaseDone
    assert a.is_idle() and b.is_idle()
    _check_slots(a.host_tier)


def test_a_lent_prefix_the_borrower_holds_already_is_let_go_unpulled(tiny_models):
    model = str(tiny_models["llama"])
    a, prompt = _turn_one_in_the_tier(model)
    lent = a.lend_prefix(prompt)
    b = _engine(model, host_blocks=0, num_blocks=64)
    link = _Lender(a, b)
    _generate(b, "warm", prompt)  # B's own cache now holds the whole prefix
    remote = RemoteKV("a", lent.lease_id, float("inf"), lent.block_ids, (), (),
                      num_tokens=lent.num_tokens, prefix=True)
    b.add_remote_request("turn2", prompt, GREEDY, remote)
    while "turn2" in b.requests:
        b.step()
    assert link.pulled == 0 and link.dropped == [remote]
    assert a.kv_connector.release(lent.lease_id)
    assert a.is_idle() and b.is_idle()


def test_a_lent_prefix_is_checked_on_arrival(tiny_models):
    b = _engine(str(tiny_models["llama"]), host_blocks=0, num_blocks=64)
    prompt = list(range(1, 40))
    bad = RemoteKV("a", "t", float("inf"), (1, 2), (), (), num_tokens=32, prefix=True)
    with pytest.raises(InvalidArgument, match="pulls no KV"):  # no puller connected
        b.add_remote_request("x", prompt, GREEDY, bad)
    _Lender(b, b)
    for remote, field in ((dataclasses.replace(bad, num_tokens=30), "num_tokens"),
                          (dataclasses.replace(bad, block_ids=(1,)), "num_tokens"),
                          (dataclasses.replace(bad, first_token_ids=(3,)), "prefix_kv")):
        with pytest.raises(InvalidArgument, match=field):
            b.add_remote_request("x", prompt, GREEDY, remote)
    with pytest.raises(InvalidArgument, match="prompt_logprobs"):
        b.add_remote_request("x", prompt, dataclasses.replace(GREEDY, prompt_logprobs=0), bad)
    with pytest.raises(InvalidArgument, match="num_tokens"):  # nothing left to compute
        b.add_remote_request("x", prompt[:32], GREEDY, bad)
    assert b.is_idle()
