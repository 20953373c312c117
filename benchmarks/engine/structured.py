"""The cost of grammar-constrained decoding: N concurrent json_schema requests against the same N
unconstrained, in one offline engine (one process, one GPU), alternated over several rounds.

    python benchmarks/engine/structured.py --model benchmarks/configs/llama-3.1-8b --device cuda:0 \\
        --num-requests 256 --max-tokens 256 --rounds 3

Benchmark configs ship without a tokenizer; a grammar needs one. The model directory is
assembled from --model's config.json and --tokenizer's tokenizer files (default: the packaged
SmolLM2's, 49k tokens; pass a real Llama 3 tokenizer directory for its 128k vocabulary), with
the config's vocabulary size and EOS set to the tokenizer's: the model that tokenizer serves
(--model-vocab keeps the config's 128k logits and EOS ids past a 49k tokenizer: a padded
embedding, whose EOS ids the grammar must still cover).

Both kinds send the same prompts at temperature 1.0 (greedy would repeat itself under dummy
weights; no seeds, whose per-row generators would slow both kinds alike). The unconstrained requests use ignore_eos; the schema
(a list of at least 64 records) cannot be complete within --max-tokens, so every constrained
output runs to max_tokens too: both kinds decode exactly N x max_tokens tokens at batch N.
Reported: output tokens/s of each kind per round (wall time of LLM.generate), the ratio, and the
grammar's compile count. Goal (issue 18): constrained >= 0.9 x unconstrained.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tandem.engine.llm import LLM
from tandem.engine.model_source import resolve_model
from tandem.engine.sampling_params import ResponseFormat, SamplingParams

RECORD = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
    "name": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["person", "place", "thing", "event"]},
    "score": {"type": "number"},
    "active": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["id", "name", "kind", "score", "active", "tags"],
    "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": RECORD,
                                                       "minItems": 64}},
          "required": ["records"], "additionalProperties": False}
# The same records with no length bound on their strings: xgrammar writes "maxLength" as a
# counted repetition, whose masks it cannot precompute; an unbounded string is one cached rule.
UNBOUNDED = json.loads(json.dumps(SCHEMA).replace(', "maxLength": 24', "")
                       .replace(', "maxLength": 12', ""))
SCHEMAS = {"bounded": SCHEMA, "unbounded": UNBOUNDED}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja")


def assemble(model: Path, tokenizer: Path, out: Path, match_vocab: bool = True) -> Path:
    """--model's config with --tokenizer's files. match_vocab: the config's vocabulary and
    EOS become the tokenizer's (the model it was built for); otherwise the config's logits
    stay as they are, padded past the tokenizer (the padded ids are never allowed)."""
    for f in TOKENIZER_FILES:
        if (tokenizer / f).exists() and not (out / f).exists():
            shutil.copy(tokenizer / f, out / f)
    cfg = json.loads((model / "config.json").read_text())
    if match_vocab:
        from tandem.engine.tokenizer import Tokenizer

        hf = Tokenizer(out).hf
        cfg["vocab_size"] = max(hf.get_vocab().values()) + 1
        cfg["eos_token_id"] = hf.eos_token_id
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(o.token_ids) for out in outs for o in out.outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("benchmarks/configs/llama-3.1-8b"))
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a directory with tokenizer files (default: packaged SmolLM2)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--schema", choices=list(SCHEMAS), default="bounded",
                    help="bounded: records whose strings have a maxLength; unbounded: without")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="pipelined steps (default: the engine's, on for CUDA)")
    ap.add_argument("--model-vocab", action="store_true",
                    help="keep --model's vocabulary and EOS ids (logits padded past the "
                         "tokenizer) instead of the tokenizer's")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time, per step, the engine step, the model runner's execute, the "
                         "sampler (its wait for the device included) and the grammar's mask fill")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    tok_dir = args.tokenizer or resolve_model("smollm2-135m-instruct")
    with tempfile.TemporaryDirectory(prefix="tandem-structured-") as tmp:
        model_dir = assemble(args.model, tok_dir, Path(tmp), match_vocab=not args.model_vocab)
        llm = LLM(str(model_dir), device=args.device, dtype=args.dtype, load_format="dummy",
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  async_scheduling=args.async_scheduling, progress=False)
        vocab = llm.tokenizer.vocab_size
        if vocab > llm.engine.model_config.vocab_size:
            sys.exit(f"the tokenizer has {vocab} tokens, more than the model's "
                     f"{llm.engine.model_config.vocab_size} logits: pass another --tokenizer")
        n = args.num_requests
        prompts = [[(97 * i + 13 * j) % (vocab - 1) + 1 for j in range(args.prompt_len)]
                   for i in range(n)]
        fmt = ResponseFormat("json_schema", json.dumps(SCHEMAS[args.schema]))
        kinds = {
            "unconstrained": [SamplingParams(temperature=1.0, max_tokens=args.max_tokens,
                                             ignore_eos=True)] * n,
            "json_schema": [SamplingParams(temperature=1.0, max_tokens=args.max_tokens,
                                           response_format=fmt)] * n,
        }
        run(llm, prompts[:8], kinds["json_schema"][:8])  # warm-up; compiles the grammar
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        timer = StepTimer(llm) if args.breakdown else None
        parts: dict[str, dict[str, float]] = {}
        for r in range(args.rounds):
            for kind, params in kinds.items():
                if timer:
                    timer.reset()
                seconds, tokens = run(llm, prompts, params)
                if timer:
                    parts[kind] = timer.means()
                assert tokens == n * args.max_tokens, (kind, tokens)
                rates[kind].append(tokens / seconds)
                print(f"round {r}  {kind:13s}  {tokens} tokens  {seconds:7.2f} s  "
                      f"{tokens / seconds:9.0f} tok/s", flush=True)
    card = _card(args.device)
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["json_schema"] / med["unconstrained"]
    pipelined = llm.engine.pipeline.enabled
    print(f"\n{card}, {args.model.name}, {n} concurrent requests, {args.max_tokens} tokens each,"
          f" tokenizer vocab {vocab}, {args.schema} schema, "
          f"{'pipelined' if pipelined else 'synchronous'} steps")
    print(f"{'kind':14s} {'median tok/s':>13s}")
    for k, v in med.items():
        print(f"{k:14s} {v:13.0f}")
    print(f"json_schema / unconstrained: {ratio:.3f} ({(1 - ratio) * 100:.1f}% lower)")
    for kind, means in parts.items():  # the last round's
        print(f"{kind:14s} ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in means.items()))
    print(f"grammars compiled: {llm.engine.grammars.num_compiled}")
    if args.out:
        args.out.write_text(json.dumps({"card": card, "model": args.model.name, "requests": n,
                                        "max_tokens": args.max_tokens, "tokenizer_vocab": vocab,
                                        "schema": args.schema, "pipelined": pipelined,
                                        "tok_s": rates, "median": med, "ratio": ratio}, indent=2))


class StepTimer:
    """Host time per engine step and inside it (--breakdown): wraps the engine's runner and
    sampler methods on this instance only. The sampler's time includes its wait for the
    forward pass (the step's one device sync); the fill is the grammar's host work, which
    overlaps the forward pass."""

    def __init__(self, llm: LLM) -> None:
        self.engine = engine = llm.engine
        self.totals: dict[str, float] = {}
        self.steps = 0
        runner, sampler = engine.runner, engine.runner.sampler
        self._wrap(runner, "forward", "forward (launch)")
        self._wrap(sampler, "__call__", "sampler")  # synchronous steps
        self._wrap(sampler, "sample", "sample (launch)")  # its launches (pipelined: all of it)
        self._wrap(sampler, "_fill_bitmask", "mask fill")
        engine.on_step = self._on_step

    def _wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.totals[label] = self.totals.get(label, 0.0) + time.perf_counter() - t

        if name == "__call__":  # a call goes through the type: wrap the instance's callable
            obj.__class__ = type(type(obj).__name__, (type(obj),), {"__call__": lambda s, *a, **kw: timed(*a, **kw)})
        else:
            setattr(obj, name, timed)

    def _on_step(self, _outs) -> None:
        self.steps += 1
        e = self.engine
        for label, v in (("step", e.last_step.seconds), ("execute", e.last_execute_s)):
            self.totals[label] = self.totals.get(label, 0.0) + v

    def reset(self) -> None:
        self.totals, self.steps = {}, 0

    def means(self) -> dict[str, float]:
        order = ("step", "execute", "forward (launch)", "sampler", "mask fill")
        return {k: self.totals.get(k, 0.0) / max(1, self.steps) * 1e3 for k in order}


def _card(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


if __name__ == "__main__":
    main()
