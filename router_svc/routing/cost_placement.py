"""`cost-placement`: prefix affinity's picks, and each disaggregated request placed by its
measured costs: prefilled on the prefill worker and pulled by the decode worker, or wholly on
the decode worker, which prefills it itself (the rule: router_svc/routing/placement.py; its
knobs: `tandem router --placement-*`). A short prompt, or one whose prefix the decode worker
already caches, then never waits on a prefill worker's queue or a KV transfer; a long one on a
decode worker busy with many sequences still goes to a prefill worker.
"""

from __future__ import annotations

from tandem.router_svc.routing.placement import PlacementOptions, place
from tandem.router_svc.routing.policy import Placement, RouteRequest, WorkerLoad
from tandem.router_svc.routing.prefix_affinity import PrefixAffinity


class CostPlacement(PrefixAffinity):
    name = "cost-placement"
    summary = ("prefix affinity, and each request prefilled on a prefill worker or wholly on "
               "its decode worker, whichever its measured costs favour (--placement-*)")
    places = True

    def __init__(self, balance_slack: int = 4,
                 placement: PlacementOptions | None = None) -> None:
        super().__init__(balance_slack)
        self.options = placement or PlacementOptions()

    def place(self, request: RouteRequest, prefill: WorkerLoad, decode: WorkerLoad,
              block_size: int) -> Placement:
        return place(request, prefill, decode, block_size, self.options)
