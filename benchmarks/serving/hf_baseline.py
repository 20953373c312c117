"""The serving benchmark's workload through Hugging Face transformers on the same device, all
requests at once: (a) `model.generate` in static batches, (b) transformers' own continuous
batching (the manager behind `model.generate_batch`).

    python benchmarks/serving/hf_baseline.py --model benchmarks/configs/llama-3.1-8b --mode static \\
        --batch-size 64 --num-requests 1000 --time-limit 480
    python benchmarks/serving/hf_baseline.py --model benchmarks/configs/llama-3.1-8b --mode cb --num-requests 1000

Same workload as benchmarks/serving/serve.py (same generator, flags and seed), same token ids.
Weights: --load-format dummy builds the model from config.json with transformers' random
init (speed does not depend on the values); auto loads the checkpoint.

How outputs are made exactly the requested length, and what is counted:
- static: requests in workload order, --batch-size at a time, left-padded to the batch's longest
  prompt; every row decodes max_new_tokens = the batch's largest max_tokens, with EOS disabled
  (eos_token_id None in the model's generation config, so no row stops early; checked). Only
  the tokens each request asked for are counted in output tok/s; `computed_output_throughput`
  also counts the rows' tokens past their own max_tokens (work static batching does anyway).
  TTFT: when the batch's first token came out (all requests arrive at t=0); a request is done
  when its own max_tokens-th token came out (a streamer stamps every decode step).
- cb (default --cb-entry manager): each request is added with its own max_new_tokens and
  eos_token_id=-1 (EOS off) through `model.continuous_batching_context_manager` and
  `manager.add_request`, which `generate_batch` wraps; generate_batch itself takes one
  max_new_tokens for all requests. --cb-entry generate_batch calls it literally, with the
  workload's largest max_tokens for every request, and counts only the requested tokens.
  TTFT and TPOT from the per-token timestamps transformers records.
--time-limit stops early (static: no new batch starts; cb: unfinished requests are cancelled)
and reports throughput over what finished, with `partial: true`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The repository first, even when PYTHONPATH already lists it: the script's own directory
# (a benchmarks/ folder) must not shadow a package of the same name.
sys.path.insert(0, str(ROOT))

from benchmarks.lib.common import dist, environment, strip_private  # noqa: E402
from benchmarks.lib.common import progress_bar as _bar  # noqa: E402
from benchmarks.lib.workloads import (  # noqa: E402
    Request,
    add_workload_args,
    build_workload,
    describe,
    static_batch_kv,
)


def load_model(model_dir: str, device: str, dtype: str, load_format: str, attn: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    tdtype = getattr(torch, dtype)
    if load_format == "dummy":
        config = AutoConfig.from_pretrained(model_dir)
        # Random init straight on the device: an 8B model's init on the CPU takes minutes.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=tdtype,
                                                     attn_implementation=attn)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype,
                                                     attn_implementation=attn).to(device)
    model.eval()
    # EOS off everywhere: generate() fills unset fields from model.generation_config, and
    # continuous batching falls back to model.config's EOS.
    pad = model.config.pad_token_id
    pad = pad if isinstance(pad, int) else 0
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None,
                                               pad_token_id=pad)
    model.config.eos_token_id = None
    return model, pad


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _memory(device: str) -> dict:
    if not device.startswith("cuda"):
        return {}
    import torch

    return {"peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def run_static(model, pad: int, requests: list[Request], batch_size: int, device: str,
               time_limit: float | None, progress: bool, cache: str = "dynamic") -> dict:
    import torch
    from transformers import GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        """generate() puts the prompt once, then each step's new tokens: stamp the steps."""

        def __init__(self) -> None:
            self.prompt_seen = False
            self.times: list[float] = []

        def put(self, value) -> None:
            if self.prompt_seen:
                self.times.append(time.perf_counter())
            self.prompt_seen = True

        def end(self) -> None:
            pass

    # A static cache is what transformers documents for fast generate: on CUDA, generate then
    # compiles the decoding forward pass (torch.compile, CUDA graphs) for the batch's shapes.
    static = {"cache_implementation": "static"} if cache == "static" else {}

    def generate(batch: list[Request]) -> tuple[StepClock, int]:
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        new = max(r.max_tokens for r in batch)
        clock = StepClock()
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 generation_config=GenerationConfig(
                                     max_new_tokens=new, do_sample=False, eos_token_id=None,
                                     pad_token_id=pad, **static),
                                 streamer=clock)
        _sync(device)
        made = out.shape[1] - width
        if made != new or len(clock.times) != new:
            raise RuntimeError(f"generate made {made} tokens ({len(clock.times)} steps), "
                               f"asked for {new}")
        return clock, new

    if cache == "static":  # warm-up: the compilation for the first batch's shapes
        generate(requests[:batch_size])
    else:  # warm-up: kernels, allocator
        generate([Request(requests[0].prompt[:8], 4)] * 2)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    bar = _bar(len(requests), "static", progress)
    ttft, tpot, e2e = [], [], []
    done = useful = computed = batches = 0
    partial, error = False, None
    t0 = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            partial = True
            break
        batch = requests[b:b + batch_size]
        try:
            clock, new = generate(batch)
        except torch.OutOfMemoryError as e:
            partial, error = True, f"out of memory at batch {batches} ({len(batch)} rows): {e}"
            break
        batches += 1
        for r in batch:
            ttft.append((clock.times[0] - t0) * 1e3)
            e2e.append(clock.times[r.max_tokens - 1] - t0)
            if r.max_tokens > 1:
                tpot.append((clock.times[r.max_tokens - 1] - clock.times[0])
                            / (r.max_tokens - 1) * 1e3)
        done += len(batch)
        useful += sum(r.max_tokens for r in batch)
        computed += len(batch) * new
        bar.update(len(batch))
    duration = time.perf_counter() - t0
    bar.close()
    return {"method": "model.generate, static batches", "batch_size": batch_size,
            "cache": cache,
            "num_requests": len(requests), "completed": done, "batches": batches,
            "partial": partial, "error": error, "time_limit_s": time_limit,
            "duration_s": duration, "output_tokens": useful,
            "request_throughput": done / duration,
            "output_throughput": useful / duration,
            "computed_output_throughput": computed / duration,
            "total_token_throughput": (useful + sum(len(r.prompt) for r in requests[:done]))
            / duration,
            "ttft_ms": dist(ttft), "tpot_ms": dist(tpot), "e2e_s": dist(e2e),
            "kv": static_batch_kv(requests[:done] or requests, batch_size),
            **_memory(device)}


