"""Who may call a service, and over what.

    public ports (router HTTP + gRPC)   API keys (bearer tokens), optional TLS
    internal hops (router→worker,       mutual TLS with the cluster CA: a peer without a client
                  decode→prefill)       certificate that CA signed is refused in the handshake,
                                        and each RPC is for the roles runtime/cluster_roles.py
                                        names (a certificate per role)

Certificates are PEM files named by flags (paths on a command line are not secrets); API keys
come from the environment or a file, never from argv, where `ps` would show them.

    TANDEM_API_KEY        one key
    TANDEM_API_KEY_FILE   a file of keys, one per line ("#" starts a comment); each key is its
                          own tenant (its own prefix-cache namespace)

Keys are compared in constant time: both sides are hashed to equal length first, so
compare_digest leaks nothing, not even a key's length.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from tandem.errors import InvalidArgument
from tandem.runtime.cluster_roles import peer_name, role_of

log = structlog.get_logger(__name__)

API_KEY_ENV = "TANDEM_API_KEY"
API_KEY_FILE_ENV = "TANDEM_API_KEY_FILE"

# Probes (kubelet, compose healthchecks, `tandem health`) carry no key: health stays open.
OPEN_GRPC_SERVICES = ("grpc.health.v1.Health",)
UNAUTHENTICATED_REASON = "INVALID_API_KEY"


# -- mutual TLS between the cluster's own processes ----------------------------------------------
@dataclass(frozen=True)
class ClusterTls:
    """The cluster CA and this process's certificate and key (PEM files). The certificate
    serves as the server's and as the client's on calls to peers, and names this process's
    role (runtime/cluster_roles.py): a worker checks each caller's, and a caller checks, in the
    handshake, that the peer it dials holds the role it dials for, whatever its address."""

    ca: Path
    cert: Path
    key: Path

    def __post_init__(self) -> None:
        for flag, path in (("--cluster-ca", self.ca), ("--cluster-cert", self.cert),
                           ("--cluster-key", self.key)):
            if not Path(path).is_file():
                raise InvalidArgument(flag, f"no such file: {path}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterTls | None:
        given = {f: getattr(args, f, None) for f in ("cluster_ca", "cluster_cert", "cluster_key")}
        if not any(given.values()):
            return None
        missing = next((f for f, v in given.items() if not v), None)
        if missing is not None:
            raise InvalidArgument(f"--{missing.replace('_', '-')}",
                                  "--cluster-ca, --cluster-cert and --cluster-key go together")
        return cls(Path(given["cluster_ca"]), Path(given["cluster_cert"]),
                   Path(given["cluster_key"]))

    def argv(self) -> list[str]:
        return ["--cluster-ca", str(self.ca), "--cluster-cert", str(self.cert),
                "--cluster-key", str(self.key)]

    def identity(self) -> str | None:
        """The SPIFFE id this process's certificate names (its URI SAN), if it has one."""
        from cryptography import x509  # noqa: PLC0415 - only where certificates are read

        cert = x509.load_pem_x509_certificate(self.cert.read_bytes())
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            return None
        uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier)
                if u.startswith("spiffe://")]
        return uris[0] if len(uris) == 1 else None

    def check_role(self, role: str) -> None:
        """Refuse to start with another role's certificate (every call would be refused)."""
        identity = self.identity()
        if role_of(identity) != role:
            raise InvalidArgument("--cluster-cert", f"{self.cert} is for "
                                  f"{identity or 'no cluster role'}, not for a {role} "
                                  f"(`tandem certs` writes one certificate per role)")

    def channel_options(self, peer_role: str) -> list[tuple[str, object]]:
        """What a channel to a peer of `peer_role` needs beyond the credentials: the name its
        certificate must carry, checked in place of the address dialed."""
        return [("grpc.ssl_target_name_override", peer_name(peer_role))]

    def server_credentials(self) -> grpc.ServerCredentials:
        """Refuses, in the handshake, a client without a certificate the cluster CA signed."""
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.ca.read_bytes(), require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Trusts only servers the cluster CA signed, and presents this process's certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca.read_bytes(),
                                            private_key=self.key.read_bytes(),
                                            certificate_chain=self.cert.read_bytes())


