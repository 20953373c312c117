"""`tandem move ADDRESS REQUEST_ID`: move one running request off a decode worker, live.

The decode worker lends the request's KV and asks the request's router to move it (the Move
RPC): the router picks another decode worker, which pulls the KV while this one decodes on,
then the request goes on there token for token, its client's stream unbroken. Nothing else
changes: the worker keeps its other requests and takes new ones (to take them all out, use
`tandem drain`). REQUEST_ID is the id the worker knows the request by: the router's, which is
the client's own `request_id` when API keys are off. Exits 0 once the request moved, 1 when it
stayed (it finished first, or its router had nowhere to move it) or could not be asked.

    tandem move 127.0.0.1:50062 my-request
    tandem move "$POD_IP:50062" my-request --cluster-ca /certs/ca.pem \\
        --cluster-cert /certs/decode.pem --cluster-key /certs/decode.key \\
        --cluster-server-name decode.tandem.internal

With cluster TLS, a worker takes Move from a router's certificate or its own role's, as Drain.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc

from tandem.cli.health import add_cluster_tls_args, channel, credentials, seconds
from tandem.v1 import worker_pb2, worker_pb2_grpc


def move(address: str, request_id: str, timeout: float,
         creds: grpc.ChannelCredentials | None = None,
         server_name: str | None = None) -> worker_pb2.MoveResponse:
    """One Move call, answered once the request left the worker or ended there; raises
    grpc.RpcError."""
    with channel(address, creds, server_name) as ch:
        return worker_pb2_grpc.WorkerStub(ch).Move(
            worker_pb2.MoveRequest(request_id=request_id), timeout=timeout)


def run(args: argparse.Namespace) -> int:
    args.tls_ca = None  # cli.health's credentials(): only the cluster's apply to a worker
    try:
        creds = credentials(args)
    except (ValueError, OSError) as e:
        print(f"tandem move: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        r = move(args.address, args.request_id, args.timeout, creds, args.cluster_server_name)
    except grpc.RpcError as e:
        print(f"tandem move: {args.address}: {e.code().name}: {e.details()}", file=sys.stderr,
              flush=True)
        return 1
    if r.moved:
        print(f"{args.request_id} moved off {args.address} in {r.seconds:.3f} s "
              f"({r.num_tokens} tokens' KV lent)", flush=True)
        return 0
    print(f"{args.request_id} stayed on {args.address}: it ended there first, or its router "
          "had nowhere to move it", flush=True)
    return 1


def add_move_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="HOST:PORT of the decode worker's gRPC server")
    p.add_argument("request_id", help="the request's id on the worker (the router's)")
    p.add_argument("--timeout", type=seconds, default=600.0,
                   help="seconds to wait for the request to leave the worker")
    add_cluster_tls_args(p, "a certificate it signed (a router's, or the worker's role's)")


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="move one running request off a decode worker, live",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_move_args(p)
    p.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem move", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_move_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
