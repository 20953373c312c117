"""Prompt logprobs: the log-probability of each prompt token given the tokens before it (and
the top N there), computed from the logits of the prompt's own positions while it is prefilled.

    prompt:       t0   t1   t2   t3        a chunk computes positions [start, end)
    logits at:    p0   p1   p2   (p3: the first output's, sampled as usual)
    gives:        t1   t2   t3   -> seq.prompt_logprobs, in prompt order, once each

The positions ride along with the step's sampled rows (one forward pass, more rows of logits).
Sequences that ask for them are prefilled whole (no prefix-cache hits: a cached block's logits
were never kept) and never run pipelined; a recomputed prefill (preemption) adds nothing new.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.engine.sampling_params import Logprob, TokenLogprobs
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence


@dataclass
class PromptRows:
    """The flattened token rows of one step whose logits give prompt logprobs."""

    seqs: list[Sequence] = field(default_factory=list)
    token_index: list[int] = field(default_factory=list)  # rows in the step's flattened tokens
    next_tokens: list[int] = field(default_factory=list)  # the prompt token each one predicts


def wanted(seq: Sequence) -> bool:
    return seq.params.prompt_logprobs is not None


def pending(seq: Sequence) -> bool:
    """Whether the sequence's next step may compute prompt positions whose logprobs are still
    missing (such a step needs its logits on the host: it is not pipelined). A decode worker's
    sequence, whose prompt KV was pulled, never does."""
    return wanted(seq) and seq.num_computed_tokens < seq.num_prompt_tokens - 1 and \
        len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1


def rows(batch: ScheduledBatch) -> PromptRows:
    out = PromptRows()
    offset = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        if wanted(seq):
            start = seq.num_computed_tokens
            first = max(start, len(seq.prompt_logprobs))  # a recomputed chunk: nothing new
            for p in range(first, min(start + n, seq.num_prompt_tokens - 1)):
                out.seqs.append(seq)
                out.token_index.append(offset + p - start)
                out.next_tokens.append(seq.token_ids[p + 1])
        offset += n
    return out


def record(prompt: PromptRows, logits: torch.Tensor) -> None:
    """Each row's logprob of the prompt token it predicts, and the top N, onto its sequence."""
    if not prompt.seqs:
        return
    raw = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(prompt.next_tokens, device=raw.device)[:, None]
    chosen = raw.gather(1, ids).squeeze(1).tolist()
    n_top = max(s.params.prompt_logprobs or 0 for s in prompt.seqs)
    tops = raw.topk(n_top, dim=-1) if n_top else None
    top_vals = tops.values.tolist() if tops is not None else []
    top_ids = tops.indices.tolist() if tops is not None else []
    for i, seq in enumerate(prompt.seqs):
        k = seq.params.prompt_logprobs or 0
        top = tuple(Logprob(t, v) for t, v in zip(top_ids[i][:k], top_vals[i][:k])) if k else ()
        seq.prompt_logprobs.append(TokenLogprobs(Logprob(prompt.next_tokens[i], chosen[i]), top))


def take(seq: Sequence) -> list[TokenLogprobs] | None:
    """The whole prompt's logprobs, once, with the sequence's first output."""
    if not wanted(seq) or seq.prompt_logprobs_sent or \
            len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1:
        return None
    seq.prompt_logprobs_sent = True
    return list(seq.prompt_logprobs)
