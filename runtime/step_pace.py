"""How fast a worker's engine steps lately, for routers (Load.step_seconds,
Load.prompt_token_seconds): moving averages over the engine core's step events.

    step_seconds          one step, whatever it ran: on a decode worker, its inter-token latency
    prompt_token_seconds  seconds / tokens of the steps that ran prompt tokens (chunks): what a
                          prompt token costs there, decode rows riding the same step included

A router weighs a prompt's cost on each candidate with these (router_svc/routing/placement.py).
Exponential averages (weight ALPHA to the newest step): a few dozen steps of memory, nothing kept
per step, and an idle worker keeps its last figures (its next step is as fast as its last).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.engine.sequence import StepStats

ALPHA = 0.1  # the newest step's weight: about the last 20 steps count


class StepPace:
    def __init__(self, alpha: float = ALPHA) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.step_seconds = 0.0  # 0: no step seen yet
        self.prompt_token_seconds = 0.0  # 0: no step with prompt tokens seen yet

    def observe(self, step: StepStats | None) -> None:
        """One engine step's statistics (None: the step failed; ignored)."""
        if step is None or not step.num_seqs or step.seconds <= 0:
            return
        self.step_seconds = self._mix(self.step_seconds, step.seconds)
        if step.num_tokens > step.num_decodes:  # a prompt chunk ran in this step
            self.prompt_token_seconds = self._mix(self.prompt_token_seconds,
                                                  step.seconds / step.num_tokens)

    def _mix(self, old: float, new: float) -> float:
        return new if old == 0 else old + self.alpha * (new - old)
