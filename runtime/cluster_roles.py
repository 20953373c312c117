"""Who is who inside a cluster, and who may call what on a worker.

Every process of a cluster with mutual TLS holds a certificate the cluster CA signed for one
role, naming it twice (cli/certs.py makes them):

    URI SAN  spiffe://tandem/<role>/<name>   who the holder is: a worker checks it on every call
    DNS SAN  <role>.tandem.internal          what a caller checks: the channel to a prefill
                                             worker accepts only a certificate naming
                                             prefill.tandem.internal, whatever address it dials

A worker checks each call's caller against WORKER_CALLERS, the one table of who may call which
RPC (RoleInterceptor, before the servicer runs); a caller checks, in the TLS handshake, that the
peer holds the role it dialed for (peer_name). So a decode worker takes decode requests only from
a router, and maps a pool only from a process that proved, with its key, to be a prefill worker.

Without cluster TLS there are no identities: every process that can connect may call anything.
Workers then say so at start and listen on loopback alone unless started with --insecure.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import grpc

from tandem.errors import InvalidArgument

TRUST_DOMAIN = "tandem"
ROLES = ("router", "prefill", "decode", "both")
WORKER_ROLES = ("prefill", "decode", "both")
_NAME_SUFFIX = f".{TRUST_DOMAIN}.internal"

ROUTER, PREFILL, DECODE = "router", "prefill", "decode"
# Not a role: a caller of the worker's own role. A pod's preStop hook (`tandem drain`) runs
# with its own certificate, the one its worker holds.
SELF = "self"
# Who may call each RPC of tandem.v1.Worker (worker.proto), by the caller's role. The router
# drives every worker, asks one to lend a cached prefix, and releases a lease it could not hand
# on; a decode worker registers with prefill workers, and with decode workers whose running
# requests move to it (live migration), and claims, renews and releases the leases the router
# handed it; a prefill worker registers with, claims and releases (never renews) a lease on a
# cached prefix another worker lent (LendPrefix: the router handed it that lease), as a decode
# worker does; a worker is drained by a router or from its own pod, and changes role (an
# elastic stack's) on a router certificate's word alone. Nobody else calls a worker; a method
# missing here is refused to everyone.
WORKER_CALLERS: Mapping[str, frozenset[str]] = {
    "Prefill": frozenset({ROUTER}),
    "Stream": frozenset({ROUTER}),
    "Abort": frozenset({ROUTER}),
    "GetLoad": frozenset({ROUTER}),
    "WatchKV": frozenset({ROUTER}),
    "LendPrefix": frozenset({ROUTER}),
    "Register": frozenset({PREFILL, DECODE}),
    "ClaimLease": frozenset({PREFILL, DECODE}),
    "RenewLeases": frozenset({DECODE}),
    "Release": frozenset({ROUTER, PREFILL, DECODE}),
    "Drain": frozenset({ROUTER, SELF}),
    "Move": frozenset({ROUTER, SELF}),
    "SwitchRole": frozenset({ROUTER}),
}
# Services any cluster identity may call: health (probes run with the pod's own certificate)
# and, when a worker enables it, reflection.
OPEN_TO_CLUSTER = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")
WORKER_SERVICE = "tandem.v1.Worker"


def spiffe_id(role: str, name: str | None = None) -> str:
    if role not in ROLES:
        raise InvalidArgument("role", f"one of {', '.join(ROLES)}, got {role!r}")
    return f"spiffe://{TRUST_DOMAIN}/{role}/{name or role}"


def role_of(identity: str | None) -> str | None:
    """The role a SPIFFE id names (spiffe://tandem/<role>/<name>), None for anything else."""
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    if not identity or not identity.startswith(prefix):
        return None
    role = identity[len(prefix):].split("/", 1)[0]
    return role if role in ROLES else None


def peer_name(role: str) -> str:
    """The DNS name a certificate of `role` carries, which callers of that role check."""
    return f"{role}{_NAME_SUFFIX}"


def caller_identity(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's SPIFFE id, from the certificate it presented (None on a plaintext port, or
    for a certificate without exactly one)."""
    ids = context.auth_context().get("peer_spiffe_id")
    return ids[0].decode() if ids else None


def allowed(method: str, role: str | None, own_role: str | None = None) -> bool:
    """Whether a caller of `role` may call `method` (/package.Service/Method) on a worker of
    `own_role`."""
    service, name = _service(method), method.rsplit("/", 1)[-1]
    if service in OPEN_TO_CLUSTER:
        return True
    if service != WORKER_SERVICE or role is None:
        return False
    callers = WORKER_CALLERS.get(name, frozenset())
    return role in callers or (SELF in callers and role == own_role)


def _service(method: str) -> str:
    parts = method.split("/")
    return parts[1] if len(parts) == 3 and not parts[0] else ""


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """A worker's side of the roles: every call's caller, as its certificate names it, checked
    against WORKER_CALLERS before the servicer runs; PERMISSION_DENIED otherwise. For servers
    with cluster TLS (the handshake already refused anyone the cluster CA did not sign).
    `role`: the worker's own (SELF in the table)."""

    def __init__(self, role: str | None = None) -> None:
        self.role = role

    async def intercept_service(self, continuation: Callable[..., Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or _service(details.method) in OPEN_TO_CLUSTER:
            return handler  # unknown methods: gRPC answers UNIMPLEMENTED
        return _checked(handler, details.method, self.role)


def _checked(handler: grpc.RpcMethodHandler, method: str,
             own_role: str | None = None) -> grpc.RpcMethodHandler:
    """`handler`, run only once the caller's role is allowed `method` (the caller is known from
    the call's context, which the interceptor itself never sees)."""

    async def deny(context: grpc.aio.ServicerContext) -> bool:
        identity = caller_identity(context)
        if allowed(method, role_of(identity), own_role):
            return False
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"{method.rsplit('/', 1)[-1]} is not for "
                            f"{identity or 'a certificate without a cluster role'}")
        return True

    return _guarded(handler, deny)


def _guarded(handler: grpc.RpcMethodHandler,
             deny: Callable[[grpc.aio.ServicerContext], Awaitable[bool]]
             ) -> grpc.RpcMethodHandler:
    """`handler` of any of gRPC's four kinds, preceded by `deny(context)`, which ends the call
    (context.abort) when it must not run."""
    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        uu_inner = handler.unary_unary

        async def uu(request, context):
            if not await deny(context):
                return await uu_inner(request, context)
        return grpc.unary_unary_rpc_method_handler(uu, **kw)
    if handler.unary_stream:
        us_inner = handler.unary_stream

        async def us(request, context):
            if not await deny(context):
                async for item in us_inner(request, context):
                    yield item
        return grpc.unary_stream_rpc_method_handler(us, **kw)
    if handler.stream_unary:
        su_inner = handler.stream_unary

        async def su(requests, context):
            if not await deny(context):
                return await su_inner(requests, context)
        return grpc.stream_unary_rpc_method_handler(su, **kw)
    ss_inner = handler.stream_stream

    async def ss(requests, context):
        if not await deny(context):
            async for item in ss_inner(requests, context):
                yield item
    return grpc.stream_stream_rpc_method_handler(ss, **kw)