def add_cluster_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster TLS (mutual TLS between router and workers)")
    g.add_argument("--cluster-ca", default=None, help="the cluster CA's certificate (PEM)")
    g.add_argument("--cluster-cert", default=None,
                   help="this process's certificate, signed by the cluster CA for its role "
                        "(PEM; `tandem certs` writes one per role)")
    g.add_argument("--cluster-key", default=None, help="its private key (PEM)")


def internal_channel(address: str, tls: ClusterTls | None,
                     options: Sequence[tuple[str, object]], peer_role: str) -> grpc.aio.Channel:
    """A channel to another process of the cluster, of role `peer_role`: mutual TLS when the
    cluster has a CA, and then only a peer whose certificate is for that role is accepted."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(),
                                   options=[*options, *tls.channel_options(peer_role)])


def bind(server: grpc.aio.Server, host: str, port: int,
         credentials: grpc.ServerCredentials | None = None) -> int:
    """Listen on host:port (0: a free port), with TLS when credentials are given; the port."""
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, credentials) if credentials is not None
             else server.add_insecure_port(address))
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    return bound


# -- public TLS ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PublicTls:
    """The router's certificate and key for its public ports (no client certificates asked)."""

    cert: Path
    key: Path

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PublicTls | None:
        cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
        if not cert and not key:
            return None
        if not (cert and key):
            raise InvalidArgument("--tls-key" if cert else "--tls-cert",
                                  "--tls-cert and --tls-key go together")
        for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
            if not Path(path).is_file():
                raise InvalidArgument(flag, f"no such file: {path}")
        return cls(Path(cert), Path(key))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])


