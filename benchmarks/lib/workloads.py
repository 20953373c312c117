"""Request workloads shared by the benchmarks.

ShareGPT-like: real ShareGPT conversations are not downloadable here, so prompt and output
lengths are drawn from log-normal distributions fitted to its published shape (long right
tail): prompt ~ LogNormal(mu, 1.0) with mean 220 tokens, output ~ LogNormal(mu, 0.9) with mean
200 tokens, both clipped to [4, 2048]. Token ids are uniform over the vocabulary (the content
does not change the work). Seeded: the same arguments give the same requests.
"""

from __future__ import annotations

import argparse
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


def decode_heavy(n: int, vocab: int, seed: int = 0) -> list[Request]:
    """Short prompts with long generations: the mix where decode capacity decides."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, o = rng.randint(32, 256), rng.randint(256, 768)
        out.append(Request([rng.randrange(1, vocab) for _ in range(p)], o))
    return out


# -- command-line selection (benchmarks/serving/serve.py, hf_baseline.py, ratio.py) -----------------------
WORKLOADS = ("sharegpt", "fixed", "shared-prefix", "prompt-heavy", "decode-heavy")


def add_workload_args(p, multiple: bool = False) -> None:
    """The workload flags every load-generating benchmark takes; multiple: --workloads takes
    several names (benchmarks/serving/ratio.py)."""
    g = p.add_argument_group("workload")
    names = ("sharegpt: log-normal lengths (mean 220 in, 200 out); fixed: --prompt-len / "
             "--output-len; shared-prefix: --prefix-len common tokens + --suffix-len own, "
             "--output-len out; prompt-heavy: half 1500-3000 in / 8-32 out, half 32-128 in / "
             "256-512 out; decode-heavy: 32-256 in / 256-768 out")
    if multiple:
        g.add_argument("--workloads", choices=WORKLOADS, nargs="+",
                       default=["prompt-heavy", "decode-heavy"], help=names)
    g.add_argument("--workload", choices=WORKLOADS, default="sharegpt",
                   help=argparse.SUPPRESS if multiple else names)
    g.add_argument("--num-requests", type=int, default=200)
    g.add_argument("--seed", type=int, default=0, help="workload seed (same seed, same requests)")
    g.add_argument("--prompt-len", type=int, default=512, help="fixed: prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="fixed, shared-prefix: output tokens")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: common tokens")
    g.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: own tokens")
    g.add_argument("--sharegpt-max-len", type=int, default=2048,
                   help="sharegpt: clip prompt and output lengths to this")


def build_workload(args, vocab: int, seed: int | None = None) -> list[Request]:
    """The requests the workload flags describe, over token ids in [1, vocab)."""
    n, s = args.num_requests, args.seed if seed is None else seed
    w = args.workload
    if w == "sharegpt":
        return sharegpt_like(n, vocab, seed=s, max_len=args.sharegpt_max_len)
    if w == "fixed":
        return fixed(n, vocab, args.prompt_len, args.output_len, seed=s)
    if w == "shared-prefix":
        return shared_prefix(n, vocab, args.prefix_len, args.suffix_len, args.output_len, seed=s)
    if w == "prompt-heavy":
        return prompt_heavy(n, vocab, seed=s)
    if w == "decode-heavy":
        return decode_heavy(n, vocab, seed=s)
    raise ValueError(f"unknown workload {w!r}")


def describe(requests: list[Request]) -> dict:
    """Length statistics of a workload, for reports."""
    p = [len(r.prompt) for r in requests]
    o = [r.max_tokens for r in requests]
    return {"num_requests": len(requests), "prompt_tokens": sum(p), "output_tokens": sum(o),
            "mean_prompt_len": sum(p) / len(p), "mean_output_len": sum(o) / len(o),
            "max_prompt_len": max(p), "max_output_len": max(o)}


def static_batch_kv(requests: list[Request], batch_size: int) -> dict:
    """KV slots that static batching (requests in order, `batch_size` at a time, left-padded to
    the batch's longest prompt, every row decoding the batch's largest max_tokens) spends on
    this workload, against the tokens it has to hold:

        row i of a batch:  [pad .. pad | prompt_i | out_i .......... | past its max_tokens ]
                           └────── P = max prompt ─┘└──────── O = max max_tokens ─────────┘
        reserved (a static cache, allocated up front): B × (P + O) slots for the whole batch;
        grown (transformers' DynamicCache): B × (P + t) slots at decode step t.

    Waste is slot-weighted over decode steps (Σ unfilled / Σ allocated), the same way the
    offline engine's paged waste is measured, and at each batch's end (when it is fullest)."""
    res_alloc = res_filled = dyn_alloc = end_alloc = end_filled = 0
    peak_reserved = 0
    for b in range(0, len(requests), batch_size):
        batch = requests[b:b + batch_size]
        p = [len(r.prompt) for r in batch]
        o = [r.max_tokens for r in batch]
        rows, pmax, omax = len(batch), max(p), max(o)
        reserved = rows * (pmax + omax)
        peak_reserved = max(peak_reserved, reserved)
        end_alloc += reserved
        end_filled += sum(p) + sum(o)
        for t in range(1, omax + 1):
            filled = sum(pi + min(t, oi) for pi, oi in zip(p, o))
            res_alloc += reserved
            dyn_alloc += rows * (pmax + t)
            res_filled += filled
    return {"batch_size": batch_size, "num_batches": -(-len(requests) // batch_size),
            "reserved_waste": 1 - res_filled / res_alloc,
            "dynamic_cache_waste": 1 - res_filled / dyn_alloc,
            "waste_at_batch_end": 1 - end_filled / end_alloc,
            "peak_reserved_slots": peak_reserved,
            "mean_reserved_slots_per_row": end_alloc / len(requests)}
