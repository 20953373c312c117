"""Routing policies, by name: the one list. `tandem router --routing-policy` takes its choices
from POLICIES; a policy is added as one module here and one entry below (docs/architecture.md,
"How to add a routing policy")."""

from __future__ import annotations

from tandem.errors import InvalidArgument
from tandem.router_svc.routing.least_loaded import LeastLoaded
from tandem.router_svc.routing.policy import RouteRequest, RoutingPolicy, WorkerLoad
from tandem.router_svc.routing.prefix_affinity import PrefixAffinity

POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (PrefixAffinity, LeastLoaded)}
DEFAULT_POLICY = PrefixAffinity.name

__all__ = ["DEFAULT_POLICY", "POLICIES", "RouteRequest", "RoutingPolicy", "WorkerLoad",
           "make_policy"]


def make_policy(name: str = DEFAULT_POLICY) -> RoutingPolicy:
    """A fresh policy registered as `name` (with its defaults)."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidArgument("--routing-policy", f"unknown policy {name!r} (known: "
                              f"{', '.join(sorted(POLICIES))})") from None
