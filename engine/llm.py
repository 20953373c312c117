"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`.

Runs the engine in role `both` in this process and detokenizes outputs, cutting them at stop
strings, with the same incremental detokenizer the router uses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.config import EngineConfig
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.grammar import check_schema
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams, TokenLogprobs
from tandem.engine.sequence import FinishReason, SeqOutput
from tandem.engine.tokenizer import Tokenizer, has_tokenizer
from tandem.errors import InvalidArgument

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs | None] | None = None
    stop_reason: str | None = None  # the stop string that ended it, if one did


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    # params.prompt_logprobs: one per prompt token after the first
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        progress = kwargs.pop("progress", True)
        self._start(EngineConfig(model=model, **kwargs), progress)

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True) -> LLM:
        """An LLM from a whole EngineConfig (runtime/engine_args.py's engine_config builds one
        from the workers' flags)."""
        llm = cls.__new__(cls)
        llm._start(config, progress)
        return llm

    def _start(self, config: EngineConfig, progress: bool) -> None:
        self.config = config
        self.engine = LLMEngine(self.config, progress=progress)
        self.tokenizer = _maybe_tokenizer(self.engine)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidArgument("sampling_params", "needs one entry per prompt")

        states: dict[str, _RequestState] = {}
        order: list[str] = []
        for p in params_list:  # bad schemas refused at once, before any request starts
            if p.response_format is not None:
                check_schema(p.response_format)
        try:
            for prompt, p in zip(prompts, params_list):
                rid = f"llm-{next(self._ids)}"
                ids = self._encode(prompt)
                self.engine.add_request(rid, ids, p)
                states[rid] = _RequestState(rid, ids, p, prompt if isinstance(prompt, str)
                                            else None, self.tokenizer)
                order.append(rid)
            while self.engine.has_work():
                for out in self.engine.step():
                    self._on_output(states[out.request_id], out)
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            raise
        return [states[rid].result() for rid in order]

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks (at TP 1 there is nothing to stop)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt", "must not be empty")
            if self.tokenizer is None:
                raise InvalidArgument("prompt", "this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _on_output(self, st: _RequestState, out: SeqOutput) -> None:
        sample = st.sample(out.sample_index)
        if out.prompt_logprobs is not None:
            st.prompt_logprobs = out.prompt_logprobs
        sample.token_ids.extend(out.new_token_ids)
        if st.params.logprobs is not None:
            sample.logprobs.extend(out.new_logprobs)
        st.num_cached_tokens = out.num_cached_tokens
        det = st.detokenizer(out.sample_index)
        if det is not None and out.new_token_ids and sample.finish_reason is None:
            step = det.push(out.new_token_ids)
            sample.text += step.text_delta
            if step.stopped:
                sample.stop_reason = step.stop_reason
                sample.finish_reason = FinishReason.STOP.value
                self.engine.stop_sequence(st.request_id, out.sample_index)
                return
        if out.finish_reason is not None and sample.finish_reason is None:
            sample.finish_reason = out.finish_reason.value
            if det is not None:
                sample.text += det.flush()


class _RequestState:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 prompt: str | None, tokenizer: Tokenizer | None) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.prompt = prompt
        self.tokenizer = tokenizer
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        self.samples = [CompletionOutput(i, "", [], None, [] if params.logprobs is not None
                                         else None) for i in range(params.n)]
        self._detok: dict[int, IncrementalDetokenizer] = {}

    def sample(self, index: int) -> CompletionOutput:
        return self.samples[index]

    def detokenizer(self, index: int) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        if index not in self._detok:
            self._detok[index] = IncrementalDetokenizer(
                self.tokenizer, self.prompt_ids, self.params.skip_special_tokens,
                self.params.stop)
        return self._detok[index]

    def result(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt_ids, self.samples,
                             self.num_cached_tokens, self.prompt,
                             prompt_logprobs=self.prompt_logprobs)


def _maybe_tokenizer(engine: LLMEngine) -> Tokenizer | None:
    """Dummy-weight benchmark configs may come without tokenizer files."""
    return Tokenizer(engine.model_dir) if has_tokenizer(engine.model_dir) else None