def cb_config(a: argparse.Namespace):
    from transformers import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kw = {}
    for name, value in (("num_blocks", a.cb_num_blocks), ("max_batch_tokens",
                        a.cb_max_batch_tokens), ("max_requests_per_batch", a.cb_max_requests)):
        if value is not None:
            kw[name] = value
    if a.cb_block_size is not None:  # block_size up to 5.17, page_size later
        kw["page_size" if "page_size" in names else "block_size"] = a.cb_block_size
    return ContinuousBatchingConfig(**kw), kw


def run_cb(model, requests: list[Request], a: argparse.Namespace, device: str) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    cbc, cb_kw = cb_config(a)
    longest = max(r.max_tokens for r in requests)
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt) for r in requests),
                          max_generated_length=longest, num_requests=len(requests))
    gen = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=None)
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()
    outputs: dict[str, object] = {}
    partial = False
    attn = f"what transformers derives from {a.attn!r} (not visible through generate_batch)"
    if a.cb_entry == "generate_batch":
        t0 = time.perf_counter()
        res = model.generate_batch(inputs=[r.prompt for r in requests], generation_config=gen,
                                   continuous_batching_config=cbc, record_timestamps=True,
                                   progress_bar=a.progress, max_new_tokens=longest)
        duration = time.perf_counter() - t0
        outputs = dict(zip((f"r{i}" for i in range(len(requests))), res.values()))
        if len(res) != len(requests):
            raise RuntimeError(f"generate_batch returned {len(res)} of {len(requests)} results")
    else:
        bar = _bar(len(requests), "cb", a.progress)
        with model.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=cbc, block=True, timeout=30,
                workload_hints=hints) as manager:
            attn = model.config._attn_implementation  # as switched for the run
            t0 = time.perf_counter()
            for i, r in enumerate(requests):
                manager.add_request(input_ids=r.prompt, request_id=f"r{i}",
                                    max_new_tokens=r.max_tokens, eos_token_id=-1,
                                    record_timestamps=True)
            while len(outputs) < len(requests):
                if a.time_limit is not None and time.perf_counter() - t0 > a.time_limit:
                    partial = True
                    for i in range(len(requests)):
                        if f"r{i}" not in outputs:
                            manager.cancel_request(f"r{i}")
                    break
                out = manager.get_result(timeout=1)
                if out is not None and out.is_finished():
                    outputs[out.request_id] = out
                    bar.update(1)
                elif out is None and not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped")
            duration = time.perf_counter() - t0
        bar.close()
    ttft, tpot, e2e, errors = [], [], [], []
    useful = done = 0
    for i, r in enumerate(requests):
        out = outputs.get(f"r{i}")
        if out is None:
            continue
        if out.error is not None:
            errors.append(out.error)
            continue
        n = min(len(out.generated_tokens), r.max_tokens)
        if n != r.max_tokens:
            errors.append(f"r{i}: {len(out.generated_tokens)} tokens, asked for {r.max_tokens}")
            continue
        done += 1
        useful += n
        ts = out.timestamps or []
        if len(ts) >= n:
            ttft.append((ts[0] - t0) * 1e3)
            e2e.append(ts[n - 1] - t0)
            if n > 1:
                tpot.append((ts[n - 1] - ts[0]) / (n - 1) * 1e3)
    return {"method": f"transformers continuous batching ({a.cb_entry})",
            "attn_implementation": attn,
            "cb_config": cb_kw, "num_requests": len(requests), "completed": done,
            "errors": errors[:5], "partial": partial, "time_limit_s": a.time_limit,
            "duration_s": duration, "output_tokens": useful,
            "request_throughput": done / duration, "output_throughput": useful / duration,
            "total_token_throughput": (useful + sum(len(r.prompt) for r, o in zip(
                requests, (outputs.get(f"r{i}") for i in range(len(requests)))) if o))
            / duration,
            "ttft_ms": dist(ttft), "tpot_ms": dist(tpot), "e2e_s": dist(e2e),
            **_memory(device)}




