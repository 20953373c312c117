"""A worker changing role in place: SwitchRole, an elastic stack's role change (cli/supervisor.py).

Changing role by restarting costs what starting costs: on a GPU, loading the model, compiling
its kernels and capturing its CUDA graphs, pinning a host KV tier (about 20 s for an 8B model),
plus the old process's exit. None of that depends on the role: it all lives in the engine core
(engine/serving/engine_core.py). So the core stays, and only what the worker shows for its role
is remade, between a drain and the old port's close:

    SwitchRole(decode) ─▶ checked: refused FAILED_PRECONDITION with nothing drained when this
                          worker cannot change in place (`refusal`); the caller restarts it
      ─▶ drained as Drain does (its port NOT_SERVING, its requests moved or finished, its
         leases released or expired)
      ─▶ the engine core switches (idle: a new, empty handoff; the model, the KV pool with its
         prefix cache, the host tier kept)
      ─▶ a new front (runtime/worker.py RoleFront): the new role's servicer on a gRPC server of
         its own, on a new port, with the role's certificate; its metrics labelled with the
         role; its prefix-cache set (WatchKV) the old front's
      ─▶ SwitchRole answered with the new address ─▶ the old port closes

To routers and other workers the new front is a new worker (new address, worker id and instance
id), as a restarted one is, so every state peers key by address (the role it was dialed as, the
TLS name its channel checks, its load) stays true. What moves with it is its KV pool: a decode
worker that mapped it under the old address takes it under the new one when the pool's owner
listens there, which it checks on this host (decode_svc/server.py); so a worker changes role in
place only when it listens on loopback, and only with a pool of its device's default
transport (one that serves the pool without the worker's certificate).

The servicer asks (`PendingSwitch`), the run loop does it (runtime/worker.py `change_role`):
one owner each side. The process's logs and traces keep the service name it started with.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.errors import InvalidArgument
from tandem.kvtransfer import transports
from tandem.runtime.cluster_roles import role_of
from tandem.runtime.security import ClusterTls

if TYPE_CHECKING:
    from tandem.engine.serving.async_engine import AsyncEngine

ROLES = ("prefill", "decode")  # the roles that trade places


@dataclass(frozen=True)
class RoleOptions:
    """A role a worker process can serve: its servicer, and its engine core's settings."""

    name: str  # prefill, decode, both
    # (engine, worker id, address) -> the role's WorkerServicer
    make_servicer: Callable[[Any, str, str], Any]
    transport: str | None = None  # prefill: how peers map its pool (None: the device's default)
    lease_ttl_s: float = 30.0
    lease_max_life_s: float | None = None


@dataclass(frozen=True)
class Switched:
    """A role change done: where the new role serves."""

    address: str
    worker_id: str
    seconds: float  # from drained to the new port serving


class SwitchFailed(Exception):
    """The worker drained but could not take the new role: it stops (exits 0, drained)."""


@dataclass(frozen=True)
class PendingSwitch:
    """One SwitchRole call: the servicer waits on `result`, the worker's run loop sets it."""

    role: str
    result: asyncio.Future[Switched]


def add_switch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("role change in place (SwitchRole; `tandem up --elastic`)")
    g.add_argument("--cluster-switch-cert", default=None,
                   help="a certificate of the other worker role (prefill or decode), signed by "
                        "the same cluster CA: with it this worker may change role in place")
    g.add_argument("--cluster-switch-key", default=None, help="its private key (PEM)")


def role_certificates(args: argparse.Namespace, tls: ClusterTls | None,
                      role: str) -> dict[str, ClusterTls]:
    """The certificates this worker holds, by role: its own, and the other worker role's from
    --cluster-switch-cert and --cluster-switch-key (checked: bad flags fail before the engine
    loads). Empty without cluster TLS, where no role is proven."""
    cert, key = getattr(args, "cluster_switch_cert", None), getattr(args, "cluster_switch_key", None)
    if (cert is None) != (key is None):
        raise InvalidArgument("--cluster-switch-cert", "goes with --cluster-switch-key")
    if tls is None:
        if cert is not None:
            raise InvalidArgument("--cluster-switch-cert", "needs cluster TLS (--cluster-ca, "
                                  "--cluster-cert, --cluster-key)")
        return {}
    certs = {role: tls}
    if cert is not None:
        other = ClusterTls(tls.ca, Path(cert), Path(key))
        switch_to = role_of(other.identity())
        if switch_to not in ROLES or switch_to == role or role not in ROLES:
            raise InvalidArgument("--cluster-switch-cert", f"{cert} is for {other.identity()}: "
                                  f"a {role} worker changes role to "
                                  f"{' or '.join(r for r in ROLES if r != role) or 'nothing'}")
        certs[switch_to] = other
    return certs


class SwitchChecks:
    """What this worker process may switch to (`refusal`): SwitchRole asks before draining."""

    def __init__(self, engine: AsyncEngine, roles: Mapping[str, RoleOptions],
                 certs: Mapping[str, ClusterTls], *, tls: bool, loopback: bool) -> None:
        self.engine = engine
        self.roles = dict(roles)  # every role this process may serve, its first one too
        self.certs = dict(certs)
        self.tls = tls  # cluster TLS: a role needs its certificate
        self.loopback = loopback  # the worker's --host

    def refusal(self, current: str, role: str) -> str | None:
        """Why this worker, serving `current`, cannot serve `role` in place; None if it can."""
        if current not in ROLES:
            return "a colocated worker does not change role"
        if role == current:
            return f"it is a {role} worker already"
        if role not in self.roles:
            return (f"its role is fixed: it was started as `tandem {current}` "
                    f"(`tandem worker --role {current}` may change role)")
        if self.tls and role not in self.certs:
            return (f"it holds no certificate for the {role} role (--cluster-switch-cert, "
                    "--cluster-switch-key)")
        if self.engine.dead:
            return "its engine core is gone"
        config = self.engine.spec.config
        if config.speculative_method is not None:
            return "it runs speculative decoding (a prefill engine loads no proposer)"
        default = transports.default_for(config.device)
        pool = self.engine.spec.transport or default
        wanted = self.roles[role].transport or default
        if pool != default or wanted != default:
            return (f"its KV pool is on {pool} and the {role} role wants {wanted}: in place, "
                    f"only a pool on its device's default transport ({default}) changes role")
        if not self.loopback:
            return ("it does not listen on loopback: decode workers that mapped its KV pool "
                    "take it at a new address once they see its owner listen there, which they "
                    "check on this host only")
        return None
