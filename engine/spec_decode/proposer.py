"""The proposer interface: what every way of guessing draft tokens implements.

A proposer sees the running sequences that may speculate this step and how many tokens each
may take, and answers with up to that many draft tokens per sequence (fewer, or none, when it
has no good guess: an empty draft costs nothing). Drafts are point guesses (one token per
position, no distribution): the verify step then needs nothing from the proposer but the
tokens (engine/spec_decode/speculator.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from tandem.engine.sequence import Sequence


@dataclass
class ProposeInput:
    """One step's proposal request. `hidden_states`: the target model's last hidden state of
    each sequence (row i for seqs[i]) where the runner provides it, for proposers that read
    them (EAGLE-style heads); None today."""

    seqs: list[Sequence]
    max_tokens: list[int]  # per sequence, >= 1
    hidden_states: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, inp: ProposeInput) -> list[list[int]]:
        """Draft tokens per sequence, at most inp.max_tokens[i] for seqs[i]; they continue
        seqs[i].token_ids."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: drop what the proposer keeps for it."""

    # Optional: `expects_draft(seqs) -> bool`, asked while a pipelined step is in flight (the
    # sequences' last tokens may be PLACEHOLDERs) with the sequences that may speculate:
    # whether one of them is expected to get a draft once its token is known. Without it, a
    # draft always may come, and the step in flight is resolved for it
    # (engine/spec_decode/speculator.py Speculator.expects_draft).
