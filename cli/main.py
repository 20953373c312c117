"""The `tandem` command: generate (offline), up (the whole stack), router, prefill, decode and
worker (one service each).

Parsing comes first and imports only the subcommand asked for: `tandem --help`, a subcommand's
`--help` and a misspelt flag answer without loading torch, the engine or a service.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tandem.errors import InvalidArgument, ModelLoadError
from tandem.runtime.lifeline import hold_lifeline


def flag_name(field: str) -> str:
    """The flag that sets an engine field (`max_tokens` -> `--max-tokens`: every flag is so
    spelt), so errors name what the user typed; a field already given as a flag as it is."""
    return field if field.startswith("-") else "--" + field.replace("_", "-")


# Each subcommand's module (with add_parser(sub, name)), imported only when that subcommand
# runs, and the line `tandem --help` lists it with (the module's own help; a test holds them
# equal).
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tandem.cli.generate", "generate offline for the given prompts"),
    "up": ("tandem.cli.up", "start router + prefill + decode workers locally"),
    "router": ("tandem.router_svc.server", "run the router (public gRPC + OpenAI HTTP API)"),
    "prefill": ("tandem.prefill_svc.server", "run a prefill worker"),
    "decode": ("tandem.decode_svc.server", "run a decode worker"),
    "worker": ("tandem.cli.worker", "run a worker of any role (prefill, decode, both)"),
    "health": ("tandem.cli.health", "check a service's gRPC health (exit 0 when SERVING)"),
    "drain": ("tandem.cli.drain", "drain a worker (move or finish its requests), then it exits"),
    "move": ("tandem.cli.move", "move one running request off a decode worker, live"),
    "certs": ("tandem.cli.certs", "write a throwaway cluster CA and a certificate per role"),
}
SERVICE_COMMANDS: dict[str, str] = {name: module for name, (module, _) in COMMANDS.items()}

# Flags of other servers (vLLM's, mostly) that Tandem does not take under any spelling: what to
# use instead. Spellings Tandem has an equivalent for are accepted as aliases where the flag is
# defined (e.g. --port, --gpu-memory-utilization on `tandem up`).
OTHER_SPELLINGS = {
    "--pipeline-parallel-size": "Tandem has no pipeline parallelism; --tensor-parallel-size "
                                "splits each worker over GPUs",
    "--data-parallel-size": "more workers serve more: --prefill-workers N --decode-workers N "
                            "(or --both-workers N)",
    "--trust-remote-code": "Tandem runs its own model code for the architectures it knows; "
                           "no code from a checkpoint runs",
    "--download-dir": "hub downloads go to the Hugging Face cache ($HF_HOME)",
    "--uvicorn-log-level": "set the log format with $TANDEM_LOG_FORMAT (console or json)",
}


class DefaultsFormatter(argparse.HelpFormatter):
    """`--help` with each option's default, unless its help already says it or there is none
    to say (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False or default == []
                or default is argparse.SUPPRESS or "default" in text):
            return action.help
        return f"{text} (default: %(default)s)".lstrip()


class _CommandParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)


def _parsers(only: str | None = None, *, listing: bool = False
             ) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    for name, (module, summary) in COMMANDS.items():
        if listing:  # the names and one line each: nothing imported
            sub.add_parser(name, help=summary, add_help=False)
        elif only is None or only == name:
            importlib.import_module(module).add_parser(sub, name)
    return parser, dict(sub.choices)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI, or (only=NAME) just what subcommand NAME needs: importing a service module
    pulls in gRPC (and some of them torch), which `tandem health` should not wait for."""
    return _parsers(only)[0]


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The arguments of `tandem ARGV`; exits 2 (argparse's way) on a bad one, naming it and,
    for a spelling of another server's, what Tandem takes instead."""
    command = argv[0] if argv and argv[0] in COMMANDS else None
    parser, subs = _parsers(command, listing=command is None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        (subs[command] if command else parser).error(_unrecognized(command, unknown))
    return args


def _unrecognized(command: str | None, unknown: Sequence[str]) -> str:
    msg = f"unrecognized arguments: {' '.join(unknown)}"
    flags = [a.split("=", 1)[0] for a in unknown if a.startswith("--")]
    hints = [f"{f}: {OTHER_SPELLINGS[f]}" for f in flags if f in OTHER_SPELLINGS]
    if command == "up":
        hints += _passed_through(flags)
    return "\n  ".join([msg, *hints])


def _passed_through(flags: Sequence[str]) -> list[str]:
    """`tandem up` hints: flags a worker or the router takes, which `up` passes on."""
    hints = []
    for command in ("worker", "router"):
        # argparse's own table of a parser's flags (no public accessor).
        known = _parsers(command)[1][command]._option_string_actions
        for f in [f for f in flags if f in known and f not in OTHER_SPELLINGS]:
            value = "" if known[f].nargs == 0 else "=VALUE"
            hints.append(f"{f}: a {command} flag; `tandem up` passes it on as "
                         f"--{command}-arg={f}{value}")
        flags = [f for f in flags if f not in known]
    return hints


def main(argv: Sequence[str] | None = None) -> int:
    hold_lifeline()  # a launcher's child dies with it (runtime/lifeline.py)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    args.command_argv = argv  # as given: a command may start copies of itself (router)
    try:
        return args.func(args) or 0
    except InvalidArgument as e:
        flag = flag_name(e.field)
        print(f"tandem {args.command}: error: argument {flag}: {e.message}", file=sys.stderr)
        return 2
    except ModelLoadError as e:
        print(f"tandem {args.command}: error: argument --model: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
