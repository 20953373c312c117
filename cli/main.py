"""The `tandem` command: generate (offline), up (the whole stack), router, prefill, decode and
worker (one service each)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tandem.errors import InvalidArgument, ModelLoadError

# Engine field -> the flag that sets it, so errors name what the user typed.
FLAG_NAMES = {
    "max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
    "top_k": "--top-k", "seed": "--seed", "n": "--n", "num_blocks": "--num-blocks",
    "block_size": "--block-size", "max_num_batched_tokens": "--max-num-batched-tokens",
    "dtype": "--dtype", "device": "--device", "model": "--model", "prompt": "--prompt",
    "prompt_token_ids": "--prompt-token-ids", "max_num_seqs": "--max-num-seqs",
    "max_model_len": "--max-model-len", "kv_cache_dtype": "--kv-cache-dtype",
    "quantization": "--quantization", "tensor_parallel_size": "--tensor-parallel-size",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI, or (only=NAME) just what subcommand NAME needs: importing a service module
    pulls in torch and gRPC, which `tandem health` should not wait for."""
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SERVICE_COMMANDS.items():
        if only is None or only == name:
            __import__(module, fromlist=["add_parser"]).add_parser(sub, name)
    return parser


# Each subcommand's module, imported only when it runs (a service pulls in torch and gRPC, which
# `tandem health` should not wait for); each has add_parser(sub, name).
SERVICE_COMMANDS: dict[str, str] = {
    "generate": "cli.generate",
    "up": "cli.up",
    "router": "router_svc.server",
    "prefill": "prefill_svc.server",
    "decode": "decode_svc.server",
    "worker": "cli.worker",
    "health": "cli.health",
    "certs": "cli.certs",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    known = set(SERVICE_COMMANDS)
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
