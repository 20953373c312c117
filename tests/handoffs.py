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
