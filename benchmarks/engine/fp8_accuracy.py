"""What FP8 costs in accuracy: FP8 KV cache and FP8 weights against the unquantized model over
one fixed text, on any --model (a real checkpoint directory for numbers that mean something;
a tiny random one works too).

Each variant is a fresh engine. The text is scored teacher-forced through the engine's own
model runner and paged KV cache: the first tokens in prefill chunks of --chunk tokens (each
chunk attends over the cached KV of the ones before), the last --decode-tail tokens one at a
time (the decode path). At every position p we take the log-probabilities of the next token
and report, against the baseline:

    mean |dlogprob|   mean over positions of |log p(text[p+1]) - log p_base(text[p+1])|
    max |dlogprob|    the largest of those
    top-1 agree       share of positions whose argmax equals the baseline's
    greedy match      free-running greedy generation of --generate tokens from the text's
                      first --prompt-tokens tokens: leading tokens identical to the baseline's

Variants: fp8-kv (scales 1.0, Tandem's static default), fp8-kv-calibrated (per-(layer, KV
head) scales amax/448 taken from the baseline's own KV of this text: an optimistic bound on
what calibration buys), fp8-w (--quantization fp8: per-channel weights, per-token
activations; CUDA needs compute capability >= 8.9, the CPU runs the reference path),
fp8-w+kv (both), fp8-w-exact-accum (fp8-w with torch._scaled_mm's exact accumulation instead
of Hopper's fast one, which Tandem uses: CUDA only).

    python benchmarks/engine/fp8_accuracy.py --model /path/to/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from tandem.engine.llm import _maybe_tokenizer
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.quantization import fp8
from tandem.engine.quantization.kv_cache import FP8_MAX
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scoring import build, compare, score

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a screw press adapted from wine "
    "making. Before him, books were copied by hand, a slow and costly craft that kept written "
    "knowledge in the hands of monasteries, universities and the wealthy. Within fifty years "
    "of the first printed Bible, presses were working in more than two hundred European "
    "cities, and millions of volumes had been produced. Prices fell, literacy spread, and "
    "scholars could compare identical copies of a text for the first time. The Reformation, "
    "the scientific revolution and the rise of newspapers all depended on cheap printed "
    "pages. Today we face a similar change: language models read and write text at a scale "
    "no press ever reached, and serving them efficiently means moving and storing enormous "
    "numbers of small vectors. Engineers trade precision for speed, storing keys and values "
    "in eight bits instead of sixteen, and ask the question every printer asked about a "
    "cheaper ink: does the page still read the same? To answer it, one measures. A fixed "
    "text is scored by the original model and by the cheaper one, token by token, and the "
    "differences in their predictions are averaged. If the two agree on almost every next "
    "word, and their probabilities differ only slightly, the cheaper ink is good enough."
)

VARIANTS = {  # name -> (kv_cache_dtype, quantization, calibrate the KV scales)
    "fp8-kv": ("fp8", None, False),
    "fp8-kv-calibrated": ("fp8", None, True),
    "fp8-w": ("auto", "fp8", False),
    "fp8-w+kv": ("fp8", "fp8", False),
    # FP8 weights with torch._scaled_mm's accumulation exact (engine/quantization/fp8.py
    # FAST_ACCUM off): what the fast accumulation costs, on CUDA (the CPU has no such path)
    "fp8-w-exact-accum": ("auto", "fp8", False),
}


def greedy(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request("greedy", list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                              ignore_eos=True))
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def calibrated_scales(engine: LLMEngine, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(layer, KV head) amax / 448 of the K and V an unquantized engine stored for the text
    (its first blocks, as `score` leaves them)."""
    bs = engine.runner.block_size
    pool = engine.runner.pool[:-(num_tokens // -bs)].float()  # [N, L, 2, bs, H, D]
    pool = pool.permute(1, 2, 0, 3, 4, 5).reshape(pool.shape[1], 2, -1, *pool.shape[4:])
    pool = pool[:, :, :num_tokens]  # whole blocks, tokens in order: drop the unused tail
    amax = pool.abs().amax(dim=(2, 4))  # [L, 2, H]
    scales = amax.clamp(min=1e-6) / FP8_MAX
    return scales[:, 0], scales[:, 1]


def leading_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def text_tokens(engine: LLMEngine, text: str, max_tokens: int, seed: int = 0) -> list[int]:
    tok = _maybe_tokenizer(engine)
    if tok is None:  # a dummy-weight config without tokenizer files: fixed random ids
        g = torch.Generator().manual_seed(seed)
        return torch.randint(1, engine.model_config.vocab_size, (max_tokens,), generator=g).tolist()
    return tok.encode(text)[:max_tokens]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", required=True, help="checkpoint directory (or tandem-demo)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--text-file", type=Path, default=None, help="default: a built-in paragraph")
    p.add_argument("--max-tokens", type=int, default=512, help="score at most this many")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens)")
    p.add_argument("--decode-tail", type=int, default=32, help="last tokens scored one a step")
    p.add_argument("--prompt-tokens", type=int, default=32, help="greedy generation's prompt")
    p.add_argument("--generate", type=int, default=64, help="greedy tokens to compare")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    a = p.parse_args()
    dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    text = a.text_file.read_text() if a.text_file else TEXT

    t0 = time.perf_counter()
    base_engine = build(a.model, a.device, dtype, a.load_format)
    ids = text_tokens(base_engine, text, a.max_tokens)
    base = score(base_engine, ids, a.chunk, a.decode_tail)
    k_cal, v_cal = calibrated_scales(base_engine, len(ids))
    base_greedy = greedy(base_engine, ids[:a.prompt_tokens], a.generate)
    del base_engine
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else "CPU"
    print(f"{Path(a.model).name} {dtype} on {device}; {len(ids)} tokens scored (chunks of "
          f"{a.chunk}, last {a.decode_tail} one a step); greedy: {a.generate} tokens after "
          f"{a.prompt_tokens}")
    print(f"{'variant':<20}{'mean |dlogp|':>14}{'max |dlogp|':>13}{'top-1 agree':>13}"
          f"{'greedy match':>14}", flush=True)
    rows = []
    for name in a.variants:
        kv, quant, calibrate = VARIANTS[name]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        fp8.FAST_ACCUM = name != "fp8-w-exact-accum"  # read as the engine captures its graphs
        engine = build(a.model, a.device, dtype, a.load_format, kv, quant)
        if calibrate:
            engine.runner.kv_scales.set(k_cal, v_cal)
        acc = compare(base, score(engine, ids, a.chunk, a.decode_tail), ids)
        match = leading_match(base_greedy, greedy(engine, ids[:a.prompt_tokens], a.generate))
        r = {"variant": name, **acc._asdict(), "greedy_match": match}
        rows.append(r)
        del engine
        print(f"{r['variant']:<20}{r['mean_abs_dlogprob']:>14.4f}{r['max_abs_dlogprob']:>13.3f}"
              f"{r['top1_agreement']:>13.1%}{r['greedy_match']:>9}/{a.generate:<4}", flush=True)
    print(f"KV scales calibrated on this text: K {k_cal.min():.4f}..{k_cal.max():.4f}, "
          f"V {v_cal.min():.4f}..{v_cal.max():.4f} (1.0 is the default); "
          f"{time.perf_counter() - t0:.0f} s")
    if a.out:
        a.out.write_text(json.dumps({"model": a.model, "dtype": dtype, "device": device,
                                     "tokens": len(ids), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
