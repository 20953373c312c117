"""Per-request sampling parameters, validated at construction so a bad field is named before any
KV block is allocated."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidArgument

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token; 0: only the sampled one
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples (hashable, immutable).
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str)
                                               else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.n < 1:
            raise InvalidArgument("n", f"must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise InvalidArgument("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidArgument("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument("top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidArgument("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InvalidArgument("repetition_penalty",
                                  f"must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise InvalidArgument("presence_penalty",
                                  f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise InvalidArgument("frequency_penalty",
                                  f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgument("seed", f"must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument("stop_token_ids", "token ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token under the model's raw distribution (before temperature,
    penalties and truncation), as OpenAI reports it."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    sampled: Logprob
    top: tuple[Logprob, ...] = field(default=())
