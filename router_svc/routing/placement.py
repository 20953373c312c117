"""Per-request placement: a prompt prefilled on a prefill worker and its KV pulled by a decode
worker (disaggregated), or the whole request on that decode worker, which prefills the prompt
itself in chunks between its decode steps (local: the prefill fallback's path,
router_svc/orchestrator.py), whichever the request's measured costs favour.

The rule, over the prefill worker P and the decode worker D the routing policy picked (the
inputs every candidate's load poll and the router's KV index give; `Placement.inputs` keeps
them for the trace):

    uncached_P, uncached_D   prompt tokens neither the worker's prefix cache nor the host tier
                             it reads holds
    restore_P_s, restore_D_s = host_blocks * block_bytes / HOST_COPY_BANDWIDTH
                             (blocks copied back from the host tier instead of computed)
    pull_blocks              prompt blocks D does not cache (what a handoff moves)
    transfer_s = pull_blocks * block_bytes / bandwidth       (D's measured pulls, else the flag)

    disaggregated_s = P.queued * P.step_s + uncached_P * P.token_s + restore_P_s
                      + transfer_s + D.step_s
    local_s         = D.waiting * D.step_s + (D.backlog + uncached_D) * D.token_s + restore_D_s
    harm_local_s    = D.running * uncached_D * D.token_s      (each running sequence on D
    harm_disagg_s   = D.running * transfer_s                   waits that long for its tokens;
                                                               D.running: this router's
                                                               requests there plus other
                                                               routers' at D's last poll)

    local when   local_s + w * harm_local_s  <  disaggregated_s + w * harm_disagg_s

`D.backlog` is the prompt tokens this router already sent D to prefill itself that have not
streamed a first token yet: a burst of long prompts placed on an idle D waits behind each other,
which D's polls (a count of waiting requests, seconds old) do not show.
`step_s` is a worker's recent step time and `token_s` its recent seconds per prompt token
(Load.step_seconds, Load.prompt_token_seconds: runtime/step_pace.py). `w` weighs the delay a
placement adds to the decode worker's running requests against this request's own first token,
by SLO class (the request's priority: lower is more urgent):

    interactive (priority < 0)  w = 0: its own time to first token alone decides
    standard    (priority = 0)  w = --placement-interference (default 1)
    batch       (priority > 0)  w = 4 x that: its own wait matters least

Before that, in order (each a `reason`):
    short        uncached_D <= --placement-short-prompt tokens: local (Dynamo's conditional
                 disaggregation by length, counted after D's cached prefix, so a long
                 conversation whose earlier turns D holds is short too); 0: off
    unmeasured   P or D has not stepped yet (no step time): disaggregated, as without placement
then `cheaper_local` or `cheaper_disaggregated`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.router_svc.routing.policy import (
    DISAGGREGATED,
    LOCAL,
    Placement,
    PlacementInputs,
    RouteRequest,
    WorkerLoad,
)

__all__ = ["DISAGGREGATED", "LOCAL", "Placement", "PlacementInputs", "PlacementOptions", "place",
           "slo_class"]

# A configured bandwidth until a decode worker has measured its pulls: a conservative figure for
# one host's shared memory or a PCIe link (bytes per second).
DEFAULT_KV_BANDWIDTH = 5e9
BATCH_INTERFERENCE = 4.0  # a batch request's harm to others weighs this many times more
# Bytes per second of a host-tier block copied back into a worker's pool: about what a PCIe 4.0
# x16 link moves (a CPU worker's memcpy is faster: the estimate errs toward computing).
HOST_COPY_BANDWIDTH = 20e9


def slo_class(priority: int) -> str:
    """The request's SLO class, from its priority (SamplingParams.priority, lower first)."""
    return "interactive" if priority < 0 else "batch" if priority > 0 else "standard"


