"""What the client sends and returns, as dataclasses (the *_pb2 messages stay inside)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.client.params import SamplingParams
from tandem.v1 import api_pb2

# Text, token ids, or several prompts (a list of either): sample j of prompt i comes as index
# i * n + j.
Prompt = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]


@dataclass(frozen=True)
class Logprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    sampled: Logprob
    top: tuple[Logprob, ...]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0  # all samples, so far
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class Chunk:
    """One streamed message: new tokens and text of sample `index`, with running usage."""

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None  # on the sample's last chunk: stop | length | abort
    stop_reason: str | None  # the stop string that ended the sample
    usage: Usage
    # prompt_logprobs asked for: prompt tokens after the first, on the first chunk of each
    # prompt's first sample (index i * n for prompt i)
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass
class Sample:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    # prompt_logprobs asked for: on each prompt's first sample (index i * n), its prompt's
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class Completion:
    """A whole answer: every sample, in index order, and the request's usage."""

    request_id: str
    samples: list[Sample]
    usage: Usage

    @property
    def text(self) -> str:
        return self.samples[0].text if self.samples else ""

    @property
    def prompt_logprobs(self) -> list[TokenLogprobs]:
        """The (first) prompt's logprobs; with several prompts, prompt i's are on
        samples[i * n]."""
        return self.samples[0].prompt_logprobs if self.samples else []


@dataclass(frozen=True)
class ModelInfo:
    id: str
    architecture: str
    max_model_len: int
    vocab_size: int
    dtype: str
    block_size: int


def params_with(params: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
    """`params` (default: SamplingParams()) with the fields in `overrides` replaced."""
    return replace(params or SamplingParams(), **overrides)


def generate_request(prompt: Prompt, params: SamplingParams | None, model: str,
                     request_id: str) -> api_pb2.GenerateRequest:
    req = api_pb2.GenerateRequest(request_id=request_id, model=model,
                                  params=(params or SamplingParams()).to_proto())
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and not isinstance(prompt[0], int):
        req.prompts.prompts.extend(api_pb2.Prompt(text=p) if isinstance(p, str) else
                                   api_pb2.Prompt(token_ids=api_pb2.TokenIds(ids=p))
                                   for p in prompt)
    else:
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    return req


def tokenize_request(text: str | None, messages: Sequence[Mapping[str, str]] | None,
                     add_special_tokens: bool) -> api_pb2.TokenizeRequest:
    if (text is None) == (messages is None):
        raise ValueError("give text or messages, not both")
    if messages is not None:
        chat = api_pb2.ChatMessages(messages=[
            api_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
        return api_pb2.TokenizeRequest(chat=chat, add_special_tokens=add_special_tokens)
    return api_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)


def _logprobs(items) -> tuple[TokenLogprobs, ...]:
    return tuple(TokenLogprobs(Logprob(lp.sampled.token_id, lp.sampled.logprob),
                               tuple(Logprob(t.token_id, t.logprob) for t in lp.top))
                 for lp in items)


def chunk_from_proto(r: api_pb2.GenerateResponse) -> Chunk:
    return Chunk(
        request_id=r.request_id, index=r.index, token_ids=tuple(r.token_ids), text=r.text,
        logprobs=_logprobs(r.logprobs),
        finish_reason=r.finish_reason or None, stop_reason=r.stop_reason or None,
        usage=Usage(r.usage.prompt_tokens, r.usage.completion_tokens,
                    r.usage.cached_prompt_tokens),
        prompt_logprobs=_logprobs(r.prompt_logprobs))


def model_from_proto(m: api_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(m.id, m.architecture, m.max_model_len, m.vocab_size, m.dtype, m.block_size)


class Collector:
    """Chunks -> Completion."""

    def __init__(self) -> None:
        self.request_id = ""
        self.samples: dict[int, Sample] = {}
        self.usage = Usage()

    def add(self, chunks: Iterable[Chunk] | Chunk) -> None:
        for c in [chunks] if isinstance(chunks, Chunk) else chunks:
            self.request_id = c.request_id
            s = self.samples.setdefault(c.index, Sample(c.index))
            s.text += c.text
            s.token_ids += c.token_ids
            s.logprobs += c.logprobs
            s.finish_reason = c.finish_reason or s.finish_reason
            s.stop_reason = c.stop_reason or s.stop_reason
            self.usage = c.usage
            s.prompt_logprobs += c.prompt_logprobs

    def result(self) -> Completion:
        return Completion(self.request_id, [self.samples[i] for i in sorted(self.samples)],
                          self.usage)
