"""Prometheus metrics of router, prefill and decode (separate processes), scraped during and after
a load: counters move by exactly what was sent, finish reasons are counted, prefix-cache hits
show when prompts share a prefix, and the gauges return to zero when idle."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster, Proc
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2

WORKER_ARGS = ["--num-blocks", "256", "--max-num-batched-tokens", "64"]
BLOCK_BYTES = 2 * 2 * 16 * 2 * 64 * 4  # layers x (K, V) x block x kv heads x head dim x fp32
NAMES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
         "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
         "generation_tokens", "request_success", "time_to_first_token_seconds",
         "inter_token_latency_seconds", "e2e_request_latency_seconds",
         "request_queue_time_seconds", "kv_transfer_seconds", "kv_transfer_bytes",
         "kv_lease_renewals", "kv_leases_lost", "iteration_tokens_total"]
# Only where an engine runs: the router has no KV cache (its 0.0 would read as an idle one).
ENGINE_ONLY = {"prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
               "kv_cache_usage_perc"}


class Scrape:
    def __init__(self, proc: Proc) -> None:
        text = httpx.get(proc.metrics_url, timeout=5).text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def __call__(self, sample: str, **labels: str) -> float:
        """The sum of the samples named `sample` whose labels include `labels`."""
        return sum(s.value for f in self.families.values() for s in f.samples
                   if s.name == sample and labels.items() <= s.labels.items())

    def delta(self, before: Scrape, sample: str, **labels: str) -> float:
        return self(sample, **labels) - before(sample, **labels)


def scrape_all(c: Cluster) -> dict[str, Scrape]:
    return {name: Scrape(p) for name, p in c.procs.items()}


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("metrics"), str(tiny_models["llama"]),
                worker_args=WORKER_ARGS, metrics=True).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


async def until(scrape, missing, timeout: float = 60.0):
    """Scrape until `missing` (what the scrape still lacks: falsy once it is all there) has
    nothing to say; the last scrape. A deadline only fails the test, with what was missing,
    instead of hanging it."""
    deadline = time.monotonic() + timeout
    while True:
        s = scrape()
        lacks = missing(s)
        if not lacks:
            return s
        assert time.monotonic() < deadline, lacks
        await asyncio.sleep(0.05)


def request(prompt: list[int], params: SamplingParams) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                   params=params_to_proto(params))


async def generate(stub, prompt: list[int], params: SamplingParams):
    tokens, reasons = [], []
    async for r in stub.Generate(request(prompt, params)):
        tokens += r.token_ids
        if r.finish_reason:
            reasons.append(r.finish_reason)
    return tokens, reasons, r.usage


def run(c: Cluster, jobs):
    async def main():
        async with grpc.aio.insecure_channel(c.router.address) as ch:
            stub = c.api(ch)
            return await asyncio.gather(*(generate(stub, p, params) for p, params in jobs))

    return asyncio.run(main())


def test_every_service_exports_the_vllm_names_with_its_role(cluster):
    for name, s in scrape_all(cluster).items():
        role = name.rstrip("0123456789")
        expected = [n for n in NAMES if role != "router" or n not in ENGINE_ONLY]
        missing = [n for n in expected if f"tandem:{n}" not in s.families]
        assert not missing, (name, missing)
        if role == "router":
            assert not [n for n in ENGINE_ONLY if f"tandem:{n}" in s.families], name
        for n in expected:
            for sample in s.families[f"tandem:{n}"].samples:
                assert sample.labels["role"] == role, (name, sample)
        if role != "router":  # the engine core's process, beside the worker's own
            core_cpu = s.families["tandem_engine_core_process_cpu_seconds"].samples[0].value
            assert core_cpu > 0 and s.families[
                "tandem_engine_core_process_resident_memory_bytes"].samples[0].value > 10 << 20


def test_counters_move_by_what_was_sent(cluster):
    prompts = [[(31 * i + 7 * j) % 500 + 1 for j in range(9 + 13 * i)] for i in range(8)]
    lengths = [4 + 3 * i for i in range(8)]
    jobs = [(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, lengths)]
    # One more that ends at a stop token: greedy, so the token it stops at is known beforehand.
    stop_prompt = [(11 * j) % 400 + 3 for j in range(40)]
    (greedy, _, _), = run(cluster, [(stop_prompt, SamplingParams(temperature=0, max_tokens=12,
                                                                 ignore_eos=True))])
    k = next(i for i in range(2, 12) if greedy[i] not in greedy[:i])
    jobs.append((stop_prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                             stop_token_ids=[greedy[k]])))
    asyncio.run(cluster.wait_idle())
    before = scrape_all(cluster)

    results = run(cluster, jobs)
    asyncio.run(cluster.wait_idle())
    after = scrape_all(cluster)

    assert [len(t) for t, _, _ in results] == [*lengths, k + 1]
    assert [r for _, r, _ in results] == [["length"]] * 8 + [["stop"]]
    n = len(jobs)
    sent_prompt = sum(len(p) for p, _ in jobs)
    generated = sum(u.completion_tokens for _, _, u in results)
    r, p, d = after["router"], after["prefill0"], after["decode0"]
    rb, pb, db = before["router"], before["prefill0"], before["decode0"]

    assert r.delta(rb, "tandem:prompt_tokens_total") == sent_prompt
    assert r.delta(rb, "tandem:generation_tokens_total") == generated
    assert r.delta(rb, "tandem:request_success_total", finished_reason="length") == 8
    assert r.delta(rb, "tandem:request_success_total", finished_reason="stop") == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert r.delta(rb, f"tandem:{hist}_count") == n, hist

    # Prefill: every prompt, and the first token of each request.
    assert p.delta(pb, "tandem:prompt_tokens_total") == sent_prompt
    assert p.delta(pb, "tandem:generation_tokens_total") == n
    assert p.delta(pb, "tandem:request_success_total", finished_reason="handoff") == n
    for hist in ("request_queue_time_seconds", "time_to_first_token_seconds",
                 "e2e_request_latency_seconds"):
        assert p.delta(pb, f"tandem:{hist}_count") == n, hist
    queried = sum((len(q) - 1) // 16 * 16 for q, _ in jobs)
    assert p.delta(pb, "tandem:prefix_cache_queries_total") == queried
    # No two prompts share a block; the stop prompt's blocks are cached from its greedy run.
    assert p.delta(pb, "tandem:prefix_cache_hits_total") == (len(stop_prompt) - 1) // 16 * 16
    # Steps computed every prompt token not found in the cache, in chunks of at most 64.
    computed = sent_prompt - (len(stop_prompt) - 1) // 16 * 16
    assert p.delta(pb, "tandem:iteration_tokens_total_sum") == computed
    assert p.delta(pb, "tandem:iteration_tokens_total_count") >= -(-computed // 64)

    # Decode: the rest of the tokens, one KV pull per request.
    assert d.delta(db, "tandem:prompt_tokens_total") == 0
    assert d.delta(db, "tandem:generation_tokens_total") == generated - n
    assert d.delta(db, "tandem:request_success_total", finished_reason="length") == 8
    assert d.delta(db, "tandem:request_success_total", finished_reason="stop") == 1
    assert d.delta(db, "tandem:kv_transfer_seconds_count") == n
    # Every prompt's blocks but the stop prompt's full ones, which the decode worker's own
    # prefix cache holds from the greedy run (decode-side reuse pulls only what it lacks).
    assert d.delta(db, "tandem:kv_transfer_bytes_sum") == \
        (sum(-(-len(q) // 16) for q, _ in jobs) - len(stop_prompt) // 16) * BLOCK_BYTES
    assert d.delta(db, "tandem:kv_transfer_seconds_sum") > 0
    assert d.delta(db, "tandem:inter_token_latency_seconds_count") > 0
    # Each decode step computes one token per running sequence: the one it samples from; with
    # pipelined steps (the default) also the stop request's token after its stop token (its
    # next step was in flight when the stop token reached the host; that row is discarded).
    assert d.delta(db, "tandem:iteration_tokens_total_sum") - (generated - n) in (0, 1)
    assert d.delta(db, "tandem:iteration_tokens_total_count") >= max(lengths) - 1
    for hist in ("request_queue_time_seconds", "time_to_first_token_seconds",
                 "e2e_request_latency_seconds"):
        assert d.delta(db, f"tandem:{hist}_count") == n, hist
    for s in (p, d):
        assert s("tandem:num_preemptions_total") == 0


def test_prefix_cache_hits_when_prompts_share_a_prefix(cluster):
    shared = [(5 * j) % 300 + 100 for j in range(48)]  # three full blocks
    prompts = [shared + [(17 * i + j) % 90 + 1 for j in range(10)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    before = scrape_all(cluster)["prefill0"]
    run(cluster, [(prompts[0], params)])
    results = run(cluster, [(q, params) for q in prompts[1:]])
    after = scrape_all(cluster)["prefill0"]

    assert [u.cached_prompt_tokens for _, _, u in results] == [48, 48, 48]
    assert after.delta(before, "tandem:prefix_cache_queries_total") == 4 * 48
    assert after.delta(before, "tandem:prefix_cache_hits_total") == 3 * 48


def test_gauges_during_load_and_back_to_zero_when_idle(cluster):
    """Scraped while the decode worker's engine core is held still (SIGSTOP), so that no request
    can finish before the scrapes and the cancel however fast the stack runs ahead of this
    client (an unstopped stack can stream all 400 tokens of every request into the client's
    buffers before the client reads its first few): the router counts all four running, the
    decode worker (held after its first decode step) some running and KV in use; a client that
    goes away is counted as an abort on both; idle again, every gauge is back to zero."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    prompts = [[(13 * i + 3 * j) % 450 + 2 for j in range(20 + 7 * i)] for i in range(4)]
    core = cluster.engine_core("decode0")
    before = scrape_all(cluster)

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            os.kill(core, signal.SIGSTOP)
            try:
                calls = [stub.Generate(request(q, params)) for q in prompts]
                router = await until(lambda: Scrape(cluster.router), lambda s: (
                    s("tandem:num_requests_running") != 4
                    and f"router: {s('tandem:num_requests_running')} running, not 4"))
                os.kill(core, signal.SIGCONT)
                for _ in range(2):  # the prefill's first token, then one from the decode
                    await calls[0].read()
                os.kill(core, signal.SIGSTOP)
                decode = Scrape(cluster.procs["decode0"])
                calls[0].cancel()  # a client that goes away, before its request can end
            finally:
                os.kill(core, signal.SIGCONT)
            for call in calls[1:]:
                while (await call.read()) is not grpc.aio.EOF:
                    pass
            return router, decode

    r, d = asyncio.run(main())
    assert r("tandem:num_requests_running") == 4 and r("tandem:num_requests_waiting") == 0
    assert d("tandem:num_requests_running") >= 1
    assert 0 < d("tandem:kv_cache_usage_perc") < 1

    def busy(after: dict[str, Scrape]) -> dict[tuple[str, str], float]:
        """The gauges not back to zero."""
        return {(name, g): v for name, s in after.items()
                for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
                if (v := s(f"tandem:{g}"))}

    after = asyncio.run(until(lambda: scrape_all(cluster), busy))
    r, rb, d, db = after["router"], before["router"], after["decode0"], before["decode0"]
    assert r.delta(rb, "tandem:request_success_total", finished_reason="abort") == 1
    assert r.delta(rb, "tandem:request_success_total", finished_reason="length") == 3
    assert d.delta(db, "tandem:request_success_total", finished_reason="abort") == 1
    assert d.delta(db, "tandem:request_success_total", finished_reason="length") == 3
