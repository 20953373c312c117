"""OpenAI response objects from the Frontend's steps: one endpoint's streamed chunks and its
final object (completions and chat completions), with usage and logprobs as OpenAI shapes
them."""

from __future__ import annotations

import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from engine.sampling_params import TokenLogprobs
from engine.tokenizer import Tokenizer
from router_svc.chat_output import ChatChoice, ChatOutputSpec
from router_svc.frontend import Delta, Usage

Step = tuple[list[Delta], Usage]


@dataclass(frozen=True)
class StreamExtras:
    """What a request asked of its response objects beyond the choices: usage in every chunk
    (stream_options.continuous_usage_stats), an `obfuscation` field in each chunk
    (stream_options.include_obfuscation), and the service tier it was served at (echoed when
    the request named one: there is one tier, "default")."""

    continuous_usage: bool = False
    obfuscation: bool = False
    service_tier: str | None = None


def _usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


class Shaper(ABC):
    """Turns Frontend steps into one endpoint's chunks and final object. Keeps per-sample text,
    finish reasons and logprobs for the non-streaming answer."""

    object: str
    chunk_object: str

    def __init__(self, tok: Tokenizer, id_: str, model: str, n: int, want_logprobs: bool,
                 stream: bool, include_usage: bool, options: StreamExtras | None = None
                 ) -> None:
        self.tok, self.id, self.model, self.n = tok, id_, model, n
        self.want_logprobs, self.stream = want_logprobs, stream
        self.include_usage = stream and include_usage
        self.extras = options or StreamExtras()
        self.created = int(time.time())
        self.text = [""] * n
        self.finish: list[str | None] = [None] * n
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]
        self.offsets: list[list[int]] = [[] for _ in range(n)]  # per token, in self.text
        self.usage = Usage()

    def _chunk(self, choices: list[dict]) -> dict:
        c = {"id": self.id, "object": self.chunk_object, "created": self.created,
             "model": self.model, "choices": choices}
        if self.extras.continuous_usage:  # the running totals, in every chunk
            c["usage"] = _usage(self.usage)
        elif self.include_usage:
            c["usage"] = None
        if self.extras.service_tier is not None:
            c["service_tier"] = self.extras.service_tier
        if self.extras.obfuscation:  # random length: a chunk's size says less of its text
            c["obfuscation"] = secrets.token_urlsafe(16)[:secrets.randbelow(16) + 1]
        return c

    def add(self, step: Step) -> list[dict]:
        """Remembers one step for the final object; when streaming, its chunks."""
        deltas, self.usage = step
        chunks = []
        for d in deltas:
            i = d.index
            self.text[i] += d.text
            lps = [lp for lp in d.logprobs if lp is not None] if self.want_logprobs else []
            offsets = self._offsets(lps, len(self.text[i]) - len(d.text), len(self.text[i]))
            self.logprobs[i] += lps
            self.offsets[i] += offsets
            choice = self.step_choice(d, lps, offsets)
            if self.stream and choice is not None:
                chunks.append(self._chunk([choice]))
        return chunks

    def step_choice(self, d: Delta, lps: list[TokenLogprobs], offsets: list[int]) -> dict | None:
        """Takes one sample's delta; its entry in a streamed chunk, None when it adds none."""
        if d.finish_reason is not None:
            self.finish[d.index] = d.finish_reason
        if d.text or d.finish_reason is not None or lps:
            return self.choice_delta(d, lps, offsets)
        return None

    def _offsets(self, lps: list[TokenLogprobs], start: int, end: int) -> list[int]:
        """Where each token starts in the sample's text: its token text laid end to end from
        where this step's text starts, kept inside it (skipped special tokens, bytes held back
        for a whole character and text past a stop string have no place of their own)."""
        out = []
        for lp in lps:
            out.append(min(start, end))
            start += len(self.tok.token_text(lp.sampled.token_id))
        return out

    def usage_chunk(self) -> dict:
        return {**self._chunk([]), "usage": _usage(self.usage)}

    def start(self) -> list[dict]:
        return []

    def final(self) -> dict:
        out = {"id": self.id, "object": self.object, "created": self.created,
               "model": self.model, "choices": [self.choice(i) for i in range(self.n)],
               "usage": _usage(self.usage)}
        if self.extras.service_tier is not None:
            out["service_tier"] = self.extras.service_tier
        return out

    @abstractmethod
    def choice_delta(self, d: Delta, lps: list[TokenLogprobs], offsets: list[int]) -> dict:
        """One choice's entry in a streamed chunk."""

    @abstractmethod
    def choice(self, i: int) -> dict:
        """One choice of the final (non-streamed) response."""


class CompletionShaper(Shaper):
    object = chunk_object = "text_completion"

    def __init__(self, *args, echo: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo  # the prompt's text, written before each choice's (echo=true)

    def start(self) -> list[dict]:
        if not self.echo:
            return []
        return [self._chunk([{"index": i, "text": self.echo, "logprobs": None,
                              "finish_reason": None}]) for i in range(self.n)]

    def _logprobs(self, lps: list[TokenLogprobs], offsets: list[int]) -> dict | None:
        """Legacy completions logprobs: top_logprobs holds the top N and the sampled token."""
        if not self.want_logprobs:
            return None
        tokens = [self.tok.token_text(lp.sampled.token_id) for lp in lps]
        tops = []
        for text, lp in zip(tokens, lps, strict=True):
            top: dict[str, float] = {}
            for t in lp.top:  # most likely first; ids that read the same keep the likelier
                top.setdefault(self.tok.token_text(t.token_id), t.logprob)
            top.setdefault(text, lp.sampled.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [lp.sampled.logprob for lp in lps],
                "top_logprobs": tops, "text_offset": offsets}

    def choice_delta(self, d: Delta, lps: list[TokenLogprobs], offsets: list[int]) -> dict:
        return {"index": d.index, "text": d.text, "logprobs": self._logprobs(lps, offsets),
                "finish_reason": d.finish_reason}

    def choice(self, i: int) -> dict:
        return {"index": i, "text": self.echo + self.text[i],
                "logprobs": self._logprobs(self.logprobs[i], self.offsets[i]),
                "finish_reason": self.finish[i]}


class ChatShaper(Shaper):
    """Chat: each choice's text goes through its ChatChoice (reasoning, tool calls)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, output: ChatOutputSpec | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.choices = [ChatChoice(output or ChatOutputSpec()) for _ in range(self.n)]

    def step_choice(self, d: Delta, lps: list[TokenLogprobs], offsets: list[int]) -> dict | None:
        choice = self.choices[d.index]
        md = choice.feed(d.text, d.token_ids)
        finish = d.finish_reason
        if finish is not None:
            end = choice.finish()
            md.content += end.content
            md.reasoning += end.reasoning
            md.tool_calls = end.tool_calls
            if end.tool_calls and finish == "stop":
                finish = "tool_calls"
            self.finish[d.index] = finish
        if not (md.content or md.reasoning or md.tool_calls or finish is not None or lps):
            return None
        delta: dict = {}
        if md.reasoning:
            delta["reasoning_content"] = md.reasoning
        if md.content:
            delta["content"] = md.content
        if md.tool_calls:
            delta["tool_calls"] = [c.openai(k) for k, c in enumerate(md.tool_calls)]
        return {"index": d.index, "delta": delta, "logprobs": self._logprobs(lps),
                "finish_reason": finish}

    def _entry(self, token_id: int, logprob: float) -> dict:
        # bytes: the token's own (part of a character, for a byte token), not its text's.
        return {"token": self.tok.token_text(token_id), "logprob": logprob,
                "bytes": list(self.tok.token_bytes(token_id))}

    def _logprobs(self, lps: list[TokenLogprobs]) -> dict | None:
        if not self.want_logprobs:
            return None
        return {"content": [{**self._entry(lp.sampled.token_id, lp.sampled.logprob),
                             "top_logprobs": [self._entry(t.token_id, t.logprob)
                                              for t in lp.top]}
                            for lp in lps], "refusal": None}

    def start(self) -> list[dict]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]) for i in range(self.n)]

    def choice_delta(self, d: Delta, lps: list[TokenLogprobs], offsets: list[int]) -> dict:
        raise NotImplementedError("ChatShaper.step_choice builds its deltas")

    def choice(self, i: int) -> dict:
        return {"index": i, "message": self.choices[i].message(),
                "logprobs": self._logprobs(self.logprobs[i]), "finish_reason": self.finish[i]}
