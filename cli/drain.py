"""`tandem drain ADDRESS`: take a worker out without dropping a request, then it exits 0.

A decode worker asks its routers to move every request it runs to another decode worker (each
goes on there, token for token) and stops taking new ones; a prefill worker finishes its prompts
and keeps its leases claimable until every one is released or expired. The command returns once
the worker is done (or its --grace ran out), printing what moved, and exits 0 when nothing was
left behind, 1 otherwise (or when the worker could not be reached).

    tandem drain 127.0.0.1:50062
    tandem drain "$POD_IP:50062" --cluster-ca /certs/ca.pem --cluster-cert /certs/decode.pem \
        --cluster-key /certs/decode.key --cluster-server-name decode.tandem.internal

With cluster TLS, a worker takes Drain from a router's certificate or its own role's (a pod's
preStop hook runs it with the pod's own): deploy/k8s/decode.yaml and prefill.yaml do.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc

from tandem.cli.health import add_cluster_tls_args, channel, credentials, seconds
from tandem.v1 import worker_pb2, worker_pb2_grpc


def add_drain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="HOST:PORT of the worker's gRPC server")
    p.add_argument("--timeout", type=seconds, default=600.0,
                   help="seconds to wait for the drain to finish (the worker's own --grace "
                        "bounds it too)")
    add_cluster_tls_args(p, "a certificate it signed (a router's, or the worker's role's)")


def drain(address: str, timeout: float, creds: grpc.ChannelCredentials | None = None,
          server_name: str | None = None) -> worker_pb2.DrainResponse:
    """One Drain call, answered once the worker is drained; raises grpc.RpcError."""
    with channel(address, creds, server_name) as ch:
        return worker_pb2_grpc.WorkerStub(ch).Drain(worker_pb2.DrainRequest(),
                                                         timeout=timeout)


def run(args: argparse.Namespace) -> int:
    args.tls_ca = None  # cli.health's credentials(): only the cluster's apply to a worker
    try:
        creds = credentials(args)
    except (ValueError, OSError) as e:
        print(f"tandem drain: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        r = drain(args.address, args.timeout, creds, args.cluster_server_name)
    except grpc.RpcError as e:
        print(f"tandem drain: {args.address}: {e.code().name}: {e.details()}", file=sys.stderr,
              flush=True)
        return 1
    print(f"{args.address} drained in {r.seconds:.1f} s: {r.moved} requests moved, "
          f"{r.finished} finished there, {r.left} left", flush=True)
    return 0 if r.left == 0 else 1


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="drain a worker (move or finish its requests), then it exits",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_drain_args(p)
    p.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem drain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_drain_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
