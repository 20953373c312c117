"""Back-off by acceptance: a sample whose drafts the model rarely keeps stops paying for them.

Every verify of a sample's drafts updates a running average of its acceptance (accepted /
proposed, an exponentially weighted mean that starts at 1, so a new sample speculates at
once). When it falls below `min_acceptance`, the sample sits out a pause of the steps it could
have speculated in, then proposes again: the probe's verify updates the average, which either
lifts it back over the threshold (speculating resumes, and the next pause is short again) or
leaves it below (another pause, twice as long, up to MAX_DOUBLINGS doublings). With weight 0.3,
four verifies that keep nothing pause a new sample:

    average:  1.0 → 0.70 → 0.49 → 0.34 → 0.24 < 0.3: paused for probe_interval steps
    probes:   0.17 → paused 2 × probe_interval, 0.12 → 4 ×, 0.08 → 8 ×, then 8 × each time

A verify makes its whole step synchronous (engine/llm_engine.py), every sample's, so a pause
ends on a multiple of probe_interval: samples of one batch paused at different steps probe in
the same steps, and pay for one synchronous step together rather than one each.

Plain Python, per sample (seq_id); the speculator ticks it every step, asks `allows` before
proposing and tells `record` what each verify kept. A step in which every running sample is
paused (or opted out) is not a speculating step at all: a pipelined step in flight is not
resolved for it (engine/llm_engine.py `_speculate`).
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT = 0.3  # of the latest verify in the running average
# A probe that fails doubles the pause, at most this many times (probe_interval × 8: 128
# steps by default), so a sample that starts quoting its input late still gets to speculate.
MAX_DOUBLINGS = 3


@dataclass
class _State:
    average: float = 1.0
    resume_at: int = 0  # the first step it may propose in again
    failures: int = 0  # pauses in a row, no verify above the threshold between them


@dataclass
class BackOffCounters:
    num_pauses: int = 0  # times a sample stopped speculating for low acceptance
    num_paused_steps: int = 0  # (sample, step) pairs that sat out


class AcceptanceBackOff:
    """Steps are counted by `tick`, once at the start of every engine step; a pause holds for
    the steps after the verify that caused it, whatever the sample did in them (so a pipelined
    step that is not resolved for drafts counts as well)."""

    def __init__(self, min_acceptance: float, probe_interval: int) -> None:
        self.min_acceptance = min_acceptance
        self.probe_interval = probe_interval
        self.counters = BackOffCounters()
        self.step = 0
        self._states: dict[int, _State] = {}

    def tick(self) -> None:
        self.step += 1

    def allows(self, seq_id: int) -> bool:
        """Whether the sample may propose in this step."""
        st = self._states.get(seq_id)
        return st is None or st.resume_at <= self.step

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verify of `proposed` drafts in this step kept `accepted` of them."""
        if proposed == 0 or self.min_acceptance == 0:
            return
        st = self._states.setdefault(seq_id, _State())
        st.average += WEIGHT * (accepted / proposed - st.average)
        if st.average >= self.min_acceptance:
            st.failures = 0
            return
        pause = self.probe_interval << min(st.failures, MAX_DOUBLINGS)
        st.failures += 1
        # Resume on the grid of probe_interval, at least `pause` steps after this one.
        grid = self.probe_interval
        st.resume_at = -(-(self.step + 1 + pause) // grid) * grid
        self.counters.num_pauses += 1

    def average(self, seq_id: int) -> float:
        st = self._states.get(seq_id)
        return 1.0 if st is None else st.average

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)