def _row(name: str, r: dict) -> str:
    def f(x, spec=".0f"):
        return "-" if x is None else format(x, spec)

    return (f"{name:<10}{r['completed']:>6}/{r['num_requests']:<6}{r['duration_s']:>8.1f}"
            f"{r['request_throughput']:>8.2f}{r['output_throughput']:>11.0f}"
            f"{f(r['ttft_ms']['p50']):>10}{f(r['ttft_ms']['p99']):>10}"
            f"{f(r['tpot_ms']['p50'], '.1f'):>9}{'  partial' if r.get('partial') else ''}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint or config directory")
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if any)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--load-format", default="dummy", choices=["dummy", "auto"])
    ap.add_argument("--mode", choices=["static", "cb", "both"], default="both")
    ap.add_argument("--batch-size", type=int, default=64, help="static batch size")
    ap.add_argument("--cache", choices=["dynamic", "static"], default="dynamic",
                    help="generate's KV cache: static (transformers' fast path: on CUDA it "
                         "compiles the decoding step; batches whose shapes differ from the "
                         "first one compile again) or dynamic")
    ap.add_argument("--attn", default="sdpa",
                    help="attn_implementation (transformers 5.17's continuous batching runs "
                         "paged|<it>, or flash attention if installed)")
    ap.add_argument("--cb-entry", choices=["manager", "generate_batch"], default="manager")
    ap.add_argument("--cb-num-blocks", type=int, default=None, help="default: from free memory")
    ap.add_argument("--cb-block-size", type=int, default=None)
    ap.add_argument("--cb-max-batch-tokens", type=int, default=None)
    ap.add_argument("--cb-max-requests", type=int, default=None,
                    help="max_requests_per_batch (default: transformers')")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds per mode; stop early and report what finished")
    add_workload_args(ap)
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    a = ap.parse_args(argv)

    import torch
    from transformers import AutoConfig

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    dtype = a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    vocab = AutoConfig.from_pretrained(a.model).vocab_size
    requests = build_workload(a, vocab)
    card = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") \
        else "cpu"
    t = time.perf_counter()
    model, pad = load_model(a.model, device, dtype, a.load_format, a.attn)
    report = {"benchmark": "hf_baseline", "model": a.model, "card": card, "device": device,
              "dtype": dtype, "load_format": a.load_format, "workload": a.workload,
              "seed": a.seed, "workload_stats": describe(requests),
              "load_s": time.perf_counter() - t, "environment": environment(),
              "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None
                                                              else argv)])}
    if a.mode in ("static", "both"):
        report["static"] = run_static(model, pad, requests, a.batch_size, device, a.time_limit,
                                      a.progress, a.cache)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if a.mode in ("cb", "both"):
        report["cb"] = run_cb(model, requests, a, device)
    print(f"== {Path(a.model).name} via transformers {report['environment'].get('transformers')}"
          f" on {card} ({dtype}), {a.workload} x{a.num_requests}, all at once")
    print(f"{'':<10}{'done':>13}{'dur s':>8}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}"
          f"{'p99':>10}{'TPOT p50':>9}")
    for name in ("static", "cb"):
        if name in report:
            print(_row(name, report[name]))
    if "static" in report:
        s = report["static"]
        print(f"static: {s['computed_output_throughput']:.0f} tok/s computed incl. rows past "
              f"their max_tokens; KV reserved B x (max prompt + max new) would leave "
              f"{s['kv']['reserved_waste']:.1%} of slots unfilled"
              + (f"; {s['error']}" if s.get("error") else ""))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(strip_private(report), indent=1))
        print(f"wrote {a.out}")
    incomplete = [m for m in ("static", "cb") if m in report
                  and report[m]["completed"] < len(requests) and not report[m]["partial"]]
    return 1 if incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
