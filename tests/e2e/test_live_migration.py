"""Live migration between decode engines (engine/migration.py), at random points: a running
request's KV (prompt and generated tokens) is lent by its decode engine, pulled by another
while the source decodes on, and the request is handed over at a step boundary with the tokens
the client got since. Hundreds of migrations, back and forth, of greedy, seeded, penalties and
grammar requests, and n = 2 ones (with and without a grammar: their prompt's KV is lent, each
sample's outputs recomputed at the destination): every client's output equals the offline
engine's, the pulls moved generated blocks (not only the prompt's), n = 2 requests moved by
lease, and every pool and lease ends idle. Corrupting the pulled blocks changes the outputs:
the test reads the KV that moved."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.llm import LLM
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import ResponseFormat, SamplingParams
from tandem.engine.sequence import RemoteKV

GRAMMAR = ResponseFormat("json_schema", json.dumps(
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}},
     "required": ["id"], "additionalProperties": False}))
PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=24, ignore_eos=True),
          SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, max_tokens=24, presence_penalty=1.0,
                         frequency_penalty=0.5, repetition_penalty=1.2, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=5, max_tokens=24, response_format=GRAMMAR),
          SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=24, response_format=GRAMMAR)]
PROMPTS = [[(13 * i + 7 * j) % 250 + 1 for j in range(5 + 5 * i)] for i in range(10)]
MIGRATIONS = 300  # the acceptance's count


@pytest.fixture(scope="module")
def engines(tiny_models):
    model = str(tiny_models["llama"])
    offline = LLM(model, progress=False, max_model_len=256)
    prefill = LLMEngine(EngineConfig(model, role="prefill", max_model_len=256), progress=False)
    decodes = {name: LLMEngine(EngineConfig(model, role="decode", max_model_len=256,
                                            max_num_batched_tokens=16), progress=False)
               for name in ("A", "B")}
    pools = {"P": prefill, **decodes}
    pulled = {"migrated": 0, "with_outputs": 0, "forked": 0, "corrupt": False}

    def puller(engine: LLMEngine):
        def pull(remote: RemoteKV, src: list[int], dst: list[int]) -> None:
            data = pools[remote.address].runner.pool[torch.tensor(src, dtype=torch.long)]
            if remote.handover:
                pulled["migrated"] += len(src)
                if pulled["corrupt"]:
                    data = torch.randn_like(data)
            engine.runner.pool[torch.tensor(dst, dtype=torch.long)] = data
        return pull

    for engine in decodes.values():
        engine.kv_connector.connect(puller(engine))
    yield offline, prefill, decodes, pulled
    for e in (offline.engine, prefill, *decodes.values()):
        assert e.is_idle()


class Client:
    """One request as the router sees it: the tokens its client has, which engine owns it,
    and a migration under way (the destination, its lease, what the client had then)."""

    def __init__(self, rid: str, prompt: list[int], params: SamplingParams, owner: str,
                 firsts: list[int]) -> None:
        self.rid, self.prompt, self.params, self.owner = rid, prompt, params, owner
        self.tokens = [[t] for t in firsts]
        self.done: set[int] = set()
        self.move: tuple[str, str, list[int]] | None = None  # dst, lease, tokens sent


def start(prefill: LLMEngine, engine: LLMEngine, owner: str, rid: str, prompt: list[int],
          params: SamplingParams) -> Client:
    prefill.add_request(rid, prompt, params)
    (handoff,) = [o.handoff for o in _drain(prefill, rid)]
    remote = RemoteKV("P", handoff.lease_id, float("inf"), handoff.block_ids,
                      handoff.first_token_ids, (None,) * params.n)
    engine.add_remote_request(rid, prompt, params, remote)
    c = Client(rid, prompt, params, owner, list(handoff.first_token_ids))
    c.prefill_lease = handoff.lease_id
    return c


def _drain(engine: LLMEngine, rid: str) -> list:
    outs = []
    while rid in engine.requests:
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def run_with_migrations(prefill, decodes, requests, rng: random.Random, want: int,
                        pulled: dict) -> tuple:
    """Run the requests on A, moving them between A and B at random steps; the clients' outputs
    and the migrations made."""
    clients = {rid: start(prefill, decodes["A"], "A", rid, p, params)
               for rid, p, params in requests}
    made = 0
    while any(c.owner is not None for c in clients.values()):
        for name, engine in decodes.items():
            for o in engine.step():
                c = clients[o.request_id]
                if c.owner != name:  # the source's tokens after the switch: dropped unread
                    continue
                assert o.error is None, o.error
                c.tokens[o.sample_index] += o.new_token_ids
                if o.finish_reason is not None:
                    c.done.add(o.sample_index)
        for c in clients.values():
            if c.owner is not None and len(c.done) == c.params.n:
                c.owner = None
                if c.move is not None:  # finished on the source first: the move is off
                    dst, lease, _ = c.move
                    decodes[dst].abort(c.rid)
                    decodes["B" if dst == "A" else "A"].kv_connector.release(lease)
                    c.move = None
            elif c.move is not None and c.rid in decodes[c.move[0]].migrations.parked:
                dst, lease, sent = c.move  # pulled: switch now (a step boundary)
                src = c.owner
                decodes[src].abort(c.rid)
                decodes[src].kv_connector.release(lease)  # the destination's Release
                decodes[dst].hand_over(c.rid, tuple(tuple(t[n:]) for t, n in
                                                    zip(c.tokens, sent)))
                c.owner, c.move = dst, None
                made += 1
        # Any request not moving may start a move at this step (about one in three do), so
        # that a wave of requests makes many migrations.
        moving = sum(c.move is not None for c in clients.values())
        for c in clients.values():
            if c.owner is None or c.move is not None or made + moving >= want \
                    or rng.random() >= 0.35:
                continue
            src = decodes[c.owner]
            lent = src.lend(c.rid)
            if lent is not None:
                moving += 1
                pulled["with_outputs"] += lent.num_tokens > len(c.prompt)
                pulled["forked"] += c.params.n > 1
                dst = "B" if c.owner == "A" else "A"
                remote = RemoteKV(c.owner, lent.lease_id, float("inf"), lent.block_ids,
                                  tuple(t[0] for t in c.tokens), (None,) * c.params.n,
                                  tuple(tuple(t[1:]) for t in c.tokens), "",
                                  lent.num_tokens, True)
                decodes[dst].add_remote_request(c.rid, c.prompt, c.params, remote)
                c.move = (dst, lent.lease_id, [len(t) for t in c.tokens])
    for c in clients.values():
        assert prefill.kv_connector.release(c.prefill_lease)  # the decode side's Release
    return {rid: c.tokens for rid, c in clients.items()}, made


def test_migrations_at_random_points_are_token_identical(engines):
    offline, prefill, decodes, pulled = engines
    requests = [(f"r{i}", p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(PROMPTS)]
    expected = {rid: [o.token_ids for o in out.outputs] for (rid, _, _), out in zip(
        requests, offline.generate([p for _, p, _ in requests], [q for _, _, q in requests]))}
    rng = random.Random(45)
    made = wave = 0
    while made < MIGRATIONS:
        wave += 1
        got, n = run_with_migrations(prefill, decodes, [(f"{rid}w{wave}", p, q)
                                                        for rid, p, q in requests],
                                     rng, MIGRATIONS - made, pulled)
        made += n
        for rid, _, _ in requests:
            assert got[f"{rid}w{wave}"] == expected[rid], f"{rid} in wave {wave}"
    assert made >= MIGRATIONS
    # The KV that moved includes generated tokens', not only the prompts'.
    assert pulled["migrated"] > 0 and pulled["with_outputs"] > MIGRATIONS // 4
    # n = 2 requests moved by lease too (not only by token replay).
    assert pulled["forked"] > MIGRATIONS // 10
    assert sum(e.migrations.num_lent for e in decodes.values()) >= MIGRATIONS


def test_corrupted_pulls_change_the_outputs(engines):
    """The control: the same migrations with the pulled KV replaced by noise diverge, so the
    identity above rests on the KV that moved (not on a recomputation)."""
    _, prefill, decodes, pulled = engines
    greedy = PARAMS[0]
    requests = [(f"c{i}", p, greedy) for i, p in enumerate(PROMPTS[:6])]
    clean, _ = run_with_migrations(prefill, decodes, requests, random.Random(1), 40, pulled)
    pulled["corrupt"] = True
    try:
        noisy, made = run_with_migrations(prefill, decodes, [(f"n{i}", p, q) for i, (_, p, q)
                                                             in enumerate(requests)],
                                          random.Random(1), 40, pulled)
    finally:
        pulled["corrupt"] = False
    assert made > 0
    assert [noisy[f"n{i}"] for i in range(6)] != [clean[f"c{i}"] for i in range(6)]



def test_a_sample_done_by_its_handover_is_not_scheduled_again(engines):
    """Forked samples drift a step apart after a move (each recomputes its outputs in chunks of
    its own), so a HandOver may bring one sample to its end while the other goes on. That
    sample finishes between steps, as the tokens are recorded; the next step must not give it
    blocks (it did, and they were never freed)."""
    offline, prefill, decodes, _ = engines
    src, dst = decodes["A"], decodes["B"]
    params, prompt = PARAMS[2], PROMPTS[3]
    (out,) = offline.generate([prompt], [params])
    expected = [o.token_ids for o in out.outputs]
    c = start(prefill, src, "A", "h0", prompt, params)
    while min(len(t) for t in c.tokens) < 6:
        for o in src.step():
            c.tokens[o.sample_index] += o.new_token_ids
    lent = src.lend("h0")
    assert lent is not None and lent.num_tokens == len(prompt)  # the prompt's KV, by lease
    sent = [len(t) for t in c.tokens]
    dst.add_remote_request("h0", prompt, params, RemoteKV(
        "A", lent.lease_id, float("inf"), lent.block_ids, tuple(t[0] for t in c.tokens),
        (None,) * params.n, tuple(tuple(t[1:]) for t in c.tokens), "", lent.num_tokens, True))
    while "h0" not in dst.migrations.parked:
        dst.step()
    for o in _drain(src, "h0"):  # the source makes every sample's tokens to the end
        c.tokens[o.sample_index] += o.new_token_ids
    assert c.tokens == expected
    assert src.kv_connector.release(lent.lease_id)  # the destination's Release
    # Sample 0's every token handed over, sample 1's all but its last.
    dst.hand_over("h0", (tuple(c.tokens[0][sent[0]:]), tuple(c.tokens[1][sent[1]:-1])))
    outs = _drain(dst, "h0")
    assert [(o.sample_index, o.new_token_ids) for o in outs if o.new_token_ids] == \
        [(1, expected[1][-1:])]
    assert {o.sample_index for o in outs if o.finish_reason is not None} == {0, 1}
    assert prefill.kv_connector.release(c.prefill_lease)
    assert dst.is_idle() and src.is_idle()


def test_a_moved_requests_tail_runs_as_decode_rows(engines, caplog):
    """At its HandOver a moved request has a tail: the tokens its source made after lending
    its KV, whose KV the destination computes before it samples on. That tail runs as decode
    rows (engine/model_runner.py _as_decode_rows: the decode kernel and CUDA graphs, which
    split a long context between programs), not as a prefill chunk; the output stays the
    offline engine's, and the switch's timing is logged once (engine/migration.py Resumed)."""
    offline, prefill, decodes, _ = engines
    src, dst = decodes["A"], decodes["B"]
    params, prompt = PARAMS[1], PROMPTS[9]  # seeded sampling, a 50-token prompt
    (out,) = offline.generate([prompt], [params])
    c = start(prefill, src, "A", "t0", prompt, params)
    while len(c.tokens[0]) < 5:
        for o in src.step():
            c.tokens[0] += o.new_token_ids
    lent = src.lend("t0")
    assert lent is not None
    sent = len(c.tokens[0])
    dst.add_remote_request("t0", prompt, params, RemoteKV(
        "A", lent.lease_id, float("inf"), lent.block_ids, (c.tokens[0][0],), (None,),
        (tuple(c.tokens[0][1:]),), "", lent.num_tokens, True))
    while "t0" not in dst.migrations.parked:
        dst.step()
    while len(c.tokens[0]) < sent + 6:  # the source decodes on meanwhile
        for o in src.step():
            c.tokens[0] += o.new_token_ids
    src.abort("t0")
    assert src.kv_connector.release(lent.lease_id)  # the destination's Release
    steps: list = []  # (request's new tokens, the step's query lengths) of each step with it
    step_inputs = dst.runner.step_inputs

    def watched(batch, row_token_index):
        inputs = step_inputs(batch, row_token_index)
        steps.extend((n, inputs.query_lens) for s, n in zip(batch.seqs, batch.num_new_tokens)
                     if s.request_id == "t0")
        return inputs

    dst.runner.step_inputs = watched
    try:
        with caplog.at_level("INFO", logger="tandem.engine.llm_engine"):
            dst.hand_over("t0", (tuple(c.tokens[0][sent:]),))
            for o in _drain(dst, "t0"):
                c.tokens[0] += o.new_token_ids
    finally:
        del dst.runner.step_inputs
    assert c.tokens[0] == out.outputs[0].token_ids
    tail, query_lens = steps[0]
    # Its KV held the tokens before the source's last step in flight; the tail is the rest.
    assert tail == len(prompt) + sent + 6 - lent.num_tokens > 6
    assert query_lens == [1] * tail  # decode rows: one per tail token
    (line,) = [r.getMessage() for r in caplog.records if "moved request t0" in r.getMessage()]
    assert f"tail of {tail} tokens as decode rows" in line
    timing = json.loads(line.split("timing=", 1)[1])
    assert 0 < timing["parked"] <= timing["received"] <= timing["applied"] \
        <= timing["scheduled"] <= timing["first_token"]
    assert timing["tail_tokens"] == tail and timing["decode_rows"]
    assert not dst.migrations.resumed
    assert prefill.kv_connector.release(c.prefill_lease)
    assert dst.is_idle() and src.is_idle()
