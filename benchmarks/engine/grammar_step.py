"""Host cost of one structured-output decode step: the matchers take the tokens sampled last step
(deferred), then the next token bitmask is filled for every row. No model: N rows of
benchmarks/engine/structured.py's JSON schema over a real tokenizer (default: the packaged SmolLM2's,
49k tokens), each row a fixed random walk through its grammar (uniform over the allowed tokens,
as dummy weights at temperature 1.0 sample), recorded once and replayed by every variant.

    python benchmarks/engine/grammar_step.py --rows 64 256 --steps 64 --rounds 5

Variants, alternated within each round on fresh matchers:
    serial   each state flushes its deferred token (one GrammarMatcher.accept_token call per
             row, from Python), then BatchGrammarMatcher.batch_fill_next_token_bitmask
    batched  one BatchGrammarMatcher.batch_accept_token call for all deferred tokens, then the
             same batch fill
    engine   engine.grammar.fill_bitmask as the engine calls it (whichever of the two it uses)
Reported per variant: µs per step taking the tokens (accept), filling the mask (fill) and both
(step), median over rounds of each round's mean; the machine's CPU is named in the table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.structured import SCHEMAS
from tandem.engine.grammar import (
    GrammarCompiler,
    GrammarState,
    bitmask_width,
    fill_bitmask,
    xgrammar,
)
from tandem.engine.model_source import resolve_model
from tandem.engine.sampling_params import ResponseFormat
from tandem.engine.tokenizer import Tokenizer

Step = Callable[[list[GrammarState], torch.Tensor, list[int]], tuple[float, float]]


@functools.cache
def _batch_matcher():
    """As engine.grammar's: xgrammar's threads, half the cores."""
    return xgrammar().BatchGrammarMatcher("auto")


def walks(compiled, rows: int, steps: int, vocab: int, seed: int) -> list[list[int]]:
    """Per row, `steps` tokens of a uniform random walk through the grammar."""
    gen = torch.Generator().manual_seed(seed)
    matchers = [xgrammar().GrammarMatcher(compiled) for _ in range(rows)]
    bitmask = torch.zeros(rows, bitmask_width(vocab), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    out: list[list[int]] = [[] for _ in range(rows)]
    for _ in range(steps):
        _batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask)
        allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].float()
        toks = torch.multinomial(allowed, 1, generator=gen).flatten().tolist()
        for m, tok, row in zip(matchers, toks, out, strict=True):
            assert m.accept_token(tok)
            row.append(tok)
    return out


def serial(states: list[GrammarState], bitmask: torch.Tensor, rows: list[int]):
    t0 = time.perf_counter()
    for s in states:
        s.flush()
    t1 = time.perf_counter()
    _batch_matcher().batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, rows)
    return t1 - t0, time.perf_counter() - t1


def batched(states: list[GrammarState], bitmask: torch.Tensor, rows: list[int]):
    t0 = time.perf_counter()
    deferred = [s for s in states if s.pending is not None]
    if deferred:
        accepted = xgrammar().BatchGrammarMatcher.batch_accept_token(
            [s.matcher for s in deferred], [s.pending for s in deferred])
        for s in deferred:
            s.pending = None
        assert all(accepted)
    t1 = time.perf_counter()
    _batch_matcher().batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, rows)
    return t1 - t0, time.perf_counter() - t1


def engine(states: list[GrammarState], bitmask: torch.Tensor, rows: list[int]):
    t0 = time.perf_counter()
    fill_bitmask(states, bitmask, rows, [])
    return 0.0, time.perf_counter() - t0  # not split: reported as the step alone


VARIANTS: dict[str, Step] = {"serial": serial, "batched": batched, "engine": engine}


def replay(step: Step, compiled, tokens: list[list[int]], vocab: int) -> tuple[float, ...]:
    """Mean µs per step of (accept, fill, both) over the recorded walks, fresh matchers."""
    states = [GrammarCompiler.state_of(compiled) for _ in tokens]
    bitmask = torch.zeros(len(states), bitmask_width(vocab), dtype=torch.int32)
    rows = list(range(len(states)))
    acc = fil = 0.0
    for t in range(len(tokens[0])):
        if t:  # the engine defers the sampled token while the device runs the next forward
            for s, toks in zip(states, tokens, strict=True):
                s.defer(toks[t - 1])
        a, f = step(states, bitmask, rows)
        acc, fil = acc + a, fil + f
    assert not any(s.broken for s in states)
    n = len(tokens[0])
    return acc / n * 1e6, fil / n * 1e6, (acc + fil) / n * 1e6


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a directory with tokenizer files (default: packaged SmolLM2)")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=64, help="decode steps replayed per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schema", choices=list(SCHEMAS), default="bounded",
                    help="structured.py's records with (bounded) or without length-bounded strings")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="the model's logits (default: the tokenizer's vocabulary); a model "
                         "whose embedding is padded past its tokenizer has more")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    tok_dir = args.tokenizer or resolve_model("smollm2-135m-instruct")
    tok = Tokenizer(tok_dir)
    vocab = args.vocab_size or tok.vocab_size
    compiler = GrammarCompiler(tok_dir, vocab, list(tok.eos_token_ids))
    compiled = compiler.compile(ResponseFormat("json_schema", json.dumps(SCHEMAS[args.schema])))
    vocab = compiled.tokenizer_info.vocab_size  # the grammar's ids (the engine masks the rest)
    machine = f"{cpu_name()}, {os.cpu_count()} CPUs"
    results: dict[int, dict[str, list[tuple[float, ...]]]] = {}
    for n in args.rows:
        tokens = walks(compiled, n, args.steps, vocab, args.seed)
        results[n] = {v: [] for v in args.variants}
        for r in range(args.rounds):
            order = args.variants if r % 2 == 0 else args.variants[::-1]
            for v in order:
                results[n][v].append(replay(VARIANTS[v], compiled, tokens, vocab))
            print(f"rows {n}  round {r}  " + "  ".join(
                f"{v} {results[n][v][-1][2]:8.0f}" for v in args.variants) + "  µs/step",
                flush=True)

    print(f"\n{machine}; tokenizer {tok_dir.name} ({vocab} tokens); {args.schema} schema; "
          f"{args.steps} steps, median "
          f"of {args.rounds} rounds; µs per step")
    print(f"{'rows':>5s} {'variant':8s} {'accept':>9s} {'fill':>9s} {'step':>9s} {'vs serial':>9s}")
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for n, by_variant in results.items():
        summary[str(n)] = {}
        for v, runs in by_variant.items():
            acc, fil, step = (statistics.median(x[i] for x in runs) for i in range(3))
            summary[str(n)][v] = ({"step_us": step} if v == "engine" else  # not split
                                  {"accept_us": acc, "fill_us": fil, "step_us": step})
        base = summary[str(n)].get("serial", {}).get("step_us")
        for v, m in summary[str(n)].items():
            rel = f"{m['step_us'] / base:9.2f}" if base else f"{'-':>9s}"
            split = (f"{'-':>9s} {'-':>9s}" if v == "engine"
                     else f"{m['accept_us']:9.0f} {m['fill_us']:9.0f}")
            print(f"{n:5d} {v:8s} {split} {m['step_us']:9.0f} {rel}")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine, "tokenizer": tok_dir.name,
                                        "vocab": vocab, "schema": args.schema, "steps": args.steps,
                                        "rounds": args.rounds, "median": summary,
                                        "runs": {str(k): v for k, v in results.items()}},
                                       indent=2))


if __name__ == "__main__":
    main()
