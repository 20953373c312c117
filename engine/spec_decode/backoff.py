"""Back-off by acceptance: a sample whose drafts the model rarely keeps stops paying for them.

Every verify of a sample's drafts updates a running average of its acceptance (accepted /
proposed, an exponentially weighted mean that starts at 1, so a new sample speculates at
once). When it falls below `min_acceptance`, the sample sits out `probe_interval` of the
steps it could have speculated in, then proposes again: the probe's verify updates the
average, which either lifts it back over the threshold (speculating resumes) or leaves it
below (another pause). With weight 0.3, four verifies that keep nothing pause a new sample:

    average:  1.0 → 0.70 → 0.49 → 0.34 → 0.24 < 0.3: paused for probe_interval steps

Plain Python, per sample (seq_id); the speculator asks `allows` before proposing and tells
`record` what each verify kept.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT = 0.3  # of the latest verify in the running average


@dataclass
class _State:
    average: float = 1.0
    paused: int = 0  # steps still to sit out


@dataclass
class BackOffCounters:
    num_pauses: int = 0  # times a sample stopped speculating for low acceptance
    num_paused_steps: int = 0  # (sample, step) pairs that sat out


class AcceptanceBackOff:
    def __init__(self, min_acceptance: float, probe_interval: int) -> None:
        self.min_acceptance = min_acceptance
        self.probe_interval = probe_interval
        self.counters = BackOffCounters()
        self._states: dict[int, _State] = {}

    def allows(self, seq_id: int) -> bool:
        """Whether the sample may propose in this step; a paused one counts a step down."""
        st = self._states.get(seq_id)
        if st is None or st.paused == 0:
            return True
        st.paused -= 1
        self.counters.num_paused_steps += 1
        return False

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verify of `proposed` drafts kept `accepted` of them."""
        if proposed == 0 or self.min_acceptance == 0:
            return
        st = self._states.setdefault(seq_id, _State())
        st.average += WEIGHT * (accepted / proposed - st.average)
        if st.average < self.min_acceptance:
            st.paused = self.probe_interval
            self.counters.num_pauses += 1

    def average(self, seq_id: int) -> float:
        st = self._states.get(seq_id)
        return 1.0 if st is None else st.average

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)
