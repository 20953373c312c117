"""What a fresh machine pays on its first requests: prefill-only requests (one token each) sent
one at a time through the offline engine, in passes: long prompts of lengths not seen before
(A), the same lengths again (B), other new lengths (C), short new lengths (D). Per pass: median
and max milliseconds a request, and how many entries the Triton cache gained. A pass that is
slow while its cache grows compiles kernels in the request path; one slow with no growth pays
something else (allocator growth, collectives' first use).

    # on a fresh GPU machine (an empty cache directory stands in for a fresh disk)
    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/engine/cold_start.py \\
        --model benchmarks/configs/llama-3.1-8b [--tensor-parallel-size 2]

Seen on four H100s (BENCHMARKS.md, four-GPU layouts): the first stack on a fresh machine took
~1 s per long prompt in its prefill worker for a whole run, the same layout started again on the
same machine 0.1-0.2 s; this script separates the candidate causes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def cache_entries(cache: Path) -> int:
    """Kernels in a Triton cache directory (one metadata JSON each)."""
    return sum(1 for _ in cache.rglob("*.json")) if cache.exists() else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--long", type=int, default=1500, help="the shortest long prompt")
    p.add_argument("--count", type=int, default=16, help="prompts a pass")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)

    import torch

    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams

    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    t0 = time.perf_counter()
    llm = LLM(a.model, dtype=a.dtype, load_format=a.load_format, device=a.device,
              tensor_parallel_size=a.tensor_parallel_size, max_model_len=a.max_model_len,
              progress=False)
    out = {"model": a.model, "device": a.device, "tp": a.tensor_parallel_size,
           "card": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
           "startup_s": time.perf_counter() - t0, "cache_entries_at_start": cache_entries(cache),
           "passes": []}
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    n, step = a.count, max(1, (a.max_model_len - a.long - 64) // (2 * a.count))
    passes = [("A long, new lengths", [a.long + 2 * step * i for i in range(n)]),
              ("B the same lengths", [a.long + 2 * step * i for i in range(n)]),
              ("C other new lengths", [a.long + step + 2 * step * i for i in range(n)]),
              ("D short, new lengths", [100 + 7 * i for i in range(n)])]
    print(f"started in {out['startup_s']:.1f} s on {out['card']}; Triton cache entries "
          f"{out['cache_entries_at_start']}")
    print(f"{'pass':<24}{'median ms':>11}{'max ms':>9}{'new cache entries':>19}")
    try:
        llm.generate([[1] * 64], one)  # the first request of any kind, outside the passes
        for label, lengths in passes:
            before, times = cache_entries(cache), []
            for length in lengths:
                ids = torch.randint(1, vocab, (length,), generator=g).tolist()
                t = time.perf_counter()
                llm.generate([ids], one)
                times.append((time.perf_counter() - t) * 1e3)
            row = {"pass": label, "lengths": lengths, "ms": times,
                   "median_ms": statistics.median(times), "max_ms": max(times),
                   "new_cache_entries": cache_entries(cache) - before}
            out["passes"].append(row)
            print(f"{label:<24}{row['median_ms']:>11.1f}{row['max_ms']:>9.1f}"
                  f"{row['new_cache_entries']:>19}", flush=True)
    finally:
        llm.shutdown()
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
