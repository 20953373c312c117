"""`tandem health`: ask a service's grpc.health.v1 Check and exit 0 when it is SERVING, 1
otherwise (NOT_SERVING, an unknown service, unreachable, too slow). It prints the status.

    tandem health --address 127.0.0.1:50061
    tandem health --address 127.0.0.1:50051 --service tandem.v1.Tandem --timeout 2
    tandem health --address 127.0.0.1:50061 --cluster-ca ca.pem --cluster-cert prefill.pem \
        --cluster-key prefill.key                    # a worker behind mutual TLS
    tandem health --address "$POD_IP:50061" --cluster-ca ... \
        --cluster-server-name prefill.tandem.internal  # one reached by an IP its cert lacks:
                                                       # the name its role's certificate has

docker-compose.yml runs it as every Tandem container's health check. It needs nothing beyond
grpcio and grpcio-health-checking; `python -m tandem.cli.health` runs it without loading the
rest of the `tandem` CLI.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.ServingStatus.Name(
    health_pb2.HealthCheckResponse.SERVING)

# A health check always talks straight to the address it was given: an http_proxy in the
# container's environment must not route 127.0.0.1 through a proxy.
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


class HealthResult(NamedTuple):
    """`status`: a ServingStatus name (SERVING, NOT_SERVING, ...) or, when the call failed, the
    gRPC status code's name (UNAVAILABLE, NOT_FOUND for an unknown service, ...)."""

    status: str
    detail: str = ""

    @property
    def serving(self) -> bool:
        return self.status == SERVING


def check(address: str, service: str = "", timeout: float = 5.0,
          credentials: grpc.ChannelCredentials | None = None,
          server_name: str | None = None) -> HealthResult:
    """One Check call. `service` "" asks about the whole server; `credentials`: TLS (a worker
    with a cluster CA takes only callers with a client certificate); `server_name`: the name
    the server's certificate must carry, when not the address's host."""
    with channel(address, credentials, server_name) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return HealthResult(e.code().name, e.details() or "")
    return HealthResult(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_health_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", required=True, help="HOST:PORT of the service's gRPC server")
    p.add_argument("--service", default="",
                   help="the service to ask about (default: '', the whole server)")
    p.add_argument("--timeout", type=seconds, default=5.0, help="seconds to wait for the answer")
    p.add_argument("--tls-ca", default=None,
                   help="TLS: the CA of the server's certificate (PEM), e.g. the router's "
                        "public port with --tls-cert")
    add_cluster_tls_args(p, "a certificate it signed")


def channel(address: str, creds: grpc.ChannelCredentials | None = None,
            server_name: str | None = None) -> grpc.Channel:
    """A channel straight to `address` (no proxy): TLS with `creds`, the server's certificate
    checked for `server_name` when given (else for the address's host); plaintext without."""
    if creds is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    name = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS + name)


def add_cluster_tls_args(p: argparse.ArgumentParser, cert_help: str) -> None:
    """--cluster-ca, --cluster-cert (`cert_help`), --cluster-key, --cluster-server-name: what
    `credentials` and `channel` take to call a worker under cluster TLS."""
    p.add_argument("--cluster-ca", default=None, help="mutual TLS: the cluster CA (PEM)")
    p.add_argument("--cluster-cert", default=None, help=f"mutual TLS: {cert_help}")
    p.add_argument("--cluster-key", default=None, help="mutual TLS: that certificate's key")
    p.add_argument("--cluster-server-name", default=None,
                   help="TLS: the name the server's certificate must carry, when not the "
                        "address's host (e.g. decode.tandem.internal for a pod's IP)")


def credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    def read(path: str | None) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    given = {"--cluster-ca": args.cluster_ca, "--cluster-cert": args.cluster_cert,
             "--cluster-key": args.cluster_key}
    if any(given.values()):
        missing = [flag for flag, path in given.items() if not path]
        if missing:  # grpc would abort the process on a certificate without its key
            raise ValueError(f"{', '.join(missing)} missing: --cluster-ca, --cluster-cert and "
                             "--cluster-key go together")
        return grpc.ssl_channel_credentials(read(args.cluster_ca), read(args.cluster_key),
                                            read(args.cluster_cert))
    return grpc.ssl_channel_credentials(read(args.tls_ca)) if args.tls_ca else None


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="check a service's gRPC health (exit 0 when SERVING)")
    add_health_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        creds = credentials(args)
    except (ValueError, OSError) as e:
        print(f"tandem health: {e}", file=sys.stderr, flush=True)
        return 2
    result = check(args.address, args.service, args.timeout, creds, args.cluster_server_name)
    line = f"{args.address} {args.service or '(server)'}: {result.status}"
    print(f"{line}: {result.detail}" if result.detail else line, flush=True)
    return 0 if result.serving else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem health", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_health_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
