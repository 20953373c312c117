"""`tandem worker --role prefill|decode|both`: one worker of any role (`tandem prefill` and
`tandem decode` are the same with the role fixed)."""

from __future__ import annotations

import argparse

from tandem.decode_svc import server as decode_server
from tandem.prefill_svc import server as prefill_server
from tandem.runtime.worker import add_worker_args, main_worker


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="run a worker of any role (prefill, decode, both)")
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
    prefill_server.add_lease_args(p, prefix="role prefill: ")
    add_worker_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """A prefill or decode worker may change to the other role in place (SwitchRole,
    runtime/role_switch.py): it is started able to serve both."""
    split = {"prefill": prefill_server.role_options(args),
             "decode": decode_server.role_options("decode", args.transport)}
    if args.role == "both":
        return main_worker(args, decode_server.role_options("both", args.transport))
    return main_worker(args, split[args.role],
                       also=[o for name, o in split.items() if name != args.role])