# -- API keys ------------------------------------------------------------------------------------
class ApiKeys:
    """The keys a public port accepts. `tenant(header)` is the caller's tenant id (a hash of its
    key: the prefix-cache namespace) or None when the header carries no valid key."""

    def __init__(self, keys: Sequence[str]) -> None:
        if any(not k or k != k.strip() for k in keys):
            raise InvalidArgument("api_key", "keys must be non-empty, without surrounding spaces")
        self._digests = [hashlib.sha256(f"Bearer {k}".encode()).digest() for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def tenant(self, authorization: bytes | str | None) -> str | None:
        given = authorization.encode() if isinstance(authorization, str) else authorization
        # "Bearer <key>", the scheme in any case (RFC 7235), one or more spaces after it.
        scheme, _, token = (given or b"").partition(b" ")
        if scheme.lower() == b"bearer":
            given = b"Bearer " + token.lstrip(b" ")
        digest = hashlib.sha256(given or b"").digest()
        found = None
        for want in self._digests:  # every key compared: the time says nothing of which matched
            if hmac.compare_digest(digest, want):
                found = want
        return None if found is None else hashlib.sha256(b"tenant:" + found).hexdigest()[:32]


def load_api_keys(environ: Mapping[str, str] | None = None,
                  key_file: str | None = None) -> ApiKeys:
    """The keys from `key_file` (or $TANDEM_API_KEY_FILE) and $TANDEM_API_KEY; none: no auth."""
    env = os.environ if environ is None else environ
    keys = [env[API_KEY_ENV]] if env.get(API_KEY_ENV) else []
    path = key_file or env.get(API_KEY_FILE_ENV)
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise InvalidArgument("--api-key-file", f"cannot read {path}: {e.strerror}") from None
        keys += [ln.strip() for ln in text.splitlines() if ln.strip() and
                 not ln.strip().startswith("#")]
        if not keys:
            raise InvalidArgument("--api-key-file", f"{path} holds no key")
    return ApiKeys(keys)


class _RefuseApiKeyFlag(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("argument --api-key: keys are not taken on the command line (every user "
                     f"of the machine sees it); set ${API_KEY_ENV} or use --api-key-file")


def refuse_api_key_flag(p: argparse.ArgumentParser) -> None:
    """An explicit --api-key that exits 2 (without it argparse would take it as an
    abbreviation of --api-key-file)."""
    p.add_argument("--api-key", action=_RefuseApiKeyFlag, help=argparse.SUPPRESS)




class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """gRPC's side of the API key: `authorization: Bearer <key>` metadata on every call but
    health probes, else UNAUTHENTICATED before the servicer runs. The caller's tenant reaches
    the servicer through `tenant_of(context)`."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation: Callable[..., Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        service = details.method.rsplit("/", 2)[-2] if details.method.count("/") >= 2 else ""
        if handler is None or service in OPEN_GRPC_SERVICES:
            return handler
        md = dict(details.invocation_metadata or ())
        tenant = self.keys.tenant(md.get("authorization"))
        if tenant is None:
            return _refusing(handler, details.method)
        return _with_tenant(handler, tenant)


async def _unauthenticated(context: grpc.aio.ServicerContext, method: str) -> None:
    # Logged (and traced, by the tracing interceptors outside this one) like every refusal.
    log.warning("call done", call=method, outcome="refused", error_type="UNAUTHENTICATED",
                error="missing or incorrect API key")
    # With google.rpc.ErrorInfo, as every error of the public API (reason INVALID_API_KEY: the
    # HTTP API's code, invalid_api_key, in upper case).
    status = rpc_status.to_status(status_pb2.Status(
        code=grpc.StatusCode.UNAUTHENTICATED.value[0],
        message="missing or incorrect API key (send 'authorization: Bearer <key>' metadata)",
        details=[_packed(error_details_pb2.ErrorInfo(reason=UNAUTHENTICATED_REASON,
                                                     domain="tandem"))]))
    await context.abort(status.code, status.details, status.trailing_metadata)


def _packed(msg) -> any_pb2.Any:
    out = any_pb2.Any()
    out.Pack(msg)
    return out


def _refusing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        async def uu(request, context):
            await _unauthenticated(context, method)
        return grpc.unary_unary_rpc_method_handler(uu, **kw)
    if handler.unary_stream:
        async def us(request, context):
            await _unauthenticated(context, method)
            yield  # pragma: no cover - abort raises
        return grpc.unary_stream_rpc_method_handler(us, **kw)
    if handler.stream_unary:
        async def su(requests, context):
            await _unauthenticated(context, method)
        return grpc.stream_unary_rpc_method_handler(su, **kw)

    async def ss(requests, context):
        await _unauthenticated(context, method)
        yield  # pragma: no cover
    return grpc.stream_stream_rpc_method_handler(ss, **kw)


_TENANTS: dict[int, str] = {}


def _with_tenant(handler: grpc.RpcMethodHandler, tenant: str) -> grpc.RpcMethodHandler:
    """The handler, with the caller's tenant recorded for its context while it runs."""
    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        inner = handler.unary_unary

        async def uu(request, context):
            _TENANTS[id(context)] = tenant
            try:
                return await inner(request, context)
            finally:
                _TENANTS.pop(id(context), None)
        return grpc.unary_unary_rpc_method_handler(uu, **kw)
    if handler.unary_stream:
        inner_us = handler.unary_stream

        async def us(request, context):
            _TENANTS[id(context)] = tenant
            try:
                async for item in inner_us(request, context):
                    yield item
            finally:
                _TENANTS.pop(id(context), None)
        return grpc.unary_stream_rpc_method_handler(us, **kw)
    return handler  # no streaming-request method is tenant-scoped


def tenant_of(context: grpc.aio.ServicerContext) -> str:
    """The tenant of an authenticated call ("" when the port has no API key)."""
    return _TENANTS.get(id(context), "")
