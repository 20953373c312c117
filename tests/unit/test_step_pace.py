"""A worker's recent step times for routers (runtime/step_pace.py): moving averages over the
engine's step statistics, prompt-token cost from the steps that ran prompt chunks only."""

from __future__ import annotations

import pytest

from tandem.engine.sequence import StepStats
from tandem.runtime.step_pace import StepPace


def step(seconds: float, tokens: int, decodes: int) -> StepStats:
    return StepStats(num_seqs=max(1, decodes), num_tokens=tokens, num_decodes=decodes,
                     num_preempted=0, seconds=seconds)


def test_step_time_and_prompt_token_cost_follow_recent_steps():
    pace = StepPace(alpha=0.5)
    assert (pace.step_seconds, pace.prompt_token_seconds) == (0.0, 0.0)
    pace.observe(step(0.02, 4, 4))  # decodes only: no prompt-token figure
    assert (pace.step_seconds, pace.prompt_token_seconds) == (0.02, 0.0)
    pace.observe(step(0.10, 100, 4))  # a chunk of 96 prompt tokens beside 4 decodes
    assert pace.step_seconds == pytest.approx(0.06)
    assert pace.prompt_token_seconds == pytest.approx(0.001)
    pace.observe(step(0.30, 100, 0))
    assert pace.prompt_token_seconds == pytest.approx(0.002)
    pace.observe(None)  # a failed step
    pace.observe(StepStats(0, 0, 0, 0, 0.5))  # nothing ran
    assert pace.step_seconds == pytest.approx(0.18)
    with pytest.raises(ValueError, match="alpha"):
        StepPace(alpha=0)
