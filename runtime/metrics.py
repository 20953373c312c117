"""A service's Prometheus metrics: names, labels and buckets as vLLM's (tandem: prefix), fed by
the engine core's step events on workers and by the router's requests; gauges and the engine's
own counters read its latest snapshot when Prometheus scrapes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from tandem.engine.sequence import SeqOutput, StepStats

# Buckets as vLLM's (vllm/v1/metrics/loggers.py), so dashboards carry over; inter-token latency
# adds sub-10 ms buckets for fast GPUs.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TRANSFER_SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25,
                            0.5, 1.0, 2.5, 5.0, 10.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TRANSFER_BYTES_BUCKETS = tuple(float(1 << s) for s in range(16, 36, 2))  # 64 KiB .. 16 GiB


class Metrics:
    """One service's Prometheus collectors, each labelled role (router, prefill, decode, both)
    and model_name. Counters and histograms are fed by the engine core's events (on_step, on_abort),
    the decode worker's KV pulls (kv_transfer) and the router (RouterRequest); gauges and the
    engine's own counters are read at scrape time."""

    def __init__(self, role: str, model_name: str) -> None:
        self.role = role
        self.model_name = model_name
        self.registry = CollectorRegistry()
        for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(c)
        labels, values = ("role", "model_name"), (role, model_name)
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tandem:{name}", doc, labels, registry=reg).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tandem:{name}", doc, labels, registry=reg).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tandem:{name}", doc, labels, registry=reg,
                             buckets=buckets).labels(*values)

        self.running = gauge("num_requests_running",
                             "Sequences running (router: requests streaming tokens)")
        self.waiting = gauge("num_requests_waiting",
                             "Sequences waiting to be scheduled (router: requests before their "
                             "first token)")
        self.prompt_tokens = counter("prompt_tokens",
                                     "Prompt tokens of requests whose first token was sampled "
                                     "here (router: of every request)")
        self.generation_tokens = counter("generation_tokens",
                                         "Tokens sampled here (router: tokens sent to clients)")
        self._success = Counter("tandem:request_success",
                                "Finished samples, by finish reason (stop, length, abort, error; "
                                "prefill: handoff)",
                                (*labels, "finished_reason"), registry=reg)
        self._success_by_reason: dict[str, Counter] = {}
        self.ttft = histogram("time_to_first_token_seconds",
                              "From a request's arrival here to its first token (router: sent to "
                              "the client; prefill: sampled; decode: the first one generated "
                              "here)", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Between consecutive decode steps (one sample per step; every "
                             "sequence in the step waited this long for its token)", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "From a request's arrival here to its end", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "From a request's arrival to its first scheduling (decode: "
                                    "admission with blocks for its KV)", REQUEST_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total",
                                          "Tokens one engine step computed (prompt chunks and "
                                          "decodes); its count is the number of steps that ran "
                                          "the model", ITERATION_TOKENS_BUCKETS)
        self.kv_transfer_seconds = histogram("kv_transfer_seconds",
                                             "One request's KV pull, copy waited for",
                                             TRANSFER_SECONDS_BUCKETS)
        self.kv_transfer_bytes = histogram("kv_transfer_bytes", "Bytes of one request's KV pull",
                                           TRANSFER_BYTES_BUCKETS)
        self.kv_lease_renewals = counter("kv_lease_renewals",
                                         "Prefill leases this decode worker renewed while their "
                                         "requests waited for the pull (a busy worker, a slow "
                                         "link)")
        self.kv_leases_lost = counter("kv_leases_lost",
                                      "Leases this decode worker held that their prefill worker "
                                      "no longer had when renewed (expired or restarted)")
        self.live_migrations = counter("live_migrations_in",
                                       "Running requests moved to this decode worker by "
                                       "pulling their KV from another (live migration)")
        self.migrated_blocks = counter("kv_blocks_migrated",
                                       "KV blocks those live migrations pulled")
        self._engine = _EngineCounters(labels, values)
        reg.register(self._engine)
        self._last_step_end: float | None = None
        self._http: Any = None

    # -- wiring --------------------------------------------------------------------------------
    def bind_engine(self, snapshot: Callable[[], Any]) -> None:
        """Worker: gauges and the engine's counters read its latest snapshot when scraped. The
        KV-cache gauge exists only here: the router has no KV cache (a 0 from it would read as an
        idle one)."""
        self._engine.snapshot = snapshot
        self.running.set_function(lambda: snapshot().num_running)
        self.waiting.set_function(lambda: snapshot().num_waiting)
        self.kv_cache_usage = Gauge(
            "tandem:kv_cache_usage_perc",
            "KV-cache usage: share of blocks in use, 0 to 1 (leased blocks count as used)",
            ("role", "model_name"), registry=self.registry).labels(self.role, self.model_name)
        self.kv_cache_usage.set_function(
            lambda: 1.0 - snapshot().num_free_blocks / max(1, snapshot().num_blocks))

    def watch_leases(self, pinned: Callable[[], dict[str, int]]) -> None:
        """Prefill worker: the blocks each holder's claimed leases pin (`pinned()`: holder ->
        blocks), read when scraped."""
        self.registry.register(_LeasedBlocks(pinned, self.role, self.model_name))

    def watch_engine_core(self, pid: int) -> None:
        """Worker: the engine core's CPU time, memory and open files, as
        tandem_engine_core_process_* (process_* describe the gRPC process only)."""
        ProcessCollector(namespace="tandem_engine_core", pid=lambda: pid, registry=self.registry)

    def serve(self, host: str, port: int, *, any_port: bool = False) -> int:
        """Serve /metrics on its own port (a thread), for workers; 0: off, unless any_port
        (then a free one). Returns the port served on (0: none)."""
        if not (port or any_port):
            return 0
        from prometheus_client import start_http_server  # noqa: PLC0415

        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def exposition(self) -> tuple[bytes, str]:
        """The text format and its content type, for a /metrics route."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # -- engine events -------------------------------------------------------------------------
    def on_step(self, step: StepStats | None, outputs: list[SeqOutput], end: float) -> None:
        """AsyncEngine's hook, after every step: its statistics, its outputs that are more than
        new tokens (the finished ones among them), and when it ended (the core's
        time.perf_counter(), one clock host-wide)."""
        if step is not None:
            if step.num_seqs:
                self.iteration_tokens.observe(step.num_tokens)
            if step.num_prompt_tokens:
                self.prompt_tokens.inc(step.num_prompt_tokens)
            if step.num_sampled:
                self.generation_tokens.inc(step.num_sampled)
            # A sequence decoding in this step got its previous token at the end of the last
            # step (it was scheduled then: a pull or prefill step comes first after an idle).
            if step.num_decodes and self.role != "prefill" and self._last_step_end is not None:
                self.itl.observe(end - self._last_step_end)
        self._last_step_end = end
        for o in outputs:
            if o.finish_reason is not None:
                self.finished(o.finish_reason.value, o)

    def on_abort(self, num_samples: int) -> None:
        """AsyncEngine's hook: samples ended by an abort (client gone, cancelled leg)."""
        self.success("abort", num_samples)

    def finished(self, reason: str, out: SeqOutput | None = None) -> None:
        self.success(reason)
        t = out.timing if out is not None else None
        if t is None:
            return
        if out.sample_index == 0:  # request-level: once per request
            if t.queue_s is not None:
                self.queue_time.observe(t.queue_s)
            if t.first_token_s is not None:
                self.ttft.observe(t.first_token_s)
        self.e2e.observe(t.e2e_s)

    def success(self, reason: str, n: int = 1) -> None:
        c = self._success_by_reason.get(reason)
        if c is None:
            c = self._success_by_reason[reason] = self._success.labels(
                self.role, self.model_name, reason)
        c.inc(n)


class _EngineCounters:
    """Prefix-cache and preemption counters, read from the engine's snapshot when scraped.
    Prefix-cache figures are in tokens, as vLLM's (the block pool counts blocks)."""

    def __init__(self, labels: tuple[str, ...], values: tuple[str, ...]) -> None:
        self.labels, self.values = list(labels), list(values)
        self.snapshot: Callable[[], Any] | None = None

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        if self.snapshot is None:
            return
        s = self.snapshot()
        for name, doc, value in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 s.prefix_queries * s.block_size),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache",
                 s.prefix_hits * s.block_size),
                ("num_preemptions", "Sequences preempted (blocks ran out)", s.num_preemptions),
                ("spec_decode_num_draft_tokens", "Draft tokens scored by speculative decoding",
                 s.spec_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens the model accepted",
                 s.spec_accepted_tokens),
                ("spec_decode_num_backoffs", "Times a sample stopped speculating for low "
                 "acceptance", s.spec_backoffs),
                ("spec_decode_num_backoff_steps", "Steps samples sat out speculation for low "
                 "acceptance", s.spec_backoff_steps)):
            family = CounterMetricFamily(f"tandem:{name}", doc, labels=self.labels)
            family.add_metric(self.values, value)
            yield family
        if s.host_kv_capacity_bytes:
            yield from self._host_tier(s)
        if s.spec_draft_blocks:
            family = GaugeMetricFamily("tandem:spec_decode_draft_kv_usage_perc", "Fraction of "
                                       "the draft model's KV blocks in use", labels=self.labels)
            family.add_metric(self.values, s.spec_draft_blocks_used / s.spec_draft_blocks)
            yield family
        # Per draft position: the acceptance rate at j is accepted[j] / drafted[j].
        for name, doc, counts in (
                ("spec_decode_num_drafts_per_pos", "Drafts scored at each draft position",
                 s.spec_drafted_at),
                ("spec_decode_num_accepted_per_pos", "Drafts accepted at each draft position",
                 s.spec_accepted_at)):
            if counts:
                family = CounterMetricFamily(f"tandem:{name}", doc,
                                             labels=[*self.labels, "position"])
                for j, value in enumerate(counts):
                    family.add_metric([*self.values, str(j)], value)
                yield family


    def _host_tier(self, s: Any) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """The host KV tier's figures (engine/host_kv_tier.py), where the engine has one:
        hits and misses in prompt tokens, as the prefix cache's."""
        for name, doc, value in (
                ("host_kv_cache_hits", "Prompt tokens copied back from the host KV tier",
                 s.host_kv_hits * s.block_size),
                ("host_kv_cache_misses", "Prompt tokens looked up in the host KV tier and "
                 "found in neither tier", s.host_kv_misses * s.block_size),
                ("host_kv_cache_evictions", "Blocks dropped from the host KV tier to make "
                 "room", s.host_kv_evictions)):
            family = CounterMetricFamily(f"tandem:{name}", doc, labels=self.labels)
            family.add_metric(self.values, value)
            yield family
        for name, doc, value in (
                ("host_kv_cache_usage_bytes", "Bytes of KV held in the host tier",
                 s.host_kv_bytes_used),
                ("host_kv_cache_capacity_bytes", "Size of the host KV tier (its flag)",
                 s.host_kv_capacity_bytes),
                ("host_kv_cache_allocated_bytes", "Host memory the host KV tier has taken "
                 "(never above its size)", s.host_kv_bytes_allocated)):
            family = GaugeMetricFamily(f"tandem:{name}", doc, labels=self.labels)
            family.add_metric(self.values, value)
            yield family


class _LeasedBlocks:
    """tandem:kv_leased_blocks{holder}: blocks pinned by claimed leases, per holder (the
    claimer's certificate identity; "" without cluster TLS)."""

    def __init__(self, pinned: Callable[[], dict[str, int]], role: str, model: str) -> None:
        self.pinned, self.role, self.model = pinned, role, model

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("tandem:kv_leased_blocks", "KV blocks pinned by prefill "
                                   "leases a decode worker claimed, per claimer (its "
                                   "certificate's identity; empty without cluster TLS)",
                                   labels=["role", "model_name", "holder"])
        for holder, blocks in sorted(self.pinned().items()):
            family.add_metric([self.role, self.model, holder], blocks)
        yield family
