"""`tandem generate`: the offline engine on the given prompts, no services."""

from __future__ import annotations

import argparse
import json
import typing

from tandem.engine.sampling_params import SamplingParams, param_spec, request_params
from tandem.errors import InvalidArgument
from tandem.runtime.engine_args import add_engine_args, engine_config


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
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="one JSON line per prompt")
    p.set_defaults(func=cmd_generate)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """A flag for each request parameter declared with cli=True (engine/sampling_params.py),
    with its type and help from the declaration; unset, it takes the engine's default."""
    hints = typing.get_type_hints(SamplingParams)
    for f in request_params():
        spec = param_spec(f)
        if not spec.cli:
            continue
        shown = f.default not in (None, (), False)
        helptext = spec.doc + (f" (default: {f.default})" if shown else "")
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a not in (type(None), Ellipsis)]
        if hint is bool:
            p.add_argument(flag(f.name), action="store_true", default=None, help=helptext)
        elif typing.get_origin(hint) is tuple:
            p.add_argument(flag(f.name), type=args[0], action="append", help=helptext +
                           " (repeatable)")
        else:
            p.add_argument(flag(f.name), type=args[0] if args else hint, help=helptext)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{f.name: getattr(args, f.name) for f in request_params()
                             if param_spec(f).cli and getattr(args, f.name) is not None})


def cmd_generate(args: argparse.Namespace) -> int:
    if not getattr(args, "prompts", None):
        raise InvalidArgument("prompt", "give at least one --prompt or --prompt-token-ids")
    params = sampling_params(args)
    cfg = engine_config(args)
    from tandem.engine.llm import LLM  # noqa: PLC0415 - torch: after the arguments parsed

    llm = LLM.from_config(cfg, progress=not args.json)
    try:
        outputs = llm.generate(args.prompts, params)
    finally:
        llm.shutdown()  # the other tensor-parallel ranks, if any
    for out in outputs:
        if args.json:
            print(json.dumps({
                "prompt_token_ids": out.prompt_token_ids,
                "outputs": [_output_json(o) for o in out.outputs]}), flush=True)
        else:
            for o in out.outputs:
                print(f"--- prompt {out.prompt!r} sample {o.index} ({o.finish_reason})")
                print(o.text)
    return 0


def _output_json(o) -> dict:
    out = {"token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason}
    if o.logprobs is not None:  # --logprobs: the sampled token's and the top N's
        out["logprobs"] = [{"token_id": lp.sampled.token_id, "logprob": lp.sampled.logprob,
                            "top": [[t.token_id, t.logprob] for t in lp.top]}
                           for lp in o.logprobs if lp is not None]
    return out
