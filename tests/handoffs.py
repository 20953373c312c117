"""Prefill-role engines for tests of a decode engine fed by hand: each prompt prefilled and handed
off, its KV left pinned under a lease in the prefill engine's pool."""

from __future__ import annotations

from tandem.engine.sampling_params import SamplingParams


def prefill_all(prefill, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Request id ("r<i>" for prompts[i]) -> its Handoff, once every prompt is prefilled by
    `prefill` (an LLMEngine of role prefill). The caller releases the leases."""
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, params)
    handoffs = {}
    while prefill.has_work():
        for o in prefill.step():
            if o.handoff is not None:
                handoffs[o.request_id] = o.handoff
    return handoffs


def hand_off_one_by_one(prefill, decode, prompts: list[list[int]], params: SamplingParams,
                        after=lambda: None) -> list[list[list[int]]]:
    """Each prompt prefilled by `prefill`, handed to `decode` (its KV pulled through whatever
    puller the test connected) and decoded to its end, one at a time; the prefill lease
    released after each, then `after()`. Per prompt, its one sample's tokens (as [[tokens]])."""
    from tandem.engine.sequence import RemoteKV

    got = []
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        prefill.add_request(rid, prompt, params)
        (h,) = [o.handoff for o in _run(prefill, rid)]
        decode.add_remote_request(rid, prompt, params, RemoteKV(
            "p", h.lease_id, h.lease_deadline, h.block_ids, h.first_token_ids,
            h.first_logprobs))
        tokens = list(h.first_token_ids)
        for o in _run(decode, rid):
            tokens += o.new_token_ids
        assert prefill.kv_connector.release(h.lease_id)
        got.append([tokens])
        after()
    return got


def _run(engine, rid: str) -> list:
    """Request `rid`'s outputs, stepping `engine` until it is gone."""
    outs = []
    while rid in engine.requests:
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs
