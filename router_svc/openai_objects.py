"""OpenAI response objects from the Frontend's steps: one endpoint's streamed chunks and its
final object (completions and chat completions), with usage and logprobs as OpenAI shapes
them."""

from __future__ import annotations

import json
import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from tandem.engine.sampling_params import TokenLogprobs
from tandem.engine.tokenizer import Tokenizer
from tandem.router_svc.chat_output import ChatChoice, ChatOutputSpec
from tandem.router_svc.frontend import Delta, Usage
from tandem.router_svc.http_errors import ApiError

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
    """Turns Frontend steps into one endpoint's streamed events and final object: what the HTTP
    layer (router_svc/http_api.py) calls. ChoiceShaper serves the endpoints whose answer is a
    list of choices (completions, chat); ResponsesShaper (responses_api.py) the Responses API."""

    @abstractmethod
    def start(self) -> list[dict]:
        """The events before the first step."""

    @abstractmethod
    def add(self, step: Step) -> list[dict]:
        """Remembers one step for the final object; when streaming, its events."""

    @abstractmethod
    def end(self) -> list[dict | str]:
        """The events after the last step."""

    @abstractmethod
    def failed(self, error: ApiError, ended: bool = False) -> list[dict | str]:
        """The events of a stream that failed mid-way (`ended`: the server ended it)."""

    @abstractmethod
    def final(self) -> dict:
        """The non-streamed answer."""

    @staticmethod
    def sse(obj: dict | str) -> str:
        """One event as server-sent events write it."""
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class ChoiceShaper(Shaper):
    """Completions and chat: per-sample chunks ("choices") while streaming, and the per-sample
    text, finish reasons and logprobs kept for the non-streaming answer."""

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

    @abstractmethod
    def step_choice(self, d: Delta, lps: list[TokenLogprobs], offsets: list[int]) -> dict | None:
        """Takes one sample's delta (its finish reason into self.finish); its entry in a
        streamed chunk, None when it adds none."""

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

    def end(self) -> list[dict | str]:
        """The usage chunk when asked for, then [DONE]."""
        return [*([self.usage_chunk()] if self.include_usage else []), "[DONE]"]

    def failed(self, error: ApiError, ended: bool = False) -> list[dict | str]:
        return [error.body(), *(["[DONE]"] if ended else [])]

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
    def choice(self, i: int) -> dict:
        """One choice of the final (non-streamed) response."""


class CompletionShaper(ChoiceShaper):
    """Completions, of one prompt or several (choice i is prompt i // per_prompt's sample
    i % per_prompt). echo: each prompt's text before its choices'; with logprobs, its tokens
    lead the choice's logprobs (the first with none: nothing comes before it), from the prompt
    logprobs the request then asks for. prompt_logprobs (vLLM's): per choice, in vLLM's shape.
    Streaming with both echo and logprobs, a prompt's echo waits for its logprobs (they come
    with its first tokens)."""

    object = chunk_object = "text_completion"

    def __init__(self, *args, echo: list[str] | None = None,
                 prompts: list[list[int]] | None = None, per_prompt: int = 0,
                 prompt_logprobs: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.per_prompt = per_prompt or self.n
        self.prompts = prompts or [[]] * (self.n // self.per_prompt)
        self.echo = echo or [""] * len(self.prompts)  # each prompt's text (echo=true)
        self.want_prompt_logprobs = prompt_logprobs
        self.prompt_lps: dict[int, list[TokenLogprobs]] = {}  # per prompt
        self.echo_waits = any(self.echo) and self.want_logprobs

    def _prompt_of(self, choice: int) -> int:
        return choice // self.per_prompt

    def start(self) -> list[dict]:
        if not any(self.echo) or self.echo_waits:
            return []
        return [self._echo_chunk(i) for i in range(self.n)]

    def _echo_chunk(self, i: int) -> dict:
        return self._chunk([{"index": i, "text": self.echo[self._prompt_of(i)],
                             "logprobs": self._echo_logprobs(self._prompt_of(i)),
                             "finish_reason": None}])

    def add(self, step: Step) -> list[dict]:
        deltas, _ = step
        chunks = []
        for d in deltas:
            p = self._prompt_of(d.index)
            if d.prompt_logprobs is not None and p not in self.prompt_lps:
                self.prompt_lps[p] = d.prompt_logprobs
                if self.echo_waits and self.stream:  # this prompt's echo, now with its logprobs
                    chunks += [self._echo_chunk(i) for i in range(p * self.per_prompt,
                                                                  (p + 1) * self.per_prompt)]
        return chunks + super().add(step)

    def _echo_logprobs(self, p: int) -> dict | None:
        """Prompt p's tokens in the legacy logprobs shape (offsets within its echo)."""
        if not self.want_logprobs:
            return None
        lps = self.prompt_lps.get(p, [])
        tokens = [self.tok.token_text(t) for t in self.prompts[p]]
        offsets, at = [], 0
        for text in tokens:
            offsets.append(min(at, len(self.echo[p])))
            at += len(text)
        return {"tokens": tokens, "token_logprobs": [None, *(lp.sampled.logprob for lp in lps)],
                "top_logprobs": [None, *(self._top(lp) for lp in lps)], "text_offset": offsets}

    def _top(self, lp: TokenLogprobs) -> dict[str, float]:
        top: dict[str, float] = {}
        for t in lp.top:  # most likely first; ids that read the same keep the likelier
            top.setdefault(self.tok.token_text(t.token_id), t.logprob)
        top.setdefault(self.tok.token_text(lp.sampled.token_id), lp.sampled.logprob)
        return top

    def _logprobs(self, i: int, lps: list[TokenLogprobs], offsets: list[int]) -> dict | None:
        """Legacy completions logprobs: top_logprobs holds the top N and the sampled token."""
        if not self.want_logprobs:
            return None
        shift = len(self.echo[self._prompt_of(i)])  # offsets count from the whole text's start
        return {"tokens": [self.tok.token_text(lp.sampled.token_id) for lp in lps],
                "token_logprobs": [lp.sampled.logprob for lp in lps],
                "top_logprobs": [self._top(lp) for lp in lps],
                "text_offset": [o + shift for o in offsets]}

    def step_choice(self, d: Delta, lps: list[TokenLogprobs], offsets: list[int]) -> dict | None:
        if d.finish_reason is not None:
            self.finish[d.index] = d.finish_reason
        if not (d.text or d.finish_reason is not None or lps):
            return None
        out = {"index": d.index, "text": d.text, "logprobs": self._logprobs(d.index, lps, offsets),
               "finish_reason": d.finish_reason}
        if self.want_prompt_logprobs and d.prompt_logprobs is not None:
            out["prompt_logprobs"] = vllm_prompt_logprobs(
                self.tok, self.prompts[self._prompt_of(d.index)], d.prompt_logprobs)
        return out

    def choice(self, i: int) -> dict:
        p = self._prompt_of(i)
        logprobs = self._logprobs(i, self.logprobs[i], self.offsets[i])
        if logprobs is not None and self.echo[p]:
            head = self._echo_logprobs(p)
            logprobs = {k: head[k] + logprobs[k] for k in logprobs}
        out = {"index": i, "text": self.echo[p] + self.text[i], "logprobs": logprobs,
               "finish_reason": self.finish[i]}
        if self.want_prompt_logprobs:
            out["prompt_logprobs"] = vllm_prompt_logprobs(self.tok, self.prompts[p],
                                                          self.prompt_lps.get(p, []))
        return out


def vllm_prompt_logprobs(tok: Tokenizer | None, prompt: list[int],
                         lps: list[TokenLogprobs]) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token {token id:
    {logprob, rank, decoded_token}}, the prompt's own token first, then the top N (rank: its
    place among them; null for a prompt token not among them)."""
    out: list[dict | None] = [None]
    for lp in lps:
        ranks = {t.token_id: r for r, t in enumerate(lp.top, 1)}
        entry = {}
        for item in (lp.sampled, *lp.top):
            entry.setdefault(str(item.token_id), {
                "logprob": item.logprob, "rank": ranks.get(item.token_id),
                "decoded_token": tok.token_text(item.token_id) if tok is not None else None})
        out.append(entry)
    return out


class ChatShaper(ChoiceShaper):
    """Chat: each choice's text goes through its ChatChoice (reasoning, tool calls)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, output: ChatOutputSpec | None = None, prompt: list[int] = (),
                 prompt_logprobs: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.choices = [ChatChoice(output or ChatOutputSpec()) for _ in range(self.n)]
        self.prompt = list(prompt)
        self.want_prompt_logprobs = prompt_logprobs  # vLLM's, at the response's top level
        self.prompt_lps: list[TokenLogprobs] | None = None

    def add(self, step: Step) -> list[dict]:
        deltas, _ = step
        first = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
        chunks = []
        if first is not None and self.prompt_lps is None:
            self.prompt_lps = first
            if self.stream and self.want_prompt_logprobs:
                chunks.append({**self._chunk([]), "prompt_logprobs": self._prompt_logprobs()})
        return chunks + super().add(step)

    def _prompt_logprobs(self) -> list[dict | None]:
        return vllm_prompt_logprobs(self.tok, self.prompt, self.prompt_lps or [])

    def final(self) -> dict:
        out = super().final()
        if self.want_prompt_logprobs:
            out["prompt_logprobs"] = self._prompt_logprobs()
        return out

    def step_choice(self, d: Delta, lps: list[TokenLogprobs], offsets: list[int]) -> dict | None:
        choice = self.choices[d.index]
        md = choice.feed(d.text, d.token_ids)
        finish = d.finish_reason
        if finish is not None:
            end = choice.finish()
            md.content += end.content
            md.reasoning += end.reasoning
            md.call_deltas += end.call_deltas
            if end.tool_calls and finish == "stop":
                finish = "tool_calls"
            self.finish[d.index] = finish
        if not (md.content or md.reasoning or md.call_deltas or finish is not None or lps):
            return None
        delta: dict = {}
        if md.reasoning:
            delta["reasoning_content"] = md.reasoning
        if md.content:
            delta["content"] = md.content
        if md.call_deltas:
            delta["tool_calls"] = md.call_deltas
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

    def choice(self, i: int) -> dict:
        return {"index": i, "message": self.choices[i].message(),
                "logprobs": self._logprobs(self.logprobs[i]), "finish_reason": self.finish[i]}
