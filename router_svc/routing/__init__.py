"""Routing policies, by name: the one list. `tandem router --routing-policy` takes its choices
from POLICIES; a policy is added as one module here and one entry below (docs/architecture.md,
"How to add a routing policy")."""

from __future__ import annotations

from tandem.errors import InvalidArgument
from tandem.router_svc.routing.cost_placement import CostPlacement
from tandem.router_svc.routing.least_loaded import LeastLoaded
from tandem.router_svc.routing.placement import PlacementOptions
from tandem.router_svc.routing.policy import Placement, RouteRequest, RoutingPolicy, WorkerLoad
from tandem.router_svc.routing.prefix_affinity import PrefixAffinity

POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (PrefixAffinity, LeastLoaded, CostPlacement)}
DEFAULT_POLICY = PrefixAffinity.name

__all__ = ["DEFAULT_POLICY", "POLICIES", "Placement", "PlacementOptions", "RouteRequest",
           "RoutingPolicy", "WorkerLoad", "make_policy"]


def make_policy(name: str = DEFAULT_POLICY,
                placement: PlacementOptions | None = None) -> RoutingPolicy:
    """A fresh policy registered as `name` (with its defaults); `placement`: the knobs of a
    policy that places requests (RoutingPolicy.places), refused for one that does not."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise InvalidArgument("--routing-policy", f"unknown policy {name!r} (known: "
                              f"{', '.join(sorted(POLICIES))})") from None
    if placement is None or placement == PlacementOptions():
        return cls() if not cls.places else cls(placement=placement)
    if not cls.places:
        raise InvalidArgument("--routing-policy", f"{name!r} places no request: the "
                              "--placement-* flags need a policy that does (cost-placement)")
    return cls(placement=placement)