@dataclass(frozen=True)
class PlacementOptions:
    """The operator's knobs (`tandem router --placement-*`)."""

    short_prompt_tokens: int = 0  # uncached prompt tokens on D at or below which: local
    interference: float = 1.0  # w for the standard class
    kv_bandwidth: float = DEFAULT_KV_BANDWIDTH  # bytes/s, until D's pulls measure it
    kv_block_bytes: int = 0  # bytes of one KV block (all layers, K and V), until measured

    def __post_init__(self) -> None:
        if self.short_prompt_tokens < 0:
            raise ValueError("--placement-short-prompt must be >= 0, got "
                             f"{self.short_prompt_tokens}")
        if self.interference < 0:
            raise ValueError(f"--placement-interference must be >= 0, got {self.interference}")
        if not self.kv_bandwidth > 0:
            raise ValueError(f"--placement-kv-bandwidth must be > 0, got {self.kv_bandwidth}")
        if self.kv_block_bytes < 0:
            raise ValueError(f"kv_block_bytes must be >= 0, got {self.kv_block_bytes}")


def place(request: RouteRequest, prefill: WorkerLoad, decode: WorkerLoad, block_size: int,
          options: PlacementOptions) -> Placement:
    """Where `request` runs, given the prefill and decode workers a policy picked for it."""
    n = len(request.prompt)
    uncached_d = _uncached(n, decode, block_size)
    if uncached_d <= options.short_prompt_tokens:
        return Placement(LOCAL, "short")
    if not (prefill.step_seconds and prefill.prompt_token_seconds and decode.step_seconds
            and decode.prompt_token_seconds):
        return Placement(DISAGGREGATED, "unmeasured")
    inputs = _weigh(request, prefill, decode, block_size, options)
    local = inputs.local_s + inputs.weight * inputs.harm_local_s
    disagg = inputs.disaggregated_s + inputs.weight * inputs.harm_disaggregated_s
    if local < disagg:
        return Placement(LOCAL, "cheaper_local", inputs)
    return Placement(DISAGGREGATED, "cheaper_disaggregated", inputs)


def _weigh(request: RouteRequest, p: WorkerLoad, d: WorkerLoad, block_size: int,
           options: PlacementOptions) -> PlacementInputs:
    n = len(request.prompt)
    uncached_p, uncached_d = _uncached(n, p, block_size), _uncached(n, d, block_size)
    pull_blocks = max(0, -(-n // block_size) - d.cached_blocks)
    bandwidth = d.kv_bandwidth or options.kv_bandwidth
    block_bytes = d.kv_block_bytes or options.kv_block_bytes
    transfer_s = pull_blocks * block_bytes / bandwidth
    restore_p_s, restore_d_s = (w.host_blocks * block_bytes / HOST_COPY_BANDWIDTH for w in (p, d))
    running = d.requests  # polls lag; this router's count does not
    cls = slo_class(request.priority)
    weight = {"interactive": 0.0, "standard": options.interference,
              "batch": options.interference * BATCH_INTERFERENCE}[cls]
    return PlacementInputs(
        slo_class=cls, prompt_tokens=n, uncached_prefill_tokens=uncached_p,
        uncached_decode_tokens=uncached_d, pull_blocks=pull_blocks, transfer_s=transfer_s,
        host_blocks_p=p.host_blocks, host_blocks_d=d.host_blocks,
        disaggregated_s=(p.queued * p.step_seconds + uncached_p * p.prompt_token_seconds
                         + restore_p_s + transfer_s + d.step_seconds),
        local_s=(d.num_waiting * d.step_seconds
                 + (d.local_prefill_tokens + uncached_d) * d.prompt_token_seconds + restore_d_s),
        harm_local_s=running * uncached_d * d.prompt_token_seconds,
        harm_disaggregated_s=running * transfer_s, weight=weight)


def _uncached(n: int, w: WorkerLoad, block_size: int) -> int:
    """Prompt tokens worker `w` computes: past its cached and host-tier blocks (the last token
    always runs)."""
    return max(1, n - (w.cached_blocks + w.host_blocks) * block_size)
