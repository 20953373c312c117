"""`tandem generate`: the offline engine on the given prompts, no services."""

from __future__ import annotations

import argparse
import json

from engine.sampling_params import SamplingParams
from runtime.engine_args import add_engine_args, engine_config
from tandem.errors import InvalidArgument


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


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="generate offline for the given prompts")
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
    if not getattr(args, "prompts", None):
        raise InvalidArgument("prompt", "give at least one --prompt or --prompt-token-ids")
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    cfg = engine_config(args)
    from engine.llm import LLM  # noqa: PLC0415 - torch: after the arguments parsed

    llm = LLM(cfg.model, **{k: v for k, v in cfg.__dict__.items() if k != "model"},
              progress=not args.json)
    try:
        outputs = llm.generate(args.prompts, params)
    finally:
        llm.shutdown()  # the other tensor-parallel ranks, if any
    for out in outputs:
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
