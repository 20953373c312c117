"""Request workloads shared by the benchmarks.

ShareGPT-like: real ShareGPT conversations are not downloadable here, so prompt and output
lengths are drawn from log-normal distributions fitted to its published shape (long right
tail): prompt ~ LogNormal(mu, 1.0) with mean 220 tokens, output ~ LogNormal(mu, 0.9) with mean
200 tokens, both clipped to [4, 2048]. Token ids are uniform over the vocabulary (the content
does not change the work). Seeded: the same arguments give the same requests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def _lognormal_lengths(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2
    return max(lo, min(hi, round(rng.lognormvariate(mu, sigma))))


def sharegpt_like(n: int, vocab: int, seed: int = 0, max_len: int = 2048) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = _lognormal_lengths(rng, 220, 1.0, 4, max_len)
        o = _lognormal_lengths(rng, 200, 0.9, 4, max_len)
        out.append(Request([rng.randrange(1, vocab) for _ in range(p)], o))
    return out


def fixed(n: int, vocab: int, prompt_len: int, output_len: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(1, vocab) for _ in range(prompt_len)], output_len)
            for _ in range(n)]


def shared_prefix(n: int, vocab: int, prefix_len: int = 512, suffix_len: int = 64,
                  output_len: int = 64, seed: int = 0) -> list[Request]:
    """A common system prompt followed by a per-request question (prefix caching)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(prefix_len)]
    return [Request(prefix + [rng.randrange(1, vocab) for _ in range(suffix_len)], output_len)
            for _ in range(n)]


def prompt_heavy(n: int, vocab: int, seed: int = 0) -> list[Request]:
    """Long prompts with short outputs, interleaved with short prompts and long generations:
    the mix where prefill interferes with decode in a colocated worker."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            p, o = rng.randint(1500, 3000), rng.randint(8, 32)
        else:
            p, o = rng.randint(32, 128), rng.randint(256, 512)
        out.append(Request([rng.randrange(1, vocab) for _ in range(p)], o))
    return out
