"""A step's sampled tokens while they are still on the device: the model runner returns them
as PendingTokens (on their way to the host) when a pipelined step does not wait for them, and
the next step reads them there through a TokenFill (engine/async_step.py says when and why)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class PendingTokens:
    """A step's sampled tokens: on the device, and on their way to the host. On CUDA the copy
    goes to pinned memory (non_blocking) and an event recorded after it tells when it is done;
    on the CPU everything already happened."""

    def __init__(self, tokens: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        """`stream`: the one the step ran on (the current stream if None; the lookup costs a
        few microseconds of host time a step)."""
        self.device = tokens
        self.event: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)
        else:
            self.host = tokens

    def tolist(self) -> list[int]:
        """Waits for this step's kernels (and only them) to finish."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass
class TokenFill:
    """Placeholders of a step's flattened token ids (dst) and the rows of the previous step's
    sampled tokens (src, of `tokens`, on the device) that replace them."""

    tokens: torch.Tensor
    dst: list[int] = field(default_factory=list)
    src: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.dst)
