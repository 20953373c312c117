"""The pieces of router_svc/api_processes.py that need no process: the other processes' command
line, and one exposition of several processes' metrics."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tandem.router_svc.api_processes import _replace_flags, merge_expositions
from tandem.runtime.metrics import Metrics


def test_the_other_processes_command_line_overrides_the_flags_it_sets():
    argv = ["router", "--model", "m", "--grpc-port", "0", "--http-port=0", "--api-processes",
            "4", "--ready-file", "/tmp/r", "--workers", "a:1"]
    out = _replace_flags(argv, {"--grpc-port": "5000", "--http-port": "8000",
                                "--api-processes": "1", "--ready-file": None})
    assert out == ["router", "--model", "m", "--workers", "a:1", "--grpc-port", "5000",
                   "--http-port", "8000", "--api-processes", "1"]


def test_merged_metrics_keep_every_process_series_apart_and_parse_back():
    texts = {}
    for k, tokens in ((0, 5), (1, 7)):
        m = Metrics("router", "tiny")
        m.generation_tokens.inc(tokens)
        m.ttft.observe(0.05 * (k + 1))
        texts[k] = generate_latest(m.registry).decode()
    merged = merge_expositions(texts).decode()
    samples = [s for f in text_string_to_metric_families(merged) for s in f.samples]
    # Each family once (a family twice would be an invalid exposition), as one process writes it.
    assert merged.count("# TYPE tandem:generation_tokens_total counter") == 1
    assert texts[0].count("# TYPE tandem:generation_tokens_total counter") == 1
    tokens = {s.labels["api_process"]: s.value for s in samples
              if s.name == "tandem:generation_tokens_total"}
    assert tokens == {"0": 5.0, "1": 7.0}
    counts = {s.labels["api_process"]: s.value for s in samples
              if s.name == "tandem:time_to_first_token_seconds_count"}
    assert counts == {"0": 1.0, "1": 1.0}
    assert all(s.labels["role"] == "router" for s in samples if s.name.startswith("tandem:"))
