"""Sampling on the device: penalties, logit bias, min_tokens, the grammar's token mask, then
temperature, top-k, top-p, min-p, then the exponential race (argmax of p / E with E ~ Exp(1)),
which draws from p exactly. Logprobs are those of the raw logits, before all of it.

A seeded row draws its noise from a generator seeded by (seed, sample index, output position),
so its tokens do not depend on what else is in the batch, or on which worker samples it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.engine.sampling_params import Logprob, SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from tandem.engine.grammar import GrammarState

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, sample_index: int, position: int) -> int:
    """splitmix64 over the three ints: a stable, well-spread generator seed."""
    x = (seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@dataclass(slots=True)
class SampleRow:
    """One row to sample: the params, the sample index and the output position it fills, and
    the tokens penalties look at."""

    params: SamplingParams
    sample_index: int
    position: int  # index among the outputs of this sample (0 = first generated token)
    prompt_token_ids: list[int] | None = None  # only when penalties apply
    output_token_ids: list[int] | None = None
    grammar: GrammarState | None = None  # the sample's structured-output matcher


def _argmax_only(r: SampleRow) -> bool:
    """Whether row r's token is its raw logits' argmax: greedy, nothing that changes the
    logits (penalties, logit_bias, min_tokens, a grammar), no logprobs."""
    p = r.params
    return (p.greedy and r.grammar is None and p.logprobs is None and not p.has_penalties
            and not p.logit_bias and p.min_tokens <= r.position)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # Logits of rows asked for beyond the sampled ones (prompt logprobs), on the device.
    extra_logits: torch.Tensor | None = None


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device,
                 eos_token_ids: Iterable[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = sorted(eos_token_ids)  # held back by min_tokens

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow],
                 greedy: torch.Tensor | None = None) -> SamplerOutput:
        """logits: float32 [len(rows), vocab] (rows of one sequence may repeat for n > 1);
        greedy: their argmax when already computed (the decode CUDA graph does)."""
        tokens, raw_logprobs = self.sample(logits, rows, greedy)
        token_list = tokens.tolist()  # the host waits for the device here
        return SamplerOutput(token_list, self._logprobs(raw_logprobs, token_list, rows))

    def sample(self, logits: torch.Tensor, rows: list[SampleRow],
               greedy: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled tokens (int64 [len(rows)], on the device) and, when a row asks for
        logprobs, the raw log-softmax. Only kernel launches: nothing here waits for the device
        (every decision is taken from the rows' params on the host), unless a row has a
        grammar (its mask is filled on the host)."""
        if greedy is not None and all(map(_argmax_only, rows)):  # a step's usual case
            return greedy, None
        if logits.shape[1] != self.vocab_size:  # a padded LM head (a slice costs µs)
            logits = logits[:, :self.vocab_size]
        raw_logits = logits
        # The grammar's mask first (host work: it overlaps the forward pass still running on
        # the device), applied after the other processors.
        bitmask, masked_rows, grammar_vocab = self._fill_bitmask(rows)
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if any(r.params.has_penalties for r in rows):
            logits = self._apply_penalties(logits.clone(), rows)
        if any(r.params.logit_bias or r.params.min_tokens > r.position for r in rows):
            logits = self._apply_bias(logits.clone() if logits is raw_logits else logits, rows)
        if bitmask is not None:
            from tandem.engine.grammar import apply_bitmask  # noqa: PLC0415 - xgrammar, when used

            logits = logits.clone() if logits is raw_logits else logits
            apply_bitmask(logits, bitmask, masked_rows, grammar_vocab)

        if all(r.params.greedy for r in rows):
            processed = logits is not raw_logits
            tokens = greedy if greedy is not None and not processed else logits.argmax(-1)
        else:
            tokens = self._sample(logits, rows)
        return tokens, raw_logprobs

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":  # a pinned source: the copy never waits for the device
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
        sub = logits[idx]
        vocab = sub.shape[1]
        out_counts = torch.zeros_like(sub)
        seen = torch.zeros_like(sub, dtype=torch.bool)
        for j, i in enumerate(idx):
            out_ids = self._tensor(rows[i].output_token_ids or [], torch.long)
            out_ids = out_ids[out_ids < vocab]
            out_counts[j].index_add_(0, out_ids, torch.ones_like(out_ids, dtype=sub.dtype))
            prompt_ids = self._tensor(rows[i].prompt_token_ids or [], torch.long)
            seen[j, prompt_ids[prompt_ids < vocab]] = True
        seen |= out_counts > 0
        rep = self._tensor([rows[i].params.repetition_penalty for i in idx], sub.dtype)[:, None]
        pres = self._tensor([rows[i].params.presence_penalty for i in idx], sub.dtype)[:, None]
        freq = self._tensor([rows[i].params.frequency_penalty for i in idx], sub.dtype)[:, None]
        # Repetition (over prompt and output, as Hugging Face and vLLM do): shrink the logit.
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        # Presence and frequency (OpenAI's definition, over the output only).
        sub = sub - pres * (out_counts > 0) - freq * out_counts
        logits[idx] = sub
        return logits

    def _fill_bitmask(self, rows: list[SampleRow]
                      ) -> tuple[torch.Tensor | None, list[int], int]:
        """The allowed tokens of every row with a grammar, one bit per token id of the
        grammar's vocabulary (CPU int32), the rows, and that vocabulary's size (the logits past
        it are masked whole)."""
        masked = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not masked:
            return None, masked, self.vocab_size
        from tandem.engine.grammar import bitmask_width, fill_bitmask  # noqa: PLC0415 - xgrammar

        states = [rows[i].grammar for i in masked]
        vocab = states[0].vocab_size  # type: ignore[union-attr]
        bitmask = torch.full((len(rows), bitmask_width(vocab)), -1, dtype=torch.int32,
                             pin_memory=self.device.type == "cuda")
        fill_bitmask(states, bitmask, masked, self.eos_token_ids)  # type: ignore[arg-type]
        return bitmask, masked, vocab

    def _apply_bias(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """logit_bias adds to its tokens' logits; while a sample has fewer than min_tokens
        outputs, its EOS and stop token ids are held back (a row with a grammar excepted: the
        grammar decides when the output may end)."""
        vocab = logits.shape[1]
        r_idx: list[int] = []
        t_idx: list[int] = []
        vals: list[float] = []
        for i, r in enumerate(rows):
            p = r.params
            for tok, b in p.logit_bias:
                if tok < vocab:
                    r_idx.append(i)
                    t_idx.append(tok)
                    vals.append(b)
            if p.min_tokens > r.position and r.grammar is None:
                for tok in (*self.eos_token_ids, *p.stop_token_ids):
                    if tok < vocab:
                        r_idx.append(i)
                        t_idx.append(tok)
                        vals.append(float("-inf"))
        if r_idx:
            logits.index_put_((self._tensor(r_idx, torch.long), self._tensor(t_idx, torch.long)),
                              self._tensor(vals, logits.dtype), accumulate=True)
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        temps = self._tensor([r.params.temperature or 1.0 for r in rows], logits.dtype)
        probs = self.filtered_probs(
            logits / temps[:, None],
            self._tensor([r.params.top_k for r in rows], torch.long),
            self._tensor([r.params.top_p for r in rows], logits.dtype),
            self._tensor([r.params.min_p for r in rows], logits.dtype),
            sort=any(r.params.top_k > 0 or r.params.top_p < 1 for r in rows),
            min_p_on=any(r.params.min_p > 0 for r in rows))
        noise = torch.empty_like(probs).exponential_()
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                gen = torch.Generator(device=logits.device)
                gen.manual_seed(mix_seed(r.params.seed, r.sample_index, r.position))
                noise[i].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = self._tensor([r.params.greedy for r in rows], torch.bool)
        return torch.where(is_greedy, greedy, sampled)

    @staticmethod
    def filtered_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor, sort: bool | None = None,
                       min_p_on: bool | None = None) -> torch.Tensor:
        """Probabilities after top-k (0 = off), top-p (1 = off) and min-p (0 = off); tokens
        outside the allowed set get exactly 0. The most likely token always survives.
        `sort` (some row has top-k or top-p) and `min_p_on` (some row has min-p): what the
        caller knows on the host; None reads them from the tensors (a device sync each)."""
        vocab = logits.shape[-1]
        if sort is None:
            sort = bool((top_k > 0).any()) or bool((top_p < 1).any())
        if min_p_on is None:
            min_p_on = bool((min_p > 0).any())
        if sort:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            rank = torch.arange(vocab, device=logits.device)[None, :]
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)[:, None]
            drop = rank >= k
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
            # before it already reaches top_p.
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= (before >= top_p[:, None]) & (rank > 0)
            mask = torch.empty_like(drop).scatter_(-1, order, drop)
            logits = logits.masked_fill(mask, float("-inf"))
        probs = logits.softmax(dim=-1)
        if min_p_on:
            top = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < min_p[:, None] * top, 0.0)
        return probs

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int],
                  rows: list[SampleRow]) -> list[TokenLogprobs | None]:
        if raw is None:
            return [None] * len(rows)
        n_top = max(r.params.logprobs or 0 for r in rows)
        sampled = raw.gather(1, torch.tensor(tokens, device=raw.device)[:, None]).squeeze(1)
        sampled = sampled.tolist()
        if n_top:
            top_vals, top_ids = raw.topk(n_top, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        out: list[TokenLogprobs | None] = []
        for i, r in enumerate(rows):
            if r.params.logprobs is None:
                out.append(None)
                continue
            k = r.params.logprobs
            top = tuple(Logprob(t, v) for t, v in zip(top_ids[i][:k], top_vals[i][:k])) if k else ()
            out.append(TokenLogprobs(Logprob(tokens[i], sampled[i]), top))
        return out
